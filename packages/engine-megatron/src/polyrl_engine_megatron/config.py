"""The ``megatron:`` block of a role (``actor.megatron``, ``critic.megatron``, ``ref.megatron``).

The role's own keys (``micro_batch_size``, ``use_dynamic_bsz``, ``max_token_len_per_gpu``, ``use_remove_padding``,
``logits_chunk_size``, ``optim``, ``model``) keep their meaning; this block says how the model is split over the
role's workers, and megatron-core's own switches (mixture-of-experts routing, recomputation). Names follow verl's
``megatron`` block and megatron-core's ``TransformerConfig``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class MegatronConfig:
    """Parallel layout, precision and memory options of the megatron-core engine.

    ``world_size = tensor_model_parallel_size * context_parallel_size * pipeline_model_parallel_size *
    data-parallel size``; the data-parallel size is what is left, and batches are split by it. Expert parallelism
    splits a mixture of experts' experts over ranks that are data-parallel (or context-parallel) for the rest of
    the model.
    """

    #: Ranks that split every weight matrix (attention heads, MLP columns, vocabulary) of one layer.
    tensor_model_parallel_size: int = 1
    #: Ranks that split the layers into consecutive stages; must divide ``num_hidden_layers``.
    pipeline_model_parallel_size: int = 1
    #: Ranks that split every sequence (megatron's load-balanced ``2 x CP`` chunks; attention all-gathers the
    #: keys and values). They get the same rows, like tensor-parallel ranks.
    context_parallel_size: int = 1
    #: Ranks that split a mixture of experts' experts (must divide the number of experts); tokens travel to their
    #: experts by all-to-all.
    expert_model_parallel_size: int = 1
    #: Ranks that split each expert's matrices; ``null`` = ``tensor_model_parallel_size`` (megatron's default).
    expert_tensor_parallel_size: int | None = None
    #: Shard activations along the sequence between tensor-parallel regions (needs TP > 1).
    sequence_parallel: bool = False
    #: Shard the optimizer state (and the fp32 main weights) over the data-parallel ranks (ZeRO-1).
    use_distributed_optimizer: bool = False
    #: Compute dtype of the model's parameters: ``float32``, ``bfloat16`` or ``float16`` (mixed precision
    #: with fp32 main weights in the optimizer for the latter two). ``null`` = ``model.dtype``.
    param_dtype: str | None = None
    #: Reduce gradients across data-parallel ranks in fp32 (with ``param_dtype`` bfloat16/float16).
    grad_reduce_in_fp32: bool = True
    #: Largest safetensors file ``export_hf`` writes; a bigger model is split with an index file.
    export_max_shard_size: str = "5GB"

    # ---- mixture of experts (megatron-core's TransformerConfig names; an error on a dense model)
    #: Weight of the router's load-balancing loss (0: none, as HF trains unless ``output_router_logits``).
    moe_aux_loss_coeff: float = 0.0
    #: ``aux_loss`` (per micro-batch, Switch-Transformer style), ``seq_aux_loss`` (per sequence),
    #: ``global_aux_loss`` (over the global batch) or ``none``.
    moe_router_load_balancing_type: str = "aux_loss"
    #: Weight of the router z-loss (``null``: none).
    moe_z_loss_coeff: float | None = None
    #: How tokens reach their experts: ``alltoall`` (verl's default) or ``allgather``.
    moe_token_dispatcher_type: str = "alltoall"

    # ---- memory
    #: Activation recomputation: ``full`` (whole layers), ``selective`` (``recompute_modules`` only) or ``null``
    #: (``model.gradient_checkpointing=true`` means full recomputation of every layer).
    recompute_granularity: str | None = None
    #: With ``full``: ``uniform`` (groups of ``recompute_num_layers`` layers) or ``block`` (the first
    #: ``recompute_num_layers`` layers of each stage).
    recompute_method: str | None = None
    recompute_num_layers: int | None = None
    #: With ``selective``: megatron's module names (``core_attn``, ``mlp``, ``moe``, ``moe_act``, ``layernorm``).
    recompute_modules: list[str] | None = None
    #: Keep the activations saved for backward in host memory during the forward pass and bring them back for
    #: the backward pass (``torch.autograd.graph.save_on_cpu``; a no-op on the ``cpu`` platform).
    activation_offload: bool = False
    #: Further megatron-core ``TransformerConfig`` fields (verl's ``override_transformer_config``); an unknown
    #: field is an error naming it.
    override_transformer_config: dict[str, Any] = field(default_factory=dict)
