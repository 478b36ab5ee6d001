"""Tiny models and tokenizers built in code, with no download.

Tests, benchmarks and the quickstart use these; real users point the same code
at real checkpoints. :func:`make_tiny_model` writes an HF folder (``config.json``,
safetensors weights, tokenizer files with a chat template) that transformers,
vLLM and polyrl's engines all load like any other checkpoint.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

#: A chat template small enough for tiny models: "<|user|>...\n<|assistant|>".
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}<|system|>{{ message['content'] }}\n"
    "{% elif message['role'] == 'user' %}<|user|>{{ message['content'] }}\n"
    "{% elif message['role'] == 'assistant' %}<|assistant|>{{ message['content'] }}<|end|>\n"
    "{% else %}<|{{ message['role'] }}|>{{ message['content'] }}\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIAL_TOKENS = ["<|pad|>", "<|end|>", "<|user|>", "<|assistant|>", "<|system|>", "<|tool|>"]


def build_char_tokenizer(*, model_max_length: int = 2048, vocab_size: int | None = None) -> Any:
    """A character-level HF tokenizer: byte-level BPE with no merges (256 byte tokens + specials).

    Byte-level like Qwen2's and GPT-2's, so ``AutoTokenizer`` (which may pick the
    model family's tokenizer class) and vLLM round-trip any text through it.
    ``<|end|>`` is EOS, ``<|pad|>`` is padding; the chat template is :data:`CHAT_TEMPLATE`.
    ``vocab_size``: pad the vocabulary to this many ids with tokens text never encodes to (``<|x0|>``, ...,
    which decode to their own spelling), so a model built with it has a real model's embedding and output
    sizes (Qwen2.5's 151936, say) while text still encodes by character.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab.setdefault(ch, len(vocab))
    if vocab_size is not None:
        if vocab_size < len(vocab):
            raise ValueError(f"build_char_tokenizer: vocab_size={vocab_size} is below the {len(vocab)} ids of the "
                             "bytes and special tokens")
        for i in range(vocab_size - len(vocab)):
            vocab[f"<|x{i}|>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<|pad|>",
        eos_token="<|end|>",
        model_max_length=model_max_length,
        padding_side="left",
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_bpe_tokenizer(texts: Iterable[str], vocab_size: int = 512, *, model_max_length: int = 2048) -> Any:
    """A byte-level BPE tokenizer trained on ``texts`` with the ``tokenizers`` library."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<|pad|>", eos_token="<|end|>", model_max_length=model_max_length,
        padding_side="left",
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_config(arch: str = "qwen2", *, vocab_size: int, size: str = "tiny", **overrides: Any) -> Any:
    """An HF config for a small decoder. ``size``: ``tiny`` (~0.1M params), ``small`` (~30M).

    ``arch``: ``qwen2``, ``llama``, or a mixture of experts, ``qwen3_moe`` / ``mixtral`` (4 experts of half the
    FFN size, 2 per token; Qwen3-MoE renormalises the 2 routing weights, as Qwen3-MoE checkpoints do).
    """
    from transformers import AutoConfig

    dims = {
        "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1),
        "mini": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2),
        "small": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4),
    }[size]
    model_type = {"qwen2": "qwen2", "llama": "llama", "qwen3_moe": "qwen3_moe", "mixtral": "mixtral"}[arch]
    kwargs: dict[str, Any] = dict(
        vocab_size=vocab_size,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
                rms_norm_eps=1e-6,
        **dims,
    )
    if arch == "qwen3_moe":
        kwargs.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=dims["intermediate_size"] // 2,
                      norm_topk_prob=True, head_dim=dims["hidden_size"] // dims["num_attention_heads"])
    elif arch == "mixtral":
        kwargs.update(num_local_experts=4, num_experts_per_tok=2, intermediate_size=dims["intermediate_size"] // 2)
    kwargs.update(overrides)
    return AutoConfig.for_model(model_type, **kwargs)


def make_tiny_model(
    path: str | Path,
    *,
    arch: str = "qwen2",
    size: str = "tiny",
    tokenizer: Any = None,
    seed: int = 0,
    **config_overrides: Any,
) -> Path:
    """Write a random-init causal LM with a char tokenizer to ``path`` and return it.

    The folder loads with ``AutoModelForCausalLM.from_pretrained`` and
    ``AutoTokenizer.from_pretrained``, like any real checkpoint.
    """
    import torch
    from transformers import AutoModelForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = tokenizer or build_char_tokenizer()
    config = tiny_config(
        arch,
        vocab_size=len(tokenizer),
        size=size,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
        **config_overrides,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    from transformers.utils import logging as hf_logging

    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # a "Writing model shards" bar for a model of a few KB is noise
    try:
        model.save_pretrained(path, safe_serialization=True)
    finally:
        if shown:
            hf_logging.enable_progress_bar()
    tokenizer.save_pretrained(path)
    # Some loaders (vLLM) read the template from tokenizer_config.json only.
    cfg_file = path / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg.setdefault("chat_template", CHAT_TEMPLATE)
    cfg_file.write_text(json.dumps(cfg, indent=2))
    return path


def make_tiny_reward_model(
    path: str | Path,
    *,
    arch: str = "qwen2",
    size: str = "tiny",
    tokenizer: Any = None,
    seed: int = 0,
    num_labels: int = 1,
    **config_overrides: Any,
) -> Path:
    """Write a random-init sequence classifier (``XForSequenceClassification``, ``num_labels`` scores read at
    the last token) with a char tokenizer (or ``tokenizer``) to ``path``: a reward model's checkpoint format."""
    import torch
    from transformers import AutoModelForSequenceClassification

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = tokenizer or build_char_tokenizer()
    config = tiny_config(arch, vocab_size=len(tokenizer), size=size, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.eos_token_id,
                         num_labels=num_labels, **config_overrides)
    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    cfg_file = path / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg.setdefault("chat_template", getattr(tokenizer, "chat_template", None) or CHAT_TEMPLATE)
    cfg_file.write_text(json.dumps(cfg, indent=2))
    return path


def make_tiny_value_head_model(
    path: str | Path,
    *,
    library: str = "trl",
    value_head_prefix: str = "score",
    normalize: tuple[float, float] | None = None,
    arch: str = "qwen2",
    size: str = "tiny",
    seed: int = 0,
) -> Path:
    """Write a random-init decoder saved with a scalar value head the way ``library`` saves a reward model or a
    critic, with a char tokenizer, to ``path``:

    * ``trl``: ``AutoModelForCausalLMWithValueHead.save_pretrained``: the causal LM's folder (its config names
      ``XForCausalLM``) whose weights also hold ``v_head.summary.weight`` ``[1, hidden]`` and
      ``v_head.summary.bias`` ``[1]``;
    * ``openrlhf``: ``get_llm_for_sequence_regression``'s model saved by its strategy: the base model's tensors
      (``model.*``, no ``lm_head``) and ``<value_head_prefix>.weight`` ``[1, hidden]`` (no bias); ``config.json``
      names the class ``RewardModel`` and holds ``value_head_prefix`` and ``normalize_reward``, with ``mean`` and
      ``std`` when ``normalize`` is ``(mean, std)``.

    The head's weights are random (seeded), so a test can compute the score from them by hand.
    """
    import torch
    from safetensors.torch import load_file, save_file

    if library not in ("trl", "openrlhf"):
        raise ValueError(f"library={library!r}: choose trl or openrlhf")
    path = make_tiny_model(path, arch=arch, size=size, seed=seed)
    weights = path / "model.safetensors"
    state = load_file(str(weights))
    config = json.loads((path / "config.json").read_text())
    hidden = int(config["hidden_size"])
    g = torch.Generator().manual_seed(seed + 1)
    if library == "trl":
        state["v_head.summary.weight"] = torch.randn(1, hidden, generator=g)
        state["v_head.summary.bias"] = torch.randn(1, generator=g)
    else:
        state = {k: v for k, v in state.items() if not k.startswith("lm_head.")}
        state[f"{value_head_prefix}.weight"] = torch.randn(1, hidden, generator=g)
        config.update(architectures=["RewardModel"], value_head_prefix=value_head_prefix,
                      normalize_reward=normalize is not None, use_cache=False)
        if normalize is not None:
            config.update(mean=float(normalize[0]), std=float(normalize[1]))
        (path / "config.json").write_text(json.dumps(config, indent=2))
    save_file({k: v.contiguous() for k, v in state.items()}, str(weights), metadata={"format": "pt"})
    return path
