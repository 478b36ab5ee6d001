"""Config schemas shared by every engine and rollout plugin.

A role's block names its plugin and carries the plugin's own options under the
plugin's name, validated against the schema the plugin registered through
``register_config_schemas`` (``"engine.fsdp"``, ``"rollout.vllm"``):

```yaml
actor:
  engine: fsdp
  model: {path: /ckpt/qwen}
  fsdp: {param_offload: true}      # -> actor.plugin_config, an FSDPConfig
rollout:
  name: vllm
  vllm: {enforce_eager: true}      # -> rollout.plugin_config
```

Factories receive these objects (``config.plugin_config`` is the plugin's dataclass).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class LoRAConfig:
    """LoRA through peft. ``rank=0`` disables it."""

    rank: int = 0
    alpha: int = 16
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    #: What ``weights_for_rollout`` sends: ``merged`` full weights or the ``adapter`` alone.
    sync: str = "merged"


@dataclass
class ModelConfig:
    """Which model a role trains or serves.

    ``path`` is a local HF folder. With ``random_init`` only its ``config.json`` is
    read and the weights are freshly initialised (seeded): tiny models for tests.
    """

    path: str = "???"
    tokenizer_path: str | None = None
    random_init: bool = False
    trust_remote_code: bool = False
    #: Storage dtype of the trained parameters (``float32``; mixed precision is per engine).
    dtype: str = "float32"
    attn_implementation: str = "sdpa"
    gradient_checkpointing: bool = False
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    #: Extra keyword arguments for the HF config (``{"num_hidden_layers": 2}``).
    override_config: dict[str, Any] = field(default_factory=dict)
    #: A vision-language model's vision tower (and its merger into the language model) is not trained;
    #: weight sync then leaves it out (the rollout loaded the same weights). verl's ``freeze_vision_tower``.
    freeze_vision_tower: bool = False


@dataclass
class OptimConfig:
    """AdamW with linear warmup and a learning-rate schedule by transformers' name (:mod:`polyrl.lr_schedules`)."""

    lr: float = 1e-6
    weight_decay: float = 0.01
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    #: The LR schedule, by transformers' name: constant, linear, cosine, cosine_with_restarts, polynomial,
    #: inverse_sqrt, warmup_stable_decay, ... (``constant`` and ``cosine`` warm up; ``cosine`` ends at ``min_lr_ratio``).
    lr_scheduler_type: str = "constant"
    #: verl's older name for ``lr_scheduler_type``; wins when set.
    warmup_style: str | None = None
    #: Linear warmup steps; negative: ``lr_warmup_steps_ratio`` of ``total_steps``.
    lr_warmup_steps: int = -1
    #: Warmup as a fraction of ``total_steps`` (used when ``lr_warmup_steps`` is negative).
    lr_warmup_steps_ratio: float = 0.0
    #: The final LR as a fraction of ``lr`` (cosine, polynomial, warmup_stable_decay).
    min_lr_ratio: float = 0.0
    #: Cosine waves: ``null`` = the schedule's default (0.5 for ``cosine``, 1 for ``cosine_with_restarts``).
    num_cycles: float | None = None
    #: Further arguments of the transformers schedule (``power`` of polynomial, ``num_decay_steps`` of
    #: warmup_stable_decay, ...).
    lr_scheduler_kwargs: dict[str, Any] = field(default_factory=dict)
    #: Optimizer steps of the whole run; the trainer fills it in.
    total_steps: int = 0
    grad_clip: float = 1.0
    #: The fused AdamW kernel (one kernel over all parameters): ``None`` uses it where the engine's device
    #: supports it (CUDA, CPU, ...), ``false`` falls back to the multi-tensor (``foreach``) implementation.
    fused: bool | None = None


@dataclass
class EngineRoleConfig:
    """A training-side role (actor, critic, reference) and how its engine batches."""

    engine: str = "fsdp"
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    #: Sequences per micro-batch (per device) when ``use_dynamic_bsz`` is off.
    micro_batch_size: int = 4
    #: Pack micro-batches by a token budget instead of a fixed count (verl's ``use_dynamic_bsz``).
    use_dynamic_bsz: bool = False
    #: Token budget per micro-batch with ``use_dynamic_bsz`` (verl's ``ppo_max_token_len_per_gpu``).
    max_token_len_per_gpu: int = 16384
    #: Run the model on packed sequences without padding where the attention supports it.
    use_remove_padding: bool = False
    #: Chunk size (tokens) of the log-prob / entropy computation over the vocabulary.
    logits_chunk_size: int = 1024
    seed: int = 1
    #: The engine plugin's own options (its registered schema), set from the block named after ``engine``.
    plugin_config: Any = None


@dataclass
class RolloutConfig:
    """The generation side. Sampling fields follow verl's ``rollout`` block."""

    name: str = "hf"
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    #: Samples per prompt (GRPO's group size).
    n: int = 4
    prompt_length: int = 512
    response_length: int = 512
    #: Longest prompt + response the rollout accepts; 0 means ``prompt_length + response_length``.
    max_model_len: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    #: Sequences generated together by a batch rollout (``hf``).
    max_batch_size: int = 64
    #: Devices one rollout engine shards the model over (a replica of this many workers on one node; must
    #: divide the rollout workers). >1 needs a rollout that supports it (``vllm``, ``sglang``).
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.5
    #: Release memory around generation when colocated with training (``sleep``/``wake_up``).
    free_cache_engine: bool = True
    dtype: str = "float32"
    seed: int = 0
    #: Sampling for validation.
    val_temperature: float = 0.0
    val_top_p: float = 1.0
    val_n: int = 1
    plugin_config: Any = None
