"""Loss terms beside the policy loss: PPO's clipped value loss (the critic) and the entropy bonus."""

from __future__ import annotations

import torch

from polyrl.algorithms.aggregation import agg_loss, resolve_loss_scale
from polyrl.algorithms.checks import check_finite, check_nonempty_mask, check_same_shape
from polyrl.algorithms.torch_functional import entropy_from_logits, masked_mean, masked_select_zero
from polyrl.protocols import LossScale

__all__ = ["compute_entropy_loss", "compute_value_loss"]


def compute_value_loss(vpreds: torch.Tensor, returns: torch.Tensor, values: torch.Tensor, response_mask: torch.Tensor,
                       cliprange_value: float, loss_agg_mode: str = "token-mean", dp_size: int | None = None,
                       batch_num_tokens: int | None = None, global_batch_size: int | None = None,
                       loss_scale_factor: float | None = None, *, loss_scale: LossScale | None = None,
                       ) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO's clipped value loss ``0.5 * max((v - R)^2, (clip(v, v_old +- c) - R)^2)``, aggregated.

    Takes verl's arguments (``dp_size``, ``batch_num_tokens``, ``global_batch_size``,
    ``loss_scale_factor``, forwarded to :func:`agg_loss`) or polyrl's ``loss_scale``.
    Returns the loss and metrics ``critic/vf_clipfrac`` (fraction of tokens where
    the clipped term is larger) and ``critic/vpred_mean`` (verl returns the clip
    fraction alone as its second value).
    """
    check_same_shape(vpreds=vpreds, returns=returns, values=values, response_mask=response_mask)
    scale = resolve_loss_scale(loss_scale, dp_size, batch_num_tokens, global_batch_size)
    if scale is None:
        check_nonempty_mask("response_mask", response_mask)
    check_finite("returns", returns, response_mask)
    valid = response_mask != 0
    vpreds = masked_select_zero(vpreds, valid)  # padding keeps no NaN that could reach the gradient
    returns, values = masked_select_zero(returns, valid), masked_select_zero(values, valid)
    clipped = values + (vpreds - values).clamp(-cliprange_value, cliprange_value)
    loss1, loss2 = (vpreds - returns).square(), (clipped - returns).square()
    loss = 0.5 * agg_loss(torch.maximum(loss1, loss2), response_mask, loss_agg_mode,
                          loss_scale_factor=loss_scale_factor, loss_scale=scale)
    clipfrac = masked_mean((loss2 > loss1).float(), response_mask)
    return loss, {"critic/vf_clipfrac": float(clipfrac),
                  "critic/vpred_mean": float(masked_mean(vpreds.detach(), response_mask))}


def compute_entropy_loss(logits: torch.Tensor, response_mask: torch.Tensor,
                         loss_agg_mode: str = "token-mean") -> torch.Tensor:
    """The entropy of ``logits`` (``[B, R, V]``), aggregated over the response tokens (verl's helper)."""
    return agg_loss(entropy_from_logits(logits), response_mask, loss_agg_mode)
