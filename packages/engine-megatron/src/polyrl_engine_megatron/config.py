"""The ``megatron:`` block of a role (``actor.megatron``, ``critic.megatron``, ``ref.megatron``).

The role's own keys (``micro_batch_size``, ``use_dynamic_bsz``, ``max_token_len_per_gpu``, ``optim``,
``model``) keep their meaning; this block says how the model is split over the role's workers.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class MegatronConfig:
    """Parallel layout and precision of the megatron-core engine.

    ``world_size = tensor_model_parallel_size * pipeline_model_parallel_size * data-parallel size``;
    the data-parallel size is what is left, and batches are split by it.
    """

    #: Ranks that split every weight matrix (attention heads, MLP columns, vocabulary) of one layer.
    tensor_model_parallel_size: int = 1
    #: Ranks that split the layers into consecutive stages; must divide ``num_hidden_layers``.
    pipeline_model_parallel_size: int = 1
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
