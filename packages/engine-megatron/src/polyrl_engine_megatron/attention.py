"""Core attention for context parallelism and packed (``thd``) sequences, in megatron's local layer spec.

megatron-core's local ``DotProductAttention`` refuses both (``context_parallel_size > 1`` and
``packed_seq_params`` need Transformer Engine's attention, which the engine does not use: one code path on CPU
and GPU). :class:`ContextParallelAttention` takes its place in the layer spec when either is on.

Layout (megatron's load-balanced one, which its rotary embedding already assumes): a sequence of padded length
``L`` is cut into ``2 * cp`` chunks of ``c = L / (2 cp)`` tokens and context-parallel rank ``r`` holds chunks ``r``
and ``2 cp - 1 - r``, so every rank gets the same share of the causal triangle. Padded micro-batches
(``[s, b, heads, dim]``) are cut as one sequence per row; packed micro-batches (``[t, heads, dim]`` with
``cu_seqlens``) sequence by sequence.

The attention all-gathers the keys and values of the context-parallel group and puts them back in sequence order;
each rank keeps its own queries, and each of its two chunks attends to the keys up to its own end, causally (a
query sees the keys of its own sequence at the same or earlier positions). The all-gather's backward sums the
key/value gradients every rank's queries produced and keeps this rank's part (a reduce-scatter). With ``cp == 1``
it is plain causal attention per sequence, which is what packed sequences need.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

__all__ = ["ContextParallelAttention", "cp_chunk_positions"]


def cp_chunk_positions(length: int, cp: int, rank: int, *, device: Any = None) -> torch.Tensor:
    """Positions ``0 .. length - 1`` of a sequence that context-parallel rank ``rank`` of ``cp`` holds, in its order.

    ``length`` must be a multiple of ``2 * cp``: chunks ``rank`` and ``2 * cp - 1 - rank`` of ``length / (2 cp)``.
    """
    if cp == 1:
        return torch.arange(length, device=device)
    if length % (2 * cp):
        raise ValueError(f"a sequence of {length} tokens does not split into {2 * cp} equal chunks (pad it first)")
    c = length // (2 * cp)
    first = torch.arange(rank * c, (rank + 1) * c, device=device)
    second = torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c, device=device)
    return torch.cat([first, second])


class _GatherSequence(torch.autograd.Function):
    """All-gather along dim 0 over ``group``; backward: the sum of every rank's gradient, this rank's slice."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        size = dist.get_world_size(group)
        parts = [torch.empty_like(tensor) for _ in range(size)]
        dist.all_gather(parts, tensor.contiguous(), group=group)
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        group = ctx.group
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        grad = grad.contiguous()
        if dist.get_backend(group) == "gloo":  # gloo has no reduce-scatter
            dist.all_reduce(grad, group=group)
            return grad.chunk(size, dim=0)[rank].contiguous(), None
        out = torch.empty_like(grad.chunk(size, dim=0)[0])
        dist.reduce_scatter_tensor(out, grad, group=group)
        return out, None


class ContextParallelAttention(nn.Module):
    """Softmax attention over a context-parallel group, for padded ``[s, b, n, d]`` or packed ``[t, n, d]`` inputs.

    Built by megatron's ``SelfAttention`` like its ``DotProductAttention`` (same constructor keywords, same
    ``forward`` signature); returns ``[s, b, n * d]`` (padded) or ``[t, n * d]`` (packed). Queries may have more
    heads than keys (grouped-query attention).
    """

    def __init__(self, config: Any, layer_number: int, attn_mask_type: Any, attention_type: str = "self",
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection: Any = None) -> None:
        super().__init__()
        from megatron.core import parallel_state as ps

        self.config = config
        self.scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        cp_group = getattr(pg_collection, "cp", None) if pg_collection is not None else None
        self.cp_group = cp_group if cp_group is not None else ps.get_context_parallel_group()
        self.cp = dist.get_world_size(self.cp_group)
        self.cp_rank = dist.get_rank(self.cp_group)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any = None,
                attn_mask_type: Any = None, attention_bias: Any = None, packed_seq_params: Any = None
                ) -> torch.Tensor:
        if attention_bias is not None:
            raise ValueError("ContextParallelAttention: attention_bias is not supported")
        if packed_seq_params is not None and getattr(packed_seq_params, "qkv_format", "thd") == "thd":
            return self._packed(query, key, value, packed_seq_params)
        # padded [s, b, n, d]: one sequence per row, all rows of the same (padded) length
        local = query.shape[0]
        order = self._key_order(local * self.cp, query.device)
        keys = self._gather(key).index_select(0, order)  # every rank's tokens, back in sequence order
        values = self._gather(value).index_select(0, order)
        out = self._attend(query.permute(1, 2, 0, 3), keys.permute(1, 2, 0, 3), values.permute(1, 2, 0, 3))
        # [b, n, s, d] -> [s, b, n * d]
        return out.permute(2, 0, 1, 3).reshape(local, query.shape[1], -1)

    # ---------------------------------------------------------------- pieces
    def _gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return _GatherSequence.apply(tensor, self.cp_group) if self.cp > 1 else tensor

    def _key_order(self, length: int, device: Any) -> torch.Tensor:
        """Where each position of a sequence of ``length`` lies in the all-gather (rank 0's tokens, then rank 1's, ...):
        indexing the gathered keys with it puts them back in sequence order."""
        gathered = torch.cat([cp_chunk_positions(length, self.cp, r, device=device) for r in range(self.cp)])
        return torch.argsort(gathered)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``q [b, n, sq, d]`` (this rank's chunks), ``k, v [b, g, sk, d]`` (the whole sequence, in order) ->
        ``[b, n, sq, d]``.

        Without context parallelism: causal attention. With it, each of this rank's two chunks attends to the keys
        up to its own end with a causal mask aligned to the bottom right (torch's ``causal_lower_right``, which
        the GPU kernels apply without building a mask), so no masked-out block is computed.
        """
        dropout = self.dropout if self.training else 0.0
        gqa = q.shape[1] != k.shape[1]
        rng = contextlib.nullcontext()
        if dropout > 0 and not self.config.sequence_parallel:  # as megatron's attention: the TP-rank RNG stream
            from megatron.core import tensor_parallel

            rng = tensor_parallel.get_cuda_rng_tracker().fork()
        with rng:
            if self.cp == 1:
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale, dropout_p=dropout,
                                                      enable_gqa=gqa)
            from torch.nn.attention.bias import causal_lower_right

            c = q.shape[2] // 2
            outs = []
            for part, chunk in ((q[:, :, :c], self.cp_rank), (q[:, :, c:], 2 * self.cp - 1 - self.cp_rank)):
                end = (chunk + 1) * c
                outs.append(F.scaled_dot_product_attention(
                    part, k[:, :, :end], v[:, :, :end], attn_mask=causal_lower_right(c, end), scale=self.scale,
                    dropout_p=dropout, enable_gqa=gqa))
            return torch.cat(outs, dim=2)

    def _packed(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, params: Any) -> torch.Tensor:
        """Packed ``[t, n, d]``: each sequence of ``cu_seqlens`` (padded lengths) attends to itself alone."""
        cu = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
        lengths = (cu[1:] - cu[:-1]).tolist()
        keys, values = self._gather(key), self._gather(value)  # [cp * t, g, d]: rank 0's t tokens, then rank 1's...
        total = query.shape[0]
        outs = []
        start = 0
        for length in lengths:
            n = length // self.cp
            if n == 0:
                continue
            q = query[start : start + n].permute(1, 0, 2).unsqueeze(0)  # [1, heads, n, d]
            # this sequence's keys on every rank (the same offset in each rank's block of the gather), in order
            idx = torch.cat([torch.arange(r * total + start, r * total + start + n, device=query.device)
                             for r in range(self.cp)])
            idx = idx.index_select(0, self._key_order(length, query.device))
            k = keys.index_select(0, idx).permute(1, 0, 2).unsqueeze(0)
            v = values.index_select(0, idx).permute(1, 0, 2).unsqueeze(0)
            outs.append(self._attend(q, k, v).squeeze(0).permute(1, 0, 2).reshape(n, -1))
            start += n
        return torch.cat(outs, dim=0)
