"""The ``fsdp:`` block of a role (``actor.fsdp``, ``critic.fsdp``, ``ref.fsdp``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from polyrl.errors import ConfigError


@dataclass
class FSDPConfig:
    """FSDP2 options. Dtypes are torch names (``float32``, ``bfloat16``, ``float16``)."""

    #: Compute dtype of the all-gathered parameters (mixed precision); storage stays ``model.dtype``.
    param_dtype: str = "float32"
    #: Dtype of gradient reduce-scatter.
    reduce_dtype: str = "float32"
    #: Keep sharded parameters (and gradients) on CPU; FSDP2 moves them in for compute.
    param_offload: bool = False
    #: Keep optimizer state on CPU between steps.
    optimizer_offload: bool = False
    #: Free the gathered parameters after forward (less memory, one more all-gather in backward).
    reshard_after_forward: bool = True
    #: Ranks that shard one copy of the model (verl's ``fsdp_size``): ``-1`` = all ranks (FSDP);
    #: a divisor of the world size replicates that many-way sharded copies across the rest (HSDP);
    #: ``1`` keeps a full copy on every rank and only all-reduces gradients (DDP-like).
    fsdp_size: int = -1
    #: With a whole model on each rank (``fsdp_size=1``): start each ~25 MB bucket's gradient all-reduce
    #: during the last micro-batch's backward, as soon as its gradients are ready (DDP's overlap), instead of
    #: all of them after backward. Same gradients either way.
    overlap_grad_reduce: bool = True
    #: Run each distinct prompt of a micro-batch once and let its rows' responses attend to its KV cache
    #: (GRPO's ``n`` samples of a prompt): same log-probs and gradients, ``(n - 1) / n`` of the prompt
    #: tokens' compute saved. Off with ``use_remove_padding`` or gradient checkpointing.
    shared_prompt: bool = True
    #: Take the shared-prompt form only for a micro-batch where it skips at least this many prompt tokens
    #: (``(rows - distinct prompts) x prompt width``); below that its second pass costs more than it saves
    #: (measured on CPU: break-even near 80-100 tokens, -3% to +6% at 108, 11-21% faster at 190-290). ``0``:
    #: whenever a prompt repeats.
    shared_prompt_min_tokens: int = 96
    #: In the shared-prompt form, lay a micro-batch's responses end to end in one row without their padding (each
    #: attends to its own prompt's KV cache and its own earlier tokens through a block mask) where the cost model
    #: says that is cheaper than the padded ``[rows, longest response]`` form: responses of very different lengths
    #: (short answers with a few long ones). Same log-probs and gradients; text models whose layers all attend to
    #: the whole sequence (no sliding window). ``False``: always the padded form.
    shared_prompt_packed: bool = True
    #: Ulysses sequence parallelism (verl's name): this many consecutive ranks split each sequence and exchange
    #: attention heads by all-to-all; they form one data-parallel group. Must divide the role's ranks and the
    #: model's attention heads; 1 = off. See docs/engines/fsdp.md, "Long sequences".
    ulysses_sequence_parallel_size: int = 1
    #: Move the activations the forward pass saves for backward to CPU memory, and back for backward (verl's
    #: ``enable_activation_offload``): less accelerator memory for one more copy each way.
    activation_offload: bool = False
    #: What ``export_hf`` writes for a LoRA model: ``merged`` weights or the ``adapter`` alone.
    lora_export: str = "merged"
    #: Largest safetensors file ``export_hf`` writes (transformers' ``max_shard_size``); a bigger model is
    #: split into shards with a ``model.safetensors.index.json``.
    export_max_shard_size: str = "5GB"


def torch_dtype(name: str, key: str) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16``; a ``ConfigError`` naming the config ``key`` for anything else."""
    value = getattr(torch, str(name), None)
    if not isinstance(value, torch.dtype):
        raise ConfigError(f"{key}={name!r} is not a torch dtype; use float32, bfloat16 or float16")
    return value


def check_choice(value: str, allowed: tuple[str, ...], key: str) -> None:
    """A ``ConfigError`` naming the config ``key`` unless ``value`` is one of ``allowed``."""
    if value not in allowed:
        raise ConfigError(f"{key}={value!r}: choose one of {', '.join(allowed)}")
