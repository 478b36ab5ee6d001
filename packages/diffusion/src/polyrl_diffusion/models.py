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
  text encoders and VAE of a real model; the prompt is encoded by the pipeline's own ``encode_prompt``.

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
    "make_tiny_pipeline",
    "pipeline_family",
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
    return cls.from_pretrained(str(Path(path) / "transformer"), torch_dtype=dtype)


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
                         embeds: TextEmbeddings) -> torch.Tensor:
    """``v_theta(latents, sigma, text)`` ``[N, C, H, W]`` for ``N`` rows (``sigma`` ``[N]``), in float32.

    SD3 takes the timestep as ``1000 * sigma``; FLUX takes ``sigma`` itself and packed latents with
    position ids (and a guidance embedding for guidance-distilled checkpoints, set to 1 here).
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
    guidance = torch.ones(b, device=latents.device, dtype=dtype) if getattr(config, "guidance_embeds", False) else None
    out = transformer(hidden_states=_pack(x), encoder_hidden_states=text, pooled_projections=pooled,
                      timestep=sigma.to(dtype), img_ids=img_ids, txt_ids=txt_ids, guidance=guidance,
                      return_dict=False)[0]
    return _unpack(out.float(), c, h, w)


# ---------------------------------------------------------------------------- the whole model (rollout side)


class FlowModel:
    """Transformer + text conditioning + latent space of one pipeline folder.

    Built with :func:`load_flow_model`. ``encode(prompts)`` -> :class:`TextEmbeddings`;
    ``velocity(latents, sigma, embeds)``; ``decode(latents)`` -> ``uint8 [N, 3, H, W]``;
    ``latent_shape(height, width)``; ``shift`` of the sigma schedule.
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

            self.pipeline = DiffusionPipeline.from_pretrained(str(path), torch_dtype=dtype).to(self.device)
            self.transformer = self.pipeline.transformer.eval()
            self.vae = self.pipeline.vae
            self.tokenizer = self.pipeline.tokenizer
            self.text_encoder = None
            self.max_text_length = int(getattr(self.pipeline, "tokenizer_max_length", 77))
            self.shift = float(getattr(self.pipeline.scheduler.config, "shift", 1.0))
        self.transformer.requires_grad_(False)

    # ---------------------------------------------------------------- shapes
    def latent_shape(self, height: int = 0, width: int = 0) -> tuple[int, int, int]:
        """``(C, H, W)`` of the latents for an image of ``height x width`` pixels (0: the model's default)."""
        cfg = self.transformer.config
        if self.family == "sd3":
            channels, default = int(cfg.in_channels), int(cfg.sample_size)
        else:
            channels, default = int(cfg.in_channels) // 4, 64 if not self.tiny else 8
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
    def velocity(self, latents: torch.Tensor, sigma: torch.Tensor, embeds: TextEmbeddings) -> torch.Tensor:
        """The transformer's velocity (see :func:`transformer_velocity`)."""
        return transformer_velocity(self.transformer, self.family, latents, sigma, embeds)

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

    def sigma_shift(self, latent_hw: tuple[int, int]) -> float:
        """The schedule's shift (SD3's static ``shift``; FLUX's dynamic one from the image size)."""
        if self.pipeline is None:
            return self.shift
        sched = self.pipeline.scheduler.config
        if not getattr(sched, "use_dynamic_shifting", False):
            return self.shift
        import math

        seq = (latent_hw[0] // 2) * (latent_hw[1] // 2)
        lo, hi = sched.base_image_seq_len, sched.max_image_seq_len
        mu = sched.base_shift + (sched.max_shift - sched.base_shift) * (seq - lo) / (hi - lo)
        return math.exp(mu)  # exp(mu) s / (1 + (exp(mu) - 1) s) is FLUX's exponential time shift


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
