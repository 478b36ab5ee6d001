"""Log-probabilities and entropy from vocabulary-parallel logits.

With tensor parallelism each rank of the tensor-parallel group holds the logits of one slice of the
vocabulary (``[N, V / tp]``, rank ``r`` owns ids ``r * V / tp .. (r + 1) * V / tp - 1``). The
functions here compute, per token, ``log softmax(logits / T)[target]`` and the entropy of
``softmax(logits / T)`` over the *whole* vocabulary with three small all-reduces of ``[N]`` tensors
(max, sum of exponentials, and the target logit / expected logit) instead of gathering ``[N, V]`` on
one rank.

Every rank of the group computes the same loss from these reduced values, so the gradient of a
reduced sum with respect to a rank's own slice is the gradient of the sum: the all-reduce's backward
is the identity (megatron's ``reduce_from_tensor_model_parallel_region`` does the same).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["sum_over_group", "vocab_parallel_log_probs"]


class _AllReduceSum(torch.autograd.Function):
    """Sum over ``group`` in forward; identity in backward (the loss downstream is replicated)."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: Any) -> torch.Tensor:
        out = tensor.clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def sum_over_group(tensor: torch.Tensor, group: Any) -> torch.Tensor:
    """The sum of ``tensor`` over ``group``, with an identity backward: for a value every rank of the group goes on
    to use identically (each rank's gradient then flows only into its own contribution)."""
    return _AllReduceSum.apply(tensor, group)


def _sum(tensor: torch.Tensor, group: Any, size: int) -> torch.Tensor:
    return _AllReduceSum.apply(tensor, group) if size > 1 else tensor


def vocab_parallel_log_probs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    vocab_start: int,
    group: Any = None,
    temperature: float = 1.0,
    compute_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probability of ``targets`` and (optionally) the entropy, from this rank's vocabulary slice.

    Args:
        logits: ``[N, V_local]`` logits of this rank's slice (any float dtype; computed in fp32).
        targets: ``[N]`` token ids in the full vocabulary.
        vocab_start: the first vocabulary id of this rank's slice.
        group: the tensor-parallel process group (``None`` or a group of size 1: no communication).
        temperature: logits are divided by it first (sampling temperature of the rollout).
        compute_entropy: also return the entropy of the full distribution, ``[N]``.

    Returns:
        ``(log_probs [N], entropy [N] or None)``, identical on every rank of ``group``, differentiable
        with respect to ``logits``.
    """
    size = dist.get_world_size(group) if group is not None and dist.is_initialized() else 1
    z = logits.float()
    if temperature != 1.0:
        z = z / temperature
    # the max only stabilises the exponentials: no gradient needs to flow through it
    shift = z.detach().max(dim=-1).values
    if size > 1:
        dist.all_reduce(shift, op=dist.ReduceOp.MAX, group=group)
    z = z - shift.unsqueeze(-1)
    exp = z.exp()
    log_norm = _sum(exp.sum(dim=-1), group, size).log()
    local = targets - vocab_start
    owned = (local >= 0) & (local < z.shape[-1])
    picked = z.gather(-1, local.clamp(0, z.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
    target_logit = _sum(torch.where(owned, picked, torch.zeros_like(picked)), group, size)
    log_probs = target_logit - log_norm
    if not compute_entropy:
        return log_probs, None
    # H = log Z - E_p[z], with p = exp(z) / Z
    expected = _sum((exp * z).sum(dim=-1), group, size) / log_norm.exp()
    return log_probs, log_norm - expected
