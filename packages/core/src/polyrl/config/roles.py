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

    #: LoRA rank (the adapter's inner dimension); 0 trains the full model.
    rank: int = 0
    #: LoRA scaling numerator: the adapter's update is scaled by ``alpha / rank``.
    alpha: int = 16
    #: Dropout on the adapter's input during training.
    dropout: float = 0.0
    #: Modules that get an adapter: peft names or patterns (``q_proj``...), or ``all-linear``.
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    #: What ``weights_for_rollout`` sends: ``merged`` full weights or the ``adapter`` alone.
    sync: str = "merged"


@dataclass
class ModelConfig:
    """Which model a role trains or serves.

    ``path`` is a local HF folder. With ``random_init`` only its ``config.json`` is
    read and the weights are freshly initialised (seeded): tiny models for tests.
    """

    #: A local HF model folder, a Hub id (``Qwen/Qwen2.5-0.5B``) or a ``.gguf`` file; required (``???``: unset).
    path: str = "???"
    #: A GGUF file inside the folder ``path`` (``path`` may also name the ``.gguf`` file itself): converted once to a
    #: cached HF folder, dequantized, before any worker starts (docs/real_models.md).
    gguf_file: str | None = None
    #: The tokenizer's folder or Hub id (``null``: the model's own, from ``path``).
    tokenizer_path: str | None = None
    #: Read only ``config.json`` from ``path`` and initialise the weights from ``actor.seed`` (tests, tiny models).
    random_init: bool = False
    #: Let transformers run the model's own code from its folder. Off unless you trust the model's source
    #: (docs/security.md).
    trust_remote_code: bool = False
    #: Storage dtype of the trained parameters (``float32``; mixed precision is per engine).
    dtype: str = "float32"
    #: transformers' attention kernel: ``sdpa``, ``eager``, ``flash_attention_2``...
    attn_implementation: str = "sdpa"
    #: Recompute activations in the backward pass (less memory, about a third more compute).
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

    #: Peak learning rate (after warmup).
    lr: float = 1e-6
    #: AdamW's decoupled weight decay.
    weight_decay: float = 0.01
    #: AdamW's ``(beta1, beta2)``.
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    #: AdamW's epsilon.
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
    #: Clip the gradients' global L2 norm to this value before each optimizer step (0: no clipping).
    grad_clip: float = 1.0
    #: The fused AdamW kernel (one kernel over all parameters): ``None`` uses it where the engine's device
    #: supports it (CUDA, CPU, ...), ``false`` falls back to the multi-tensor (``foreach``) implementation.
    fused: bool | None = None


@dataclass
class EngineRoleConfig:
    """A training-side role (actor, critic, reference) and how its engine batches."""

    #: The training engine, by its registered name (``fsdp``, ``megatron``, a plugin's); its options go in the
    #: block of the same name (``actor.fsdp: {...}``).
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
    #: Seed of the role's fresh weights: ``model.random_init``, a critic's new value head, LoRA adapters.
    seed: int = 1
    #: The engine plugin's own options (its registered schema), set from the block named after ``engine``.
    plugin_config: Any = None


@dataclass
class RolloutConfig:
    """The generation side. Sampling fields follow verl's ``rollout`` block."""

    #: The rollout, by its registered name: ``hf`` (built in), ``vllm``, ``sglang``, a plugin's; its options go
    #: in the block of the same name (``rollout.vllm: {...}``).
    name: str = "hf"
    #: Sampling temperature of training rollouts (the trainer recomputes log-probs at the same temperature).
    temperature: float = 1.0
    #: Nucleus sampling: keep the smallest set of tokens whose probability reaches ``top_p`` (1.0: off).
    top_p: float = 1.0
    #: Sample among the ``top_k`` most likely tokens (-1: off).
    top_k: int = -1
    #: Samples per prompt (GRPO's group size).
    n: int = 4
    #: Set by the trainer from ``data.max_prompt_length``.
    prompt_length: int = 512
    #: Set by the trainer from ``data.max_response_length``: the most tokens generated per response.
    response_length: int = 512
    #: Longest prompt + response the rollout accepts; 0 means ``prompt_length + response_length``.
    max_model_len: int = 0
    #: Token ids that end a response besides the tokenizer's EOS.
    stop_token_ids: list[int] = field(default_factory=list)
    #: Sequences generated together by a batch rollout (``hf``).
    max_batch_size: int = 64
    #: Devices one rollout engine shards the model over (a replica of this many workers on one node; must
    #: divide the rollout workers). >1 needs a rollout that supports it (``vllm``, ``sglang``).
    tensor_parallel_size: int = 1
    #: Fraction of an accelerator's memory a rollout engine may take for weights and KV cache (vLLM, SGLang).
    gpu_memory_utilization: float = 0.5
    #: Release memory around generation when colocated with training (``sleep``/``wake_up``).
    free_cache_engine: bool = True
    #: Dtype of the rollout's copy of the weights (``float32``, ``bfloat16``, ``float16``).
    dtype: str = "float32"
    #: The rollout engine's own random seed (vLLM, SGLang); each step's sampling is seeded from ``trainer.seed``.
    seed: int = 0
    #: Sampling temperature for validation (0: greedy).
    val_temperature: float = 0.0
    #: Nucleus sampling for validation.
    val_top_p: float = 1.0
    #: Samples per validation prompt: ``mean@1`` scores the first, ``pass@k`` / ``mean@k`` all ``k``.
    val_n: int = 1
    plugin_config: Any = None
