"""Loss aggregation: verl's ``agg_loss`` (a ``[B, R]`` loss matrix to a scalar) and the global counts
(:class:`~polyrl.protocols.LossScale`) that make micro-batch and data-parallel splits add up."""

from __future__ import annotations

import torch

from polyrl.algorithms.checks import check_same_shape
from polyrl.algorithms.torch_functional import masked_select_zero, masked_sum
from polyrl.protocols import LossScale

__all__ = ["LOSS_AGG_MODES", "agg_loss", "resolve_loss_scale"]

LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def resolve_loss_scale(loss_scale: LossScale | None = None, dp_size: int | None = None,
                       batch_num_tokens: int | float | torch.Tensor | None = None,
                       global_batch_size: int | float | torch.Tensor | None = None) -> LossScale | None:
    """One :class:`LossScale` from polyrl's ``loss_scale`` or verl's ``dp_size``/``batch_num_tokens``/
    ``global_batch_size`` keywords (verl's ``**config.global_batch_info``); both spellings at once must agree."""
    verl_given = dp_size is not None or batch_num_tokens is not None or global_batch_size is not None
    if not verl_given:
        return loss_scale
    verl_scale = LossScale(dp_size=int(dp_size) if dp_size is not None else 1,
                           batch_num_tokens=_as_count(batch_num_tokens),
                           global_batch_size=_as_count(global_batch_size))
    if loss_scale is not None and loss_scale != verl_scale:
        raise ValueError(f"loss_scale={loss_scale} and dp_size/batch_num_tokens/global_batch_size={verl_scale} "
                         "disagree; pass one of the two spellings")
    return verl_scale


def _as_count(value: int | float | torch.Tensor | None) -> int | None:
    if value is None:
        return None
    return int(value.item()) if isinstance(value, torch.Tensor) else int(value)


def agg_loss(loss_mat: torch.Tensor, loss_mask: torch.Tensor, loss_agg_mode: str = "token-mean",
             dp_size: int | None = None, batch_num_tokens: int | None = None, global_batch_size: int | None = None,
             loss_scale_factor: float | None = None, *, loss_scale: LossScale | None = None) -> torch.Tensor:
    """Aggregate a ``[B, R]`` loss matrix to a scalar (verl's ``agg_loss``, same arguments).

    Without global counts the normalisers are local: ``token-mean`` divides by the
    number of masked tokens, ``seq-mean-*`` by the number of sequences that have at
    least one token. With them (verl's ``dp_size``, ``batch_num_tokens``,
    ``global_batch_size`` keywords, or polyrl's ``loss_scale``) they are the
    mini-batch's global counts times ``dp_size``, so the sum of micro-batch losses is
    exactly the mini-batch loss and averaging gradients over data-parallel ranks
    stays exact. ``token-sum`` is the plain masked sum (times ``dp_size``).
    ``seq-mean-token-sum-norm`` divides each sequence's token sum by
    ``loss_scale_factor`` (a constant such as the maximum response length;
    default ``R``, the width of ``loss_mat``). Padding (``loss_mask == 0``) never
    reaches the result, even when ``loss_mat`` holds NaN there.
    """
    check_same_shape(loss_mat=loss_mat, loss_mask=loss_mask)
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"loss_agg_mode={loss_agg_mode!r} is unknown; choose from {', '.join(LOSS_AGG_MODES)}")
    scale = resolve_loss_scale(loss_scale, dp_size, batch_num_tokens, global_batch_size)
    mask = loss_mask.to(loss_mat.dtype)
    dp = scale.dp_size if scale is not None else 1
    if loss_agg_mode == "token-sum":
        return masked_sum(loss_mat, mask) * dp
    if loss_agg_mode == "token-mean":
        tokens = scale.batch_num_tokens if scale is not None else None
        if tokens is None:
            if dp > 1:
                raise ValueError("agg_loss: batch_num_tokens (the global token count) is required when dp_size > 1")
            return masked_sum(loss_mat, mask) / mask.sum().clamp(min=1)
        if tokens <= 0:
            raise ValueError(f"loss_scale.batch_num_tokens={tokens}: the mini-batch has no response token")
        return masked_sum(loss_mat, mask) / tokens * dp
    token_sum = masked_sum(loss_mat, mask, -1)
    if loss_agg_mode == "seq-mean-token-sum":
        per_seq = token_sum
    elif loss_agg_mode == "seq-mean-token-mean":
        per_seq = token_sum / mask.sum(-1).clamp(min=1)
    else:  # seq-mean-token-sum-norm (Dr.GRPO): a constant normaliser, not the sample's own length
        per_seq = token_sum / (loss_scale_factor or loss_mat.shape[-1])
    valid = mask.sum(-1) > 0  # an all-masked row is padding, not a sequence
    seqs = scale.global_batch_size if scale is not None else None
    if seqs is None:
        if dp > 1:
            raise ValueError("agg_loss: global_batch_size is required when dp_size > 1")
        return masked_select_zero(per_seq, valid).sum() / valid.sum().clamp(min=1)
    if seqs <= 0:
        raise ValueError(f"loss_scale.global_batch_size={seqs}: the mini-batch has no sequence")
    return masked_select_zero(per_seq, valid).sum() / seqs * dp
