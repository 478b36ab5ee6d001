"""Masked reductions, loss aggregation, KL estimators and controllers shared by every estimator and loss."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from polyrl.algorithms.torch_functional import (
    entropy_from_logits,
    masked_mean,
    masked_select_zero,
    masked_sum,
    masked_var,
    masked_whiten,
)
from polyrl.protocols import LossScale

__all__ = [
    "KL_ESTIMATORS",
    "LOSS_AGG_MODES",
    "AdaptiveKLController",
    "FixedKLController",
    "agg_loss",
    "apply_kl_penalty",
    "compute_entropy_loss",
    "compute_value_loss",
    "entropy_from_logits",
    "get_kl_controller",
    "kl_penalty",
    "kl_penalty_forward",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
]

LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_ESTIMATORS = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")


def cfg_get(config: Any, key: str, default: Any = None) -> Any:
    """Read ``key`` from an object or a mapping (verl passes both); ``default`` when missing or None."""
    if config is None:
        return default
    value = config.get(key, default) if isinstance(config, Mapping) else getattr(config, key, default)
    return default if value is None else value


def check_same_shape(**tensors: torch.Tensor | None) -> None:
    """Raise ``ValueError`` naming every argument and its shape when the shapes differ (None is skipped)."""
    shapes = {k: tuple(v.shape) for k, v in tensors.items() if v is not None}
    if len(set(shapes.values())) > 1:
        raise ValueError("shape mismatch: " + ", ".join(f"{k}={s}" for k, s in shapes.items())
                         + "; these must all be [batch, response_length]")


def check_finite(name: str, value: torch.Tensor, where: torch.Tensor | None = None) -> None:
    """Raise ``ValueError`` naming ``name`` when it holds NaN or inf (only where ``where`` is set, if given)."""
    bad = ~torch.isfinite(value)
    if where is not None:
        bad = bad & where.bool()
    n_bad = int(bad.sum())
    if n_bad:
        raise ValueError(f"{name} holds {n_bad} NaN/inf values; polyrl never turns them into a silent NaN loss "
                         "(a failing reward function should return the reward manager's fallback score)")


def check_nonempty_mask(name: str, mask: torch.Tensor) -> None:
    """Raise ``ValueError`` when ``mask`` selects no token at all."""
    if not bool((mask != 0).any()):
        raise ValueError(f"{name} is all zero: no response token to compute on (check how {name} was built)")


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


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kl_penalty: str = "kl") -> torch.Tensor:
    """Per-token KL estimate between the policy and the reference (verl's names).

    ``kl``/``k1``: ``logp - ref``; ``abs``: ``|logp - ref|``; ``mse``/``k2``:
    ``0.5 (logp - ref)^2``; ``low_var_kl``/``k3``: ``exp(ref - logp) - (ref - logp) - 1``
    with the log-ratio clamped to [-20, 20] and the result to [-10, 10]. A ``+``
    suffix (``k3+``) is the straight-through estimator: the value of the named
    estimator with the gradient of ``k2`` (an unbiased gradient of KL).
    """
    if not isinstance(kl_penalty, str):
        raise ValueError(f"kl_penalty must be a name such as 'low_var_kl', got {kl_penalty!r}")
    if kl_penalty.endswith("+"):
        value = kl_penalty_forward(logprob, ref_logprob, kl_penalty[:-1])
        grad = kl_penalty_forward(logprob, ref_logprob, "k2")
        return grad - grad.detach() + value.detach()
    return kl_penalty_forward(logprob, ref_logprob, kl_penalty)


_kl_estimate = kl_penalty  # apply_kl_penalty's argument ``kl_penalty`` (verl's name) shadows the function


def kl_penalty_forward(logprob: torch.Tensor, ref_logprob: torch.Tensor, kind: str) -> torch.Tensor:
    """The plain estimators of :func:`kl_penalty` (no ``+`` suffix)."""
    check_same_shape(logprob=logprob, ref_logprob=ref_logprob)
    if kind in ("kl", "k1"):
        return logprob - ref_logprob
    if kind == "abs":
        return (logprob - ref_logprob).abs()
    if kind in ("mse", "k2"):
        return 0.5 * (logprob - ref_logprob).square()
    if kind in ("low_var_kl", "k3"):
        log_ratio = (ref_logprob - logprob).clamp(-20, 20)
        return (log_ratio.exp() - log_ratio - 1).clamp(-10, 10)
    hint = " ('full' needs the whole vocabulary distribution, which no engine returns)" if kind == "full" else ""
    raise ValueError(f"kl_penalty={kind!r} is unknown{hint}; choose from {', '.join(KL_ESTIMATORS)}, "
                     "optionally with a '+' suffix (straight-through k2 gradient)")


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


class FixedKLController:
    """A constant KL coefficient ``value``."""

    def __init__(self, kl_coef: float) -> None:
        self.value = kl_coef

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op (the coefficient is fixed)."""


class AdaptiveKLController:
    """Ziegler et al. (2019): move ``value`` towards a target KL over ``horizon`` samples."""

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int) -> None:
        if horizon <= 0:
            raise ValueError(f"kl_ctrl.horizon must be > 0, got {horizon}")
        if target_kl <= 0:
            raise ValueError(f"kl_ctrl.target_kl must be > 0, got {target_kl}")
        self.value, self.target, self.horizon = init_kl_coef, target_kl, horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        """``value *= 1 + clip(current_kl / target - 1, -0.2, 0.2) * n_steps / horizon``."""
        error = max(-0.2, min(0.2, current_kl / self.target - 1))
        self.value *= 1 + error * n_steps / self.horizon


def get_kl_controller(config: Any) -> FixedKLController | AdaptiveKLController:
    """A controller from ``algorithm.kl_ctrl`` (``type``: fixed | adaptive; ``kl_coef``, ``target_kl``, ``horizon``)."""
    kind = cfg_get(config, "type", "fixed")
    coef = cfg_get(config, "kl_coef", 0.001)
    if kind == "fixed":
        return FixedKLController(coef)
    if kind == "adaptive":
        return AdaptiveKLController(coef, cfg_get(config, "target_kl", 0.1), cfg_get(config, "horizon", 10000))
    raise ValueError(f"algorithm.kl_ctrl.type={kind!r} is unknown; choose 'fixed' or 'adaptive'")


def apply_kl_penalty(token_level_scores: torch.Tensor, old_log_prob: torch.Tensor, ref_log_prob: torch.Tensor,
                     response_mask: torch.Tensor, kl_ctrl: Any, kl_penalty: str = "kl",
                     ) -> tuple[torch.Tensor, dict[str, float]]:
    """KL in the reward: ``token_level_rewards = scores - kl_ctrl.value * KL`` on response tokens.

    Returns the rewards and metrics ``actor/reward_kl_penalty`` (the batch mean of
    each sequence's token-mean KL) and ``actor/reward_kl_penalty_coeff``. Unlike
    verl's, this does not call ``kl_ctrl.update``: the trainer does, once per step.
    """
    check_same_shape(token_level_scores=token_level_scores, old_log_prob=old_log_prob, ref_log_prob=ref_log_prob,
                     response_mask=response_mask)
    check_finite("token_level_scores", token_level_scores, response_mask)
    mask = response_mask.to(old_log_prob.dtype)
    kld = masked_select_zero(_kl_estimate(old_log_prob, ref_log_prob, kl_penalty), mask)
    beta = kl_ctrl.value
    rewards = masked_select_zero(token_level_scores, torch.isfinite(token_level_scores)) - beta * kld
    current = float(masked_mean(kld, mask, -1).mean())
    return rewards, {"actor/reward_kl_penalty": current, "actor/reward_kl_penalty_coeff": float(beta)}
