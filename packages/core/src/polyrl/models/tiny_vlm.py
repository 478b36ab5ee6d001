"""Tiny vision-language models built in code, with no download: Qwen2-VL and Qwen2.5-VL architectures.

The sibling of :mod:`polyrl.models.tiny` for images. :func:`make_tiny_vlm` writes a folder in the
published Qwen-VL layout (``config.json``, safetensors, tokenizer files, ``preprocessor_config.json``,
``chat_template.jinja``) that transformers (``AutoModelForImageTextToText``, ``AutoProcessor`` where
torchvision is installed), vLLM and polyrl load like any real checkpoint. The tokenizer is the character
tokenizer of :mod:`polyrl.models.tiny` plus Qwen-VL's special tokens ``<|vision_start|>``,
``<|image_pad|>``, ``<|vision_end|>`` (and ``<|video_pad|>``, which the model config names).

Tests, the VLM quickstart and ``benchmarks/bench_vlm.py`` share these builders.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from polyrl.models.tiny import SPECIAL_TOKENS

#: Qwen-VL's vision tokens: an image is ``<|vision_start|>`` + one ``<|image_pad|>`` per merged patch +
#: ``<|vision_end|>`` in the token ids.
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]

#: The tiny chat template, with content given as a string or as Qwen-VL's parts (``{"type": "image"}``,
#: ``{"type": "text", "text": ...}``); an image part renders as Qwen-VL's templates render it.
VL_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}<|system|>{% elif message['role'] == 'user' %}<|user|>"
    "{% elif message['role'] == 'assistant' %}<|assistant|>{% else %}<|{{ message['role'] }}|>{% endif %}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{% if message['role'] == 'assistant' %}<|end|>{% endif %}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

#: Architectures :func:`make_tiny_vlm` builds: the name polyrl uses -> transformers' model type.
ARCHS = {"qwen2_vl": "qwen2_vl", "qwen2_5_vl": "qwen2_5_vl"}

#: Sizes: the language model's dims and the vision tower's. ``tiny`` ~0.2M parameters, ``mini`` ~1.5M.
SIZES: dict[str, dict[str, dict[str, int]]] = {
    "tiny": {"text": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                          num_key_value_heads=1),
             "vision": dict(embed_dim=32, depth=2, num_heads=2)},
    "mini": {"text": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
                          num_key_value_heads=2),
             "vision": dict(embed_dim=64, depth=2, num_heads=4)},
}


def build_vl_tokenizer(*, model_max_length: int = 4096) -> Any:
    """The character tokenizer of :func:`polyrl.models.tiny.build_char_tokenizer` with Qwen-VL's vision tokens
    and :data:`VL_CHAT_TEMPLATE` (built with the ``tokenizers`` library; ``<|end|>`` is EOS, ``<|pad|>`` pads)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = SPECIAL_TOKENS + VISION_TOKENS
    vocab = {tok: i for i, tok in enumerate(specials)}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|pad|>", eos_token="<|end|>",
                                   model_max_length=model_max_length, padding_side="left")
    fast.chat_template = VL_CHAT_TEMPLATE
    return fast


def build_image_processor(*, min_pixels: int = 28 * 28, max_pixels: int = 112 * 112) -> Any:
    """Qwen-VL's image processor (PIL backend: no torchvision needed) with Qwen's patch 14, merge 2 and
    temporal patch 2; images are resized to between ``min_pixels`` and ``max_pixels`` pixels."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(min_pixels=min_pixels, max_pixels=max_pixels, patch_size=14, merge_size=2,
                                    temporal_patch_size=2)


def tiny_vlm_config(arch: str = "qwen2_vl", *, tokenizer: Any, size: str = "tiny", **text_overrides: Any) -> Any:
    """The HF config of a small Qwen2-VL (``arch="qwen2_vl"``) or Qwen2.5-VL (``"qwen2_5_vl"``) for
    ``tokenizer`` (:func:`build_vl_tokenizer`): Qwen's vision geometry (patch 14, spatial merge 2, temporal
    patch 2) with small widths; the language model's rotary sections split its head dimension as Qwen's do."""
    from transformers import AutoConfig

    if arch not in ARCHS:
        raise ValueError(f"arch={arch!r}: choose one of {', '.join(ARCHS)}")
    if size not in SIZES:
        raise ValueError(f"size={size!r}: choose one of {', '.join(SIZES)}")
    text = dict(SIZES[size]["text"])
    vision = dict(SIZES[size]["vision"])
    half = text["hidden_size"] // text["num_attention_heads"] // 2  # rotary frequencies per head
    t_part = half // 4
    mrope = [t_part, (half - t_part) // 2, half - t_part - (half - t_part) // 2]  # Qwen: 16/24/24 of 64
    text_config = dict(
        vocab_size=len(tokenizer), max_position_embeddings=4096, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": mrope},
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False, **text)
    text_config.update(text_overrides)
    geometry = dict(patch_size=14, spatial_merge_size=2, temporal_patch_size=2, in_channels=3)
    if arch == "qwen2_vl":
        vision_config = dict(depth=vision["depth"], embed_dim=vision["embed_dim"], num_heads=vision["num_heads"],
                             mlp_ratio=2, hidden_size=text["hidden_size"], **geometry)
    else:  # Qwen2.5-VL: SwiGLU blocks, windowed attention with some full-attention blocks
        vision_config = dict(depth=vision["depth"], hidden_size=vision["embed_dim"], num_heads=vision["num_heads"],
                             intermediate_size=2 * vision["embed_dim"], out_hidden_size=text["hidden_size"],
                             window_size=56, fullatt_block_indexes=[vision["depth"] - 1], tokens_per_second=2,
                             **geometry)
    ids = {name: tokenizer.convert_tokens_to_ids(tok) for name, tok in (
        ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"))}
    return AutoConfig.for_model(ARCHS[arch], text_config=text_config, vision_config=vision_config,
                                tie_word_embeddings=False, **ids)


def make_tiny_vlm(path: str | Path, *, arch: str = "qwen2_vl", size: str = "tiny", seed: int = 0,
                  min_pixels: int = 28 * 28, max_pixels: int = 112 * 112, **text_overrides: Any) -> Path:
    """Write a random-init Qwen2-VL / Qwen2.5-VL with its tokenizer and image processor to ``path``.

    The folder loads with ``AutoModelForImageTextToText.from_pretrained``, ``AutoTokenizer``,
    ``AutoImageProcessor`` and (with torchvision installed) ``AutoProcessor``; polyrl loads its processor
    with :func:`polyrl.data.multimodal.load_processor`. Images are resized by the processor to between
    ``min_pixels`` and ``max_pixels`` pixels (112 x 112: at most 64 patches, 16 image tokens).
    """
    import torch
    from transformers import AutoModelForImageTextToText

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_vl_tokenizer()
    config = tiny_vlm_config(arch, tokenizer=tokenizer, size=size, **text_overrides)
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    from transformers.utils import logging as hf_logging

    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # a "Writing model shards" bar for a model of a few hundred KB is noise
    try:
        model.save_pretrained(path, safe_serialization=True)
    finally:
        if shown:
            hf_logging.enable_progress_bar()
    tokenizer.save_pretrained(path)
    processor = build_image_processor(min_pixels=min_pixels, max_pixels=max_pixels)
    processor.save_pretrained(path)
    (path / "chat_template.jinja").write_text(VL_CHAT_TEMPLATE)
    return path
