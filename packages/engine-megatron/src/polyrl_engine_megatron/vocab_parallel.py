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

__all__ = ["sum_over_group", "vocab_parallel_log_probs", "vocab_parallel_products"]


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


def vocab_parallel_products(
    logits: torch.Tensor,
    *,
    vocab_start: int,
    group: Any = None,
    temperature: float = 1.0,
    sum_pi_squared: bool = False,
    top_k: int = 0,
    gather_ids: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """The forward products (:class:`polyrl.protocols.ForwardProducts`) from this rank's vocabulary slice.

    Args:
        logits: ``[N, V_local]`` logits of this rank's slice.
        vocab_start: the first vocabulary id of this rank's slice.
        group: the tensor-parallel process group (``None`` or size 1: no communication).
        temperature: logits are divided by it first.
        sum_pi_squared: return ``sum_pi_squared [N]``: ``sum_v p_v^2 = sum_v exp(2 z_v) / (sum_v exp(z_v))^2``
            with two all-reduced sums (differentiable, like :func:`vocab_parallel_log_probs`).
        top_k: return ``top_k_log_probs [N, k]`` and ``top_k_ids [N, k]`` over the whole vocabulary: each rank's
            own top ``k`` are gathered over the group and the best ``k`` of those kept. With more than one
            tensor-parallel rank the values carry no gradient (an all-gather; a teacher's top-k needs none).
        gather_ids: ``[N, k]`` token ids in the full vocabulary: return their log-probs ``gathered_log_probs``
            (each id's logit from the rank that owns it, summed over the group; differentiable).

    Returns:
        The asked-for tensors by name, identical on every rank of ``group``.
    """
    size = dist.get_world_size(group) if group is not None and dist.is_initialized() else 1
    z = logits.float()
    if temperature != 1.0:
        z = z / temperature
    shift = z.detach().max(dim=-1).values
    if size > 1:
        dist.all_reduce(shift, op=dist.ReduceOp.MAX, group=group)
    z = z - shift.unsqueeze(-1)
    norm = _sum(z.exp().sum(dim=-1), group, size)
    log_norm = norm.log()
    out: dict[str, torch.Tensor] = {}
    if sum_pi_squared:
        out["sum_pi_squared"] = _sum((2.0 * z).exp().sum(dim=-1), group, size) / norm.pow(2)
    if top_k > 0:
        local_k = min(top_k, z.shape[-1])
        values, ids = torch.topk(z, local_k, dim=-1)
        ids = ids + vocab_start
        if size > 1:
            gathered_v = [torch.empty_like(values) for _ in range(size)]
            gathered_i = [torch.empty_like(ids) for _ in range(size)]
            dist.all_gather(gathered_v, values.detach().contiguous(), group=group)
            dist.all_gather(gathered_i, ids.contiguous(), group=group)
            values, ids = torch.cat(gathered_v, dim=-1), torch.cat(gathered_i, dim=-1)
            if values.shape[-1] < top_k:
                raise ValueError(f"forward products: top_k={top_k} is larger than the vocabulary ({values.shape[-1]})")
            values, pick = torch.topk(values, top_k, dim=-1)
            ids = ids.gather(-1, pick)
            log_norm_k = log_norm.detach()
        else:
            if local_k < top_k:
                raise ValueError(f"forward products: top_k={top_k} is larger than the vocabulary ({z.shape[-1]})")
            log_norm_k = log_norm
        out["top_k_log_probs"] = values - log_norm_k.unsqueeze(-1)
        out["top_k_ids"] = ids
    if gather_ids is not None:
        local = gather_ids.long() - vocab_start
        owned = (local >= 0) & (local < z.shape[-1])
        picked = z.gather(-1, local.clamp(0, z.shape[-1] - 1))
        logit = _sum(torch.where(owned, picked, torch.zeros_like(picked)), group, size)
        out["gathered_log_probs"] = logit - log_norm.unsqueeze(-1)
    return out
