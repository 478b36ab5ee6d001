"""Flow-matching text-to-image models: the pieces the rollout and the engine use, per model family.

A model is a folder. Two kinds load:

* a **polyrl tiny pipeline** (``model_index.json`` ``_class_name: PolyrlFlowPipeline``), written by
  :func:`make_tiny_pipeline` with no download: a diffusers transformer (``SD3Transformer2DModel`` or
  ``FluxTransformer2DModel``) from a tiny config, one tiny CLIP text encoder
  (``CLIPTextModelWithProjection`` from a config) with a word-level ``tokenizers`` tokenizer over a fixed
  vocabulary, and an *identity latent space* (the latents are the RGB pixels in [-1, 1]; no VAE). Why:
  one text encoder instead of SD3's three keeps the model a few MB and the whole RL run on a laptop CPU,
  while the transformer, its conditioning inputs and the sampler are exactly those of the real family.
* a **diffusers checkpoint folder** (``StableDiffusion3Pipeline``, ``FluxPipeline``): the transformer,
  text encoders and VAE of a real model; the prompt is encoded by the pipeline's own ``encode_prompt`` and the
  sigma schedule is the pipeline's scheduler's. :func:`make_tiny_diffusers_pipeline` writes such a folder with
  tiny random-init components (no download); the tests check polyrl's sampler against the pipeline itself.

Any other ``_class_name`` is a :class:`polyrl.errors.ConfigError` naming the key and the supported classes.
:class:`FlowModel` hides the family differences: text encoding, the transformer call (latent packing,
timestep scale, position ids) and decoding to images.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from polyrl.errors import ConfigError

logger = logging.getLogger(__name__)

__all__ = [
    "SUPPORTED_PIPELINES",
    "FlowModel",
    "TextEmbeddings",
    "load_flow_model",
    "load_transformer",
    "make_tiny_diffusers_pipeline",
    "make_tiny_pipeline",
    "pipeline_family",
    "pixels_per_latent",
    "transformer_velocity",
]

#: ``model_index.json`` ``_class_name`` -> model family.
SUPPORTED_PIPELINES = {
    "PolyrlFlowPipeline": None,  # family read from the file's "family" key
    "StableDiffusion3Pipeline": "sd3",
    "FluxPipeline": "flux",
}

#: Words of the tiny tokenizer (prompts outside it map to [UNK]).
TINY_VOCAB = (  # noqa: SIM905
    "a an the of in on with and photo image picture painting drawing of bright dark light black white grey gray "
    "red green blue yellow orange purple pink brown colourful colorful dull vivid pale sky sea sun night day "
    "cat dog tree house car flower field city forest mountain river beach snow fire text sign says word"
).split()
_SPECIALS = ["[PAD]", "[UNK]", "[BOS]", "[EOS]"]


@dataclass
class TextEmbeddings:
    """What the transformer is conditioned on: ``prompt_embeds`` ``[B, L, D]`` and ``pooled`` ``[B, Dp]``."""

    prompt_embeds: torch.Tensor
    pooled: torch.Tensor


# ---------------------------------------------------------------------------- folder kinds


def _model_index(path: str | Path, key: str) -> dict[str, Any]:
    index = Path(path) / "model_index.json"
    if not index.is_file():
        raise ConfigError(f"{key}={path}: no model_index.json there; give a diffusers pipeline folder "
                          "(StableDiffusion3Pipeline, FluxPipeline) or one written by "
                          "polyrl_diffusion.models.make_tiny_pipeline")
    return json.loads(index.read_text())


def pipeline_family(path: str | Path, key: str = "actor.model.path") -> tuple[str, bool]:
    """``(family, tiny)`` of the pipeline folder at ``path``; a ConfigError naming ``key`` otherwise."""
    index = _model_index(path, key)
    name = index.get("_class_name")
    if name not in SUPPORTED_PIPELINES:
        raise ConfigError(f"{key}={path}: model_index.json _class_name={name!r} is not supported by polyrl-diffusion; "
                          f"supported: {', '.join(SUPPORTED_PIPELINES)}")
    if name == "PolyrlFlowPipeline":
        family = index.get("family")
        if family not in ("sd3", "flux"):
            raise ConfigError(f"{key}={path}: model_index.json family={family!r}; choose 'sd3' or 'flux'")
        return family, True
    return SUPPORTED_PIPELINES[name], False


def load_transformer(path: str | Path, key: str = "actor.model.path", dtype: torch.dtype = torch.float32) -> nn.Module:
    """The pipeline's transformer alone (what the engine trains)."""
    family, _ = pipeline_family(path, key)
    from diffusers import FluxTransformer2DModel, SD3Transformer2DModel

    cls = SD3Transformer2DModel if family == "sd3" else FluxTransformer2DModel
    return cls.from_pretrained(str(Path(path) / "transformer"), **_dtype_kwarg(dtype))


def _dtype_kwarg(dtype: torch.dtype) -> dict[str, torch.dtype]:
    """diffusers' ``from_pretrained`` dtype argument: ``dtype`` where supported (0.42+ deprecates ``torch_dtype``)."""
    try:
        from diffusers.utils.deprecation_utils import _resolve_dtype  # noqa: F401  (present where `dtype` is)
    except ImportError:
        return {"torch_dtype": dtype}
    return {"dtype": dtype}


def pixels_per_latent(path: str | Path, key: str = "actor.model.path") -> int:
    """Image pixels per latent pixel of the pipeline folder at ``path`` (1 for the tiny identity latent space; the
    VAE's ``2 ** (len(block_out_channels) - 1)`` for a real folder), read from its config files."""
    _, tiny = pipeline_family(path, key)
    if tiny:
        return 1
    vae = Path(path) / "vae" / "config.json"
    if not vae.is_file():
        raise ConfigError(f"{key}={path}: no vae/config.json in the pipeline folder")
    return 2 ** (len(json.loads(vae.read_text())["block_out_channels"]) - 1)


# ---------------------------------------------------------------------------- the transformer call, per family


def _pack(latents: torch.Tensor) -> torch.Tensor:
    """FLUX's 2x2 patch packing ``[B, C, H, W] -> [B, H/2 * W/2, 4C]``."""
    b, c, h, w = latents.shape
    x = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def _unpack(packed: torch.Tensor, c: int, h: int, w: int) -> torch.Tensor:
    b = packed.shape[0]
    x = packed.view(b, h // 2, w // 2, c, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, c, h, w)


def _flux_ids(h: int, w: int, text_len: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    img = torch.zeros(h // 2, w // 2, 3)
    img[..., 1] = torch.arange(h // 2)[:, None]
    img[..., 2] = torch.arange(w // 2)[None, :]
    return img.reshape(-1, 3).to(device, dtype), torch.zeros(text_len, 3, device=device, dtype=dtype)


def transformer_velocity(transformer: nn.Module, family: str, latents: torch.Tensor, sigma: torch.Tensor,
                         embeds: TextEmbeddings, guidance: float = 1.0) -> torch.Tensor:
    """``v_theta(latents, sigma, text)`` ``[N, C, H, W]`` for ``N`` rows (``sigma`` ``[N]``), in float32.

    SD3 takes the timestep as ``1000 * sigma``; FLUX takes ``sigma`` itself and packed latents with
    position ids, and a guidance-distilled FLUX transformer (``guidance_embeds``, e.g. FLUX.1-dev) the value
    ``guidance`` in its guidance embedding (``trainer.flow_grpo.embedded_guidance``; diffusers' pipeline
    calls it ``guidance_scale``). Models without the embedding ignore ``guidance``.
    """
    dtype = next(transformer.parameters()).dtype
    x = latents.to(dtype)
    text, pooled = embeds.prompt_embeds.to(dtype), embeds.pooled.to(dtype)
    if family == "sd3":
        out = transformer(hidden_states=x, encoder_hidden_states=text, pooled_projections=pooled,
                          timestep=sigma.to(dtype) * 1000, return_dict=False)[0]
        return out.float()
    b, c, h, w = latents.shape
    img_ids, txt_ids = _flux_ids(h, w, text.shape[1], latents.device, dtype)
    config = getattr(transformer, "config", None)
    embedded = (torch.full((b,), float(guidance), device=latents.device, dtype=dtype)
                if getattr(config, "guidance_embeds", False) else None)
    out = transformer(hidden_states=_pack(x), encoder_hidden_states=text, pooled_projections=pooled,
                      timestep=sigma.to(dtype), img_ids=img_ids, txt_ids=txt_ids, guidance=embedded,
                      return_dict=False)[0]
    return _unpack(out.float(), c, h, w)


# ---------------------------------------------------------------------------- the whole model (rollout side)


class FlowModel:
    """Transformer + text conditioning + latent space of one pipeline folder.

    Built with :func:`load_flow_model`. ``encode(prompts)`` -> :class:`TextEmbeddings`;
    ``velocity(latents, sigma, embeds)``; ``decode(latents)`` -> ``uint8 [N, 3, H, W]``;
    ``latent_shape(height, width)``; ``sigma_schedule(num_steps, latent_hw)``.
    """

    def __init__(self, path: str | Path, *, key: str = "actor.model.path", device: Any = "cpu",
                 dtype: torch.dtype = torch.float32) -> None:
        self.path = Path(path)
        self.family, self.tiny = pipeline_family(path, key)
        self.device = torch.device(device)
        self.key = key
        if self.tiny:
            from transformers import CLIPTextModelWithProjection, PreTrainedTokenizerFast

            self.transformer = load_transformer(path, key, dtype).to(self.device).eval()
            self.tokenizer = PreTrainedTokenizerFast.from_pretrained(str(self.path / "tokenizer"))
            self.text_encoder = CLIPTextModelWithProjection.from_pretrained(str(self.path / "text_encoder")).to(
                self.device).eval()
            self.max_text_length = int(self.text_encoder.config.max_position_embeddings)
            index = json.loads((self.path / "model_index.json").read_text())
            self.shift = float(index.get("shift", 1.0))
            self.pipeline = None
            self.vae = None
        else:
            from diffusers import DiffusionPipeline

            self.pipeline = DiffusionPipeline.from_pretrained(str(path), **_dtype_kwarg(dtype)).to(self.device)
            self.transformer = self.pipeline.transformer.eval()
            self.vae = self.pipeline.vae
            self.tokenizer = self.pipeline.tokenizer
            self.text_encoder = None
            self.max_text_length = int(getattr(self.pipeline, "tokenizer_max_length", 77))
            self.shift = float(getattr(self.pipeline.scheduler.config, "shift", 1.0))
        self.transformer.requires_grad_(False)

    # ---------------------------------------------------------------- shapes
    def move_to(self, device: Any) -> None:
        """Move every module (transformer, text encoders, VAE) to ``device``, their parameters kept (the
        rollout's sleep / wake); :attr:`device`, where inputs are made, stays the compute device."""
        if self.pipeline is not None:
            self.pipeline.to(device)
        else:
            self.transformer.to(device)
            self.text_encoder.to(device)

    def latent_shape(self, height: int = 0, width: int = 0) -> tuple[int, int, int]:
        """``(C, H, W)`` of the latents for an image of ``height x width`` pixels (0: the model's default)."""
        cfg = self.transformer.config
        if self.family == "sd3":
            channels, default = int(cfg.in_channels), int(cfg.sample_size)
        else:
            channels, default = int(cfg.in_channels) // 4, 8
        if not self.tiny:  # the pipeline's default image size (SD3: the transformer's sample_size; FLUX: 128)
            default = int(getattr(self.pipeline, "default_sample_size", default))
        factor = 1 if self.tiny else 2 ** (len(self.vae.config.block_out_channels) - 1)
        h = (height // factor) if height else default
        w = (width // factor) if width else default
        if h % 2 or w % 2:
            raise ConfigError(f"trainer.flow_grpo.height/width={height}x{width}: the latent size must be even "
                              f"(a multiple of {2 * factor} pixels)")
        return channels, h, w

    # ---------------------------------------------------------------- text
    def check_prompts(self, prompts: Sequence[str], key: str = "prompt") -> None:
        """A ValueError naming the first prompt longer than the text encoder takes."""
        if not self.tiny:
            return  # the pipelines' encode_prompt truncates with a warning, as diffusers does
        for p in prompts:
            n = len(self.tokenizer(p)["input_ids"])
            if n > self.max_text_length:
                raise ValueError(f"{key} {p!r} is {n} tokens long; the text encoder of {self.path} takes "
                                 f"{self.max_text_length}. Shorten it")

    @torch.no_grad()
    def encode(self, prompts: Sequence[str]) -> TextEmbeddings:
        """Text embeddings of ``prompts`` (one row each)."""
        if self.tiny:
            self.check_prompts(prompts)
            enc = self.tokenizer(list(prompts), padding="max_length", max_length=self.max_text_length,
                                 return_tensors="pt")
            out = self.text_encoder(input_ids=enc["input_ids"].to(self.device),
                                    attention_mask=enc["attention_mask"].to(self.device))
            return TextEmbeddings(out.last_hidden_state.float(), out.text_embeds.float())
        if self.family == "sd3":
            embeds, _, pooled, _ = self.pipeline.encode_prompt(list(prompts), list(prompts), list(prompts),
                                                               do_classifier_free_guidance=False, device=self.device)
        else:
            embeds, pooled, _ = self.pipeline.encode_prompt(list(prompts), list(prompts), device=self.device)
        return TextEmbeddings(embeds.float(), pooled.float())

    # ---------------------------------------------------------------- model and decoding
    def velocity(self, latents: torch.Tensor, sigma: torch.Tensor, embeds: TextEmbeddings,
                 guidance: float = 1.0) -> torch.Tensor:
        """The transformer's velocity (see :func:`transformer_velocity`)."""
        return transformer_velocity(self.transformer, self.family, latents, sigma, embeds, guidance)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Images ``uint8 [N, 3, H, W]`` from latents (identity latent space for the tiny pipelines)."""
        if self.tiny:
            x = latents
        else:
            cfg = self.vae.config
            x = latents / cfg.scaling_factor + (getattr(cfg, "shift_factor", None) or 0.0)
            x = self.vae.decode(x.to(self.vae.dtype), return_dict=False)[0].float()
        return ((x.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).cpu()

    def sigma_schedule(self, num_steps: int, latent_hw: tuple[int, int]) -> torch.Tensor:
        """``num_steps + 1`` sigmas from 1 to 0 (float32, on the CPU) for latents of ``latent_hw``.

        A diffusers folder gets exactly its pipeline's schedule, from its own scheduler configured as the
        pipeline configures it: SD3 ``set_timesteps(num_steps)`` (uniform from ``sigma_max`` to the
        scheduler's ``sigma_min``, then shifted), FLUX uniform from 1 to ``1/num_steps`` with the dynamic shift
        ``mu`` of the image's token count; both then append 0. A tiny polyrl pipeline: uniform from 1 to 0,
        then ``shift`` (:func:`polyrl_diffusion.sampler.sigma_schedule`).
        """
        if self.pipeline is None:
            from polyrl_diffusion.sampler import sigma_schedule

            return sigma_schedule(num_steps, self.shift)
        if num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {num_steps}")
        import numpy as np

        base = self.pipeline.scheduler
        sched = type(base).from_config(base.config)  # a private copy: the pipeline's own keeps its state
        cfg = sched.config
        patch = int(getattr(self.transformer.config, "patch_size", 1)) if self.family == "sd3" else 2
        seq = (latent_hw[0] // patch) * (latent_hw[1] // patch)
        kwargs: dict[str, Any] = {}
        if self.family == "flux" or getattr(cfg, "use_dynamic_shifting", False):
            lo, hi = cfg.get("base_image_seq_len", 256), cfg.get("max_image_seq_len", 4096)
            b_shift = cfg.get("base_shift", 0.5)
            m_shift = cfg.get("max_shift", 1.15 if self.family == "flux" else 1.16)
            kwargs["mu"] = b_shift + (m_shift - b_shift) * (seq - lo) / (hi - lo)
        if self.family == "flux" and not getattr(cfg, "use_flow_sigmas", False):
            kwargs["sigmas"] = np.linspace(1.0, 1 / num_steps, num_steps)
        sched.set_timesteps(num_steps, device="cpu", **kwargs)
        return sched.sigmas.detach().float().cpu()


def load_flow_model(path: str | Path, *, key: str = "actor.model.path", device: Any = "cpu",
                    dtype: torch.dtype = torch.float32) -> FlowModel:
    """:class:`FlowModel` of the pipeline folder at ``path`` (errors name ``key``)."""
    return FlowModel(path, key=key, device=device, dtype=dtype)


# ---------------------------------------------------------------------------- tiny pipelines built in code


def _tiny_tokenizer(max_length: int) -> Any:
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(_SPECIALS)}
    for word in TINY_VOCAB:
        vocab.setdefault(word, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="[BOS] $A [EOS]", special_tokens=[("[BOS]", 2), ("[EOS]", 3)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", bos_token="[BOS]",
                                   eos_token="[EOS]", model_max_length=max_length)


def make_tiny_pipeline(path: str | Path, *, family: str = "sd3", sample_size: int = 8, channels: int = 3,
                       width: int = 16, layers: int = 2, text_length: int = 12, seed: int = 0,
                       shift: float = 1.0) -> Path:
    """Write a tiny random-init pipeline folder (no download) and return its path.

    ``family`` ``sd3`` (``SD3Transformer2DModel``) or ``flux`` (``FluxTransformer2DModel``); latents are
    ``channels x sample_size x sample_size`` pixels in [-1, 1] (identity latent space); the text encoder is a
    one-layer CLIP of width ``width`` taking ``text_length`` tokens.
    """
    from diffusers import FluxTransformer2DModel, SD3Transformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    if family not in ("sd3", "flux"):
        raise ValueError(f"family={family!r}: choose 'sd3' or 'flux'")
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    heads = 2
    if family == "sd3":
        transformer = SD3Transformer2DModel(
            sample_size=sample_size, patch_size=2, in_channels=channels, out_channels=channels, num_layers=layers,
            attention_head_dim=width // heads, num_attention_heads=heads, joint_attention_dim=width,
            caption_projection_dim=width, pooled_projection_dim=width, pos_embed_max_size=max(16, sample_size))
    else:
        head_dim = width // heads
        rope = (head_dim // 4 * 1, head_dim // 4 * 1, head_dim - 2 * (head_dim // 4))
        transformer = FluxTransformer2DModel(
            patch_size=1, in_channels=channels * 4, num_layers=max(1, layers // 2), num_single_layers=max(1, layers // 2),
            attention_head_dim=head_dim, num_attention_heads=heads, joint_attention_dim=width,
            pooled_projection_dim=width, guidance_embeds=False, axes_dims_rope=rope)
    transformer.save_pretrained(str(out / "transformer"))
    tokenizer = _tiny_tokenizer(text_length)
    tokenizer.save_pretrained(str(out / "tokenizer"))
    text_config = CLIPTextConfig(vocab_size=len(tokenizer), hidden_size=width, intermediate_size=2 * width,
                                 num_hidden_layers=1, num_attention_heads=heads, max_position_embeddings=text_length,
                                 projection_dim=width, pad_token_id=0, bos_token_id=2, eos_token_id=3)
    CLIPTextModelWithProjection(text_config).save_pretrained(str(out / "text_encoder"))
    (out / "model_index.json").write_text(json.dumps({
        "_class_name": "PolyrlFlowPipeline", "family": family, "latent_space": "identity", "shift": shift,
        "transformer": ["diffusers", type(transformer).__name__],
        "text_encoder": ["transformers", "CLIPTextModelWithProjection"],
        "tokenizer": ["transformers", "PreTrainedTokenizerFast"],
    }, indent=2))
    return out


# ---------------------------------------------------------------------------- real-format pipelines, tiny


def _byte_unicode() -> dict[int, str]:
    """GPT-2/CLIP's reversible byte -> printable character table (byte-level BPE's alphabet)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _tiny_clip_tokenizer(max_length: int) -> Any:
    """A real ``CLIPTokenizer`` (byte-level BPE, CLIP's pre-tokenizer) over the 512 byte symbols of CLIP's
    vocabulary plus :data:`TINY_VOCAB`'s words as whole-word merges: any text tokenizes, nothing is downloaded."""
    from transformers import CLIPTokenizer

    chars = list(_byte_unicode().values())
    vocab: dict[str, int] = {}
    for tok in chars + [c + "</w>" for c in chars]:
        vocab.setdefault(tok, len(vocab))
    merges: list[tuple[str, str]] = []
    for word in sorted(set(TINY_VOCAB)):
        cur = word[0]
        for k, ch in enumerate(word[1:], start=1):
            right = ch + ("</w>" if k == len(word) - 1 else "")
            merged = cur + right
            if merged not in vocab:
                merges.append((cur, right))
                vocab[merged] = len(vocab)
            cur = merged
    for special in ("<|startoftext|>", "<|endoftext|>"):
        vocab[special] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=max_length)


def _tiny_t5_tokenizer(max_length: int) -> Any:
    """A real ``T5TokenizerFast`` (unigram, T5's metaspace pre-tokenizer) over letters, digits and
    :data:`TINY_VOCAB`'s words."""
    from transformers import T5TokenizerFast

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    pieces += [(c, -5.0) for c in "abcdefghijklmnopqrstuvwxyz0123456789.,!?'\"-"]
    pieces += [("\u2581" + w, -1.0) for w in sorted(set(TINY_VOCAB))]
    return T5TokenizerFast(vocab=pieces, extra_ids=0, model_max_length=max_length)


def make_tiny_diffusers_pipeline(path: str | Path, *, family: str = "sd3", sample_size: int = 8, seed: int = 0,
                                 text_length: int = 16, guidance_embeds: bool = False) -> Path:
    """Write a tiny random-init **real-format** diffusers pipeline folder (no download) and return its path.

    ``family="sd3"``: a ``StableDiffusion3Pipeline`` (``SD3Transformer2DModel``, two
    ``CLIPTextModelWithProjection`` + a ``T5EncoderModel`` with their tokenizers, an ``AutoencoderKL`` with
    SD3's scaling/shift factors, ``FlowMatchEulerDiscreteScheduler`` with shift 3). ``family="flux"``: a
    ``FluxPipeline`` (``FluxTransformer2DModel``, ``CLIPTextModel`` + ``T5EncoderModel``, ``AutoencoderKL``,
    the scheduler with dynamic shifting). The folder loads with ``DiffusionPipeline.from_pretrained`` and is
    what a real checkpoint looks like, at a few MB: for tests of code that reads real folders. Latents are
    ``sample_size x sample_size`` (images twice that: the VAE downsamples by 2); the CLIP encoders take
    ``text_length`` tokens (T5 takes the pipelines' default lengths). ``guidance_embeds``: a FLUX transformer
    with a guidance embedding, as guidance-distilled checkpoints (FLUX.1-dev) have. Needs transformers 5
    (tokenizers built from a vocabulary in memory).
    """
    import transformers
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        FluxPipeline,
        FluxTransformer2DModel,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    if int(transformers.__version__.split(".")[0]) < 5:
        raise RuntimeError(f"make_tiny_diffusers_pipeline needs transformers>=5 (its tokenizers are built from an "
                           f"in-memory vocabulary); this environment has {transformers.__version__}: "
                           "pip install -U 'transformers>=5'")
    if family not in ("sd3", "flux"):
        raise ValueError(f"family={family!r}: choose 'sd3' or 'flux'")
    out = Path(path)
    torch.manual_seed(seed)
    clip_width, t5_width, latent_channels = 16, 32, 4
    clip_tok = _tiny_clip_tokenizer(text_length)
    t5_tok = _tiny_t5_tokenizer(512)

    def clip_config() -> Any:
        return CLIPTextConfig(vocab_size=len(clip_tok), hidden_size=clip_width, intermediate_size=2 * clip_width,
                              num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=text_length,
                              projection_dim=clip_width, bos_token_id=clip_tok.bos_token_id,
                              eos_token_id=clip_tok.eos_token_id, pad_token_id=clip_tok.pad_token_id, hidden_act="gelu")

    t5 = T5EncoderModel(T5Config(vocab_size=len(t5_tok), d_model=t5_width, d_ff=2 * t5_width, d_kv=8, num_layers=1,
                                 num_heads=2, relative_attention_num_buckets=8, pad_token_id=0, eos_token_id=1,
                                 decoder_start_token_id=0))
    vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=latent_channels, block_out_channels=(8, 8),
                        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
                        layers_per_block=1, norm_num_groups=4, sample_size=2 * sample_size,
                        scaling_factor=1.5305 if family == "sd3" else 0.3611,
                        shift_factor=0.0609 if family == "sd3" else 0.1159,
                        use_quant_conv=False, use_post_quant_conv=False)
    if family == "sd3":
        transformer = SD3Transformer2DModel(
            sample_size=sample_size, patch_size=2, in_channels=latent_channels, out_channels=latent_channels,
            num_layers=2, attention_head_dim=8, num_attention_heads=2, joint_attention_dim=t5_width,
            caption_projection_dim=16, pooled_projection_dim=2 * clip_width, pos_embed_max_size=max(16, sample_size))
        pipe: Any = StableDiffusion3Pipeline(
            transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), vae=vae,
            text_encoder=CLIPTextModelWithProjection(clip_config()), tokenizer=clip_tok,
            text_encoder_2=CLIPTextModelWithProjection(clip_config()), tokenizer_2=_tiny_clip_tokenizer(text_length),
            text_encoder_3=t5, tokenizer_3=t5_tok)
    else:
        transformer = FluxTransformer2DModel(
            patch_size=1, in_channels=4 * latent_channels, num_layers=1, num_single_layers=1, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=t5_width, pooled_projection_dim=clip_width,
            guidance_embeds=guidance_embeds, axes_dims_rope=(4, 4, 8))
        scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5,
                                                    max_shift=1.15, base_image_seq_len=4, max_image_seq_len=64)
        pipe = FluxPipeline(transformer=transformer, scheduler=scheduler, vae=vae, text_encoder=CLIPTextModel(
            clip_config()), tokenizer=clip_tok, text_encoder_2=t5, tokenizer_2=t5_tok)
    pipe.save_pretrained(str(out))
    return out
