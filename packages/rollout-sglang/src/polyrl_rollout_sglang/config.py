"""The ``sglang:`` block of the rollout config (``rollout.sglang``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class SGLangConfig:
    """SGLang engine options. Sampling, lengths, tensor parallelism, dtype, seed and the memory fraction come
    from the ``rollout`` block itself (``rollout.tensor_parallel_size``, ``rollout.gpu_memory_utilization``)."""

    #: SGLang's ``mem_fraction_static`` (weights + KV cache); 0: ``rollout.gpu_memory_utilization``.
    mem_fraction_static: float = 0.0
    #: Start the engine with SGLang's memory saver, so ``sleep()`` really frees weights and KV cache
    #: (``release_memory_occupation``). Needed when colocated with training.
    enable_memory_saver: bool = True
    #: Requests the engine runs at once; 0: SGLang's default.
    max_running_requests: int = 0
    #: Turn off SGLang's radix (prefix) cache.
    disable_radix_cache: bool = False
    #: SGLang's attention backend (``""``: its default for the device).
    attention_backend: str = ""
    #: Skip CUDA graphs (faster start, slower decode).
    disable_cuda_graph: bool = False
    #: SGLang's own log level.
    log_level: str = "error"
    #: Start even when the installed SGLang is outside the range this rollout was written against.
    allow_untested_version: bool = False
    #: Serve a LoRA adapter (SGLang's ``load_lora_adapter``): ``update_weights`` then also takes peft adapter
    #: tensors (``...lora_A.weight`` / ``...lora_B.weight``, the engine's ``model.lora.sync=adapter``).
    lora_adapter: bool = False
    #: Largest adapter rank SGLang reserves room for.
    max_lora_rank: int = 64
    #: The adapter's ``lora_alpha``: must equal the actor's ``model.lora.alpha``.
    lora_alpha: float | None = None
    #: Modules SGLang prepares for adapters (``["all"]``: every linear layer it supports).
    lora_target_modules: list[str] = field(default_factory=lambda: ["all"])
    #: Sequences the batching front of ``agenerate`` sends to the engine at once.
    max_batch_size: int = 256
    #: Extra keyword arguments for ``sglang.Engine`` (its ``ServerArgs``).
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
