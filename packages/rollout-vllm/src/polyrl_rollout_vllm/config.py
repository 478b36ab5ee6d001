"""The ``vllm:`` block of the rollout config (``rollout.vllm``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class VLLMConfig:
    """vLLM engine options. Sampling, lengths, tensor parallelism and memory fraction come from
    the ``rollout`` block itself (``rollout.tensor_parallel_size``, ``rollout.gpu_memory_utilization``)."""

    #: Skip CUDA graphs (always on for the CPU backend).
    enforce_eager: bool = True
    #: Serve ``agenerate`` from vLLM's async engine (AsyncLLM) instead of batching into ``generate``.
    async_server: bool = False
    max_num_seqs: int = 256
    #: 0: vLLM's default.
    max_num_batched_tokens: int = 0
    enable_prefix_caching: bool = True
    #: KV cache size on the CPU backend, GiB (sets VLLM_CPU_KVCACHE_SPACE).
    cpu_kvcache_space_gib: int = 1
    #: ``dummy`` skips reading the checkpoint at start (weights come from the trainer's first sync).
    load_format: str = "auto"
    #: Serve a LoRA adapter (vLLM ``LoRARequest``): ``update_weights`` then also takes peft adapter tensors
    #: (``...lora_A.weight`` / ``...lora_B.weight``, the engine's ``model.lora.sync=adapter``).
    lora_adapter: bool = False
    #: Largest adapter rank vLLM reserves room for.
    max_lora_rank: int = 64
    #: The adapter's ``lora_alpha`` (scaling alpha / rank): must equal the actor's ``model.lora.alpha``.
    lora_alpha: float | None = None
    #: Extra keyword arguments for ``vllm.LLM`` / ``AsyncEngineArgs``.
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
