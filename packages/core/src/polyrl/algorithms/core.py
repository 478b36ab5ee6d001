"""Masked reductions, loss aggregation and KL estimators shared by every estimator and loss."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from polyrl.protocols import LossScale

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def cfg_get(config: Any, key: str, default: Any = None) -> Any:
    """Read ``key`` from an object or a mapping (verl passes both), with a default."""
    if config is None:
        return default
    if isinstance(config, Mapping):
        value = config.get(key, default)
    else:
        value = getattr(config, key, default)
    return default if value is None else value


def check_same_shape(**tensors: torch.Tensor) -> None:
    """Raise ``ValueError`` naming the arguments whose shapes differ."""
    shapes = {k: tuple(v.shape) for k, v in tensors.items() if v is not None}
    if len(set(shapes.values())) > 1:
        raise ValueError(f"shape mismatch: {', '.join(f'{k}={s}' for k, s in shapes.items())}")


def check_finite(name: str, value: torch.Tensor) -> None:
    """Raise ``ValueError`` when ``value`` holds NaN or inf (never a silent NaN loss)."""
    if not torch.isfinite(value).all():
        bad = int((~torch.isfinite(value)).sum())
        raise ValueError(f"{name} holds {bad} NaN/inf values; fix the reward function or its fallback score")


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``values`` where ``mask`` is set."""
    return (values * mask).sum() if dim is None else (values * mask).sum(dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``values`` where ``mask`` is set (0 for an empty mask, not NaN)."""
    total = mask.sum() if dim is None else mask.sum(dim)
    return masked_sum(values, mask, dim) / total.clamp(min=1)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance over the masked entries (Bessel-corrected like verl)."""
    mean = masked_mean(values, mask)
    var = masked_mean((values - mean) ** 2, mask)
    count = mask.sum()
    if unbiased and count > 1:
        var = var * count / (count - 1)
    return var


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """Normalise to zero mean / unit variance over the masked entries."""
    mean, var = masked_mean(values, mask), masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    return whitened if shift_mean else whitened + mean


def agg_loss(loss_mat: torch.Tensor, loss_mask: torch.Tensor, loss_agg_mode: str = "token-mean", *,
             loss_scale: LossScale | None = None) -> torch.Tensor:
    """Aggregate a ``[B, T]`` loss matrix to a scalar (verl's ``agg_loss``).

    With ``loss_scale`` the normalisers are the mini-batch's global counts, so the
    sum of micro-batch losses equals the mini-batch loss, and the ``dp_size``
    factor undoes the gradient averaging over data-parallel ranks.
    """
    check_same_shape(loss_mat=loss_mat, loss_mask=loss_mask)
    mask = loss_mask.to(loss_mat.dtype)
    dp = loss_scale.dp_size if loss_scale is not None else 1
    if loss_agg_mode == "token-mean":
        tokens = loss_scale.batch_num_tokens if loss_scale and loss_scale.batch_num_tokens else None
        denom = torch.as_tensor(tokens, dtype=loss_mat.dtype) if tokens else mask.sum().clamp(min=1)
        return (loss_mat * mask).sum() / denom * dp
    seqs = loss_scale.global_batch_size if loss_scale and loss_scale.global_batch_size else None
    if loss_agg_mode == "seq-mean-token-sum":
        per_seq = (loss_mat * mask).sum(-1)
    elif loss_agg_mode == "seq-mean-token-mean":
        per_seq = (loss_mat * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    elif loss_agg_mode == "seq-mean-token-sum-norm":
        # Dr.GRPO: a constant normaliser (the response length budget), not the sample's own length.
        per_seq = (loss_mat * mask).sum(-1) / loss_mat.shape[-1]
    else:
        raise ValueError(f"loss_agg_mode={loss_agg_mode!r} is unknown; choose from {', '.join(LOSS_AGG_MODES)}")
    if seqs:
        return per_seq.sum() / seqs * dp
    # Only sequences with at least one trained token count (an all-masked row is padding).
    valid = (mask.sum(-1) > 0).to(loss_mat.dtype)
    return (per_seq * valid).sum() / valid.sum().clamp(min=1)


KL_ESTIMATORS = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "full")


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kl_penalty: str = "kl") -> torch.Tensor:
    """Per-token KL estimate between the policy and the reference (verl's names).

    ``kl``/``k1``: ``logp - ref``; ``abs``; ``mse``/``k2``: ``0.5 (logp - ref)^2``;
    ``low_var_kl``/``k3``: ``exp(ref - logp) - (ref - logp) - 1`` clamped to [-10, 10].
    A ``+`` suffix (``k3+``) uses the straight-through trick: the value of the
    estimator with the gradient of ``k2`` (unbiased gradient, low-variance value).
    """
    if kl_penalty.endswith("+"):
        value = kl_penalty_forward(logprob, ref_logprob, kl_penalty[:-1])
        grad = kl_penalty_forward(logprob, ref_logprob, "k2")
        return grad - grad.detach() + value.detach()
    return kl_penalty_forward(logprob, ref_logprob, kl_penalty)


def kl_penalty_forward(logprob: torch.Tensor, ref_logprob: torch.Tensor, kind: str) -> torch.Tensor:
    """The plain estimators of :func:`kl_penalty`."""
    check_same_shape(logprob=logprob, ref_logprob=ref_logprob)
    if kind in ("kl", "k1"):
        return logprob - ref_logprob
    if kind == "abs":
        return (logprob - ref_logprob).abs()
    if kind in ("mse", "k2"):
        return 0.5 * (logprob - ref_logprob).square()
    if kind in ("low_var_kl", "k3"):
        kl = (ref_logprob - logprob).clamp(-20, 20)
        return (kl.exp() - kl - 1).clamp(-10, 10)
    raise ValueError(f"kl_penalty={kind!r} is unknown; choose from {', '.join(KL_ESTIMATORS[:-1])} (or add '+')")


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the categorical distribution over the last dimension."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def compute_value_loss(vpreds: torch.Tensor, returns: torch.Tensor, values: torch.Tensor, response_mask: torch.Tensor,
                       cliprange_value: float, loss_agg_mode: str = "token-mean", *,
                       loss_scale: LossScale | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped value loss: ``0.5 * max((v - R)^2, (clip(v, old +- c) - R)^2)``."""
    check_same_shape(vpreds=vpreds, returns=returns, values=values, response_mask=response_mask)
    clipped = values + (vpreds - values).clamp(-cliprange_value, cliprange_value)
    loss1, loss2 = (vpreds - returns).square(), (clipped - returns).square()
    loss = 0.5 * agg_loss(torch.maximum(loss1, loss2), response_mask, loss_agg_mode, loss_scale=loss_scale)
    clipfrac = masked_mean((loss2 > loss1).float(), response_mask)
    return loss, {"critic/vf_clipfrac": float(clipfrac),
                  "critic/vpred_mean": float(masked_mean(vpreds.detach(), response_mask))}


class FixedKLController:
    """A constant KL coefficient."""

    def __init__(self, kl_coef: float) -> None:
        self.value = kl_coef

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op."""


class AdaptiveKLController:
    """Ziegler et al. (2019): move the coefficient towards a target KL over ``horizon`` samples."""

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int) -> None:
        self.value, self.target, self.horizon = init_kl_coef, target_kl, horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        """Proportional update, error clipped to +-20%."""
        error = max(-0.2, min(0.2, current_kl / self.target - 1))
        self.value *= 1 + error * n_steps / self.horizon


def get_kl_controller(config: Any) -> FixedKLController | AdaptiveKLController:
    """A controller from ``algorithm.kl_ctrl`` (``type``: fixed | adaptive)."""
    kind = cfg_get(config, "type", "fixed")
    coef = cfg_get(config, "kl_coef", 0.001)
    if kind == "fixed":
        return FixedKLController(coef)
    if kind == "adaptive":
        return AdaptiveKLController(coef, cfg_get(config, "target_kl", 0.1), cfg_get(config, "horizon", 10000))
    raise ValueError(f"algorithm.kl_ctrl.type={kind!r}: choose 'fixed' or 'adaptive'")


def apply_kl_penalty(token_level_scores: torch.Tensor, old_log_prob: torch.Tensor, ref_log_prob: torch.Tensor,
                     response_mask: torch.Tensor, kl_ctrl: Any, kl_penalty_type: str = "kl",
                     ) -> tuple[torch.Tensor, dict[str, float]]:
    """KL in the reward: ``rewards = scores - beta * KL`` per token; returns rewards and metrics."""
    kld = kl_penalty(old_log_prob, ref_log_prob, kl_penalty_type) * response_mask
    rewards = token_level_scores - kl_ctrl.value * kld
    current = float(masked_mean(kld.sum(-1) / response_mask.sum(-1).clamp(min=1), (response_mask.sum(-1) > 0).float()))
    return rewards, {"actor/reward_kl_penalty": current, "actor/reward_kl_penalty_coeff": float(kl_ctrl.value)}
