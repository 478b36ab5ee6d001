"""Policy losses with verl's names and signature.

``fn(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
config=None, rollout_log_probs=None, *, loss_scale=None, rollout_is_weights=None,
dp_size=None, batch_num_tokens=None, global_batch_size=None) -> (loss, metrics)``.
The global counts come as ``loss_scale``, as verl's three keywords, or as verl's
``config.global_batch_info``. Inputs are *selected* on response tokens before any
arithmetic, so whatever padding holds (NaN included) reaches neither loss nor gradient.

``config`` carries verl's actor fields as an object or a mapping: ``clip_ratio``,
``clip_ratio_low``, ``clip_ratio_high``, ``clip_ratio_c``, ``loss_scale_factor``,
``tau_pos``/``tau_neg`` (SAPO), ``tis_imp_ratio_cap`` and the ``policy_loss`` block
(``clip_cov_ratio``, ``clip_cov_lb``, ``clip_cov_ub``, ``kl_cov_ratio``,
``ppo_kl_coef``, ``tis_imp_ratio_cap``, ``dro_beta``, ``rollout_correction`` and ``extra``). Every loss multiplies its
per-token losses by the truncated importance weights when they are on (see
:func:`truncated_is_weights`). Formulas and papers: docs/algorithms.md.
"""

from __future__ import annotations

from typing import Any

import torch

from polyrl.algorithms.aggregation import agg_loss, resolve_loss_scale
from polyrl.algorithms.checks import cfg_get, check_finite, check_nonempty_mask, check_same_shape
from polyrl.algorithms.torch_functional import masked_mean, masked_select_zero
from polyrl.protocols import LossScale

LOG_RATIO_CLAMP = 20.0  # exp(20) ~ 5e8: a larger ratio means a broken batch, not a learning signal


def policy_option(config: Any, key: str, default: Any) -> Any:
    """A loss option: ``config.<key>`` (verl's actor level), else ``config.policy_loss.<key>``, else ``...extra``."""
    value = cfg_get(config, key, None)
    if value is None:
        block = cfg_get(config, "policy_loss", None)
        value = cfg_get(block, key, None)
        if value is None:
            value = cfg_get(cfg_get(block, "extra", None), key, None)
    return default if value is None else value


def clip_range(config: Any) -> tuple[float, float]:
    """``(clip_ratio_low, clip_ratio_high)``, each defaulting to ``clip_ratio`` (0.2)."""
    clip = cfg_get(config, "clip_ratio", 0.2)
    return float(cfg_get(config, "clip_ratio_low", clip)), float(cfg_get(config, "clip_ratio_high", clip))


def truncated_is_weights(old_log_prob: torch.Tensor, rollout_log_probs: torch.Tensor | None, config: Any,
                         rollout_is_weights: torch.Tensor | None = None) -> torch.Tensor | None:
    """Per-token weights for the rollout/trainer mismatch, or None when off.

    ``rollout_is_weights`` (verl >= 0.6: precomputed by the trainer) wins; otherwise,
    with ``tis_imp_ratio_cap > 0`` and ``rollout_log_probs``, the weights are
    ``min(exp(old_log_prob - rollout_log_probs), cap)`` (Yao et al. 2025, verl 0.5).
    Always detached: they reweight the gradient, they do not receive one.
    """
    if rollout_is_weights is not None:
        check_same_shape(old_log_prob=old_log_prob, rollout_is_weights=rollout_is_weights)
        return rollout_is_weights.detach()
    cap = float(policy_option(config, "tis_imp_ratio_cap", 0.0))
    if rollout_log_probs is None or cap <= 0:
        return None
    check_same_shape(old_log_prob=old_log_prob, rollout_log_probs=rollout_log_probs)
    log_w = (old_log_prob - rollout_log_probs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return log_w.exp().clamp(max=cap).detach()


def _inputs(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
            response_mask: torch.Tensor, config: Any, loss_scale: LossScale | None,
            rollout_log_probs: torch.Tensor | None, rollout_is_weights: torch.Tensor | None,
            dp_size: int | None, batch_num_tokens: int | None, global_batch_size: int | None,
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None,
                       LossScale | None]:
    """Check the inputs and return them with padding set to 0, and the loss scale to aggregate with.

    Selecting (``torch.where``) instead of multiplying by the mask keeps a NaN/inf in
    padding out of the loss *and* out of the gradient. The scale comes from
    ``loss_scale``, verl's ``dp_size``/``batch_num_tokens``/``global_batch_size``
    keywords, or verl's ``config.global_batch_info``.
    """
    check_same_shape(old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages,
                     response_mask=response_mask, rollout_log_probs=rollout_log_probs,
                     rollout_is_weights=rollout_is_weights)
    if log_prob.dim() != 2:
        raise ValueError(f"log_prob must be [batch, response_length], got {tuple(log_prob.shape)}")
    info = cfg_get(config, "global_batch_info", None)
    if loss_scale is None and dp_size is None and batch_num_tokens is None and global_batch_size is None and info:
        dp_size, batch_num_tokens = cfg_get(info, "dp_size", None), cfg_get(info, "batch_num_tokens", None)
        global_batch_size = cfg_get(info, "global_batch_size", None)
    scale = resolve_loss_scale(loss_scale, dp_size, batch_num_tokens, global_batch_size)
    # A micro-batch of padding rows (all masked) is fine inside a mini-batch normalised by
    # global counts; on its own it has nothing to train on.
    if scale is None:
        check_nonempty_mask("response_mask", response_mask)
    check_finite("advantages", advantages, response_mask)
    check_finite("old_log_prob", old_log_prob, response_mask)
    valid = response_mask != 0

    def select(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else masked_select_zero(t, valid)

    return (masked_select_zero(old_log_prob, valid), masked_select_zero(log_prob, valid),
            masked_select_zero(advantages, valid), select(rollout_log_probs), select(rollout_is_weights), scale)


def _log_ratio(old_log_prob: torch.Tensor, log_prob: torch.Tensor) -> torch.Tensor:
    return (log_prob - old_log_prob).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def _aggregate(losses: torch.Tensor, response_mask: torch.Tensor, loss_agg_mode: str, config: Any,
               loss_scale: LossScale | None, tis: torch.Tensor | None) -> torch.Tensor:
    if tis is not None:
        losses = losses * tis
    factor = cfg_get(config, "loss_scale_factor", None)
    if factor is None:
        factor = cfg_get(cfg_get(config, "global_batch_info", None), "loss_scale_factor", None)
    return agg_loss(losses, response_mask, loss_agg_mode, loss_scale_factor=factor, loss_scale=loss_scale)


def _ratio_metrics(neg_kl: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    neg_kl = neg_kl.detach()
    ratio = neg_kl.exp()
    valid = mask.bool()
    any_valid = bool(valid.any())
    return {
        "ppo_kl": float(masked_mean(-neg_kl, mask)),
        "ratio_mean": float(masked_mean(ratio, mask)) if any_valid else 1.0,
        "ratio_max": float(ratio[valid].max()) if any_valid else 1.0,
        "ratio_min": float(ratio[valid].min()) if any_valid else 1.0,
    }


def _ppo_clip(advantages: torch.Tensor, ratio: torch.Tensor, low: float, high: float,
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    loss1 = -advantages * ratio
    loss2 = -advantages * ratio.clamp(1 - low, 1 + high)
    return loss1, loss2, torch.maximum(loss1, loss2)


def compute_policy_loss_vanilla(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                                response_mask: torch.Tensor, loss_agg_mode: str = "token-mean", config: Any = None,
                                rollout_log_probs: torch.Tensor | None = None, *, loss_scale: LossScale | None = None,
                                rollout_is_weights: torch.Tensor | None = None,
                                dp_size: int | None = None, batch_num_tokens: int | None = None,
                                global_batch_size: int | None = None,
                                ) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO clip ``max(-A r, -A clip(r, 1-low, 1+high))`` with dual-clip ``min(., -A clip_ratio_c)`` for ``A < 0``."""
    old_log_prob, log_prob, advantages, rollout_log_probs, rollout_is_weights, loss_scale = _inputs(
        old_log_prob, log_prob, advantages, response_mask, config, loss_scale, rollout_log_probs, rollout_is_weights,
        dp_size, batch_num_tokens, global_batch_size)
    low, high = clip_range(config)
    clip_c = float(cfg_get(config, "clip_ratio_c", 3.0))
    if clip_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1 for dual-clip PPO, got {clip_c}")
    neg_kl = _log_ratio(old_log_prob, log_prob)
    loss1, loss2, clipped = _ppo_clip(advantages, neg_kl.exp(), low, high)
    loss3 = -advantages * clip_c
    losses = torch.where(advantages < 0, torch.minimum(loss3, clipped), clipped)
    tis = truncated_is_weights(old_log_prob, rollout_log_probs, config, rollout_is_weights)
    loss = _aggregate(losses, response_mask, loss_agg_mode, config, loss_scale, tis)
    metrics = _ratio_metrics(neg_kl, response_mask)
    metrics["pg_clipfrac"] = float(masked_mean((loss2 > loss1).float(), response_mask))
    metrics["pg_clipfrac_lower"] = float(masked_mean(((clipped > loss3) & (advantages < 0)).float(), response_mask))
    return loss, metrics


def compute_policy_loss_gspo(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                             response_mask: torch.Tensor, loss_agg_mode: str = "seq-mean-token-mean",
                             config: Any = None, rollout_log_probs: torch.Tensor | None = None, *,
                             loss_scale: LossScale | None = None, rollout_is_weights: torch.Tensor | None = None,
                             dp_size: int | None = None, batch_num_tokens: int | None = None,
                             global_batch_size: int | None = None,
                             ) -> tuple[torch.Tensor, dict[str, float]]:
    """GSPO: the sequence ratio ``s = exp(mean_t log r_t)`` with token gradients, clipped like PPO.

    Always aggregated ``seq-mean-token-mean`` (the paper's objective; verl does the same).
    """
    old_log_prob, log_prob, advantages, rollout_log_probs, rollout_is_weights, loss_scale = _inputs(
        old_log_prob, log_prob, advantages, response_mask, config, loss_scale, rollout_log_probs, rollout_is_weights,
        dp_size, batch_num_tokens, global_batch_size)
    low, high = clip_range(config)
    mask = response_mask.to(log_prob.dtype)
    neg_kl = log_prob - old_log_prob
    seq_log_ratio = (neg_kl * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    # s_{i,t} = sg(s_i) * pi(y_t) / sg(pi(y_t)): value s_i, gradient of the token's log-prob
    log_ratio = log_prob - log_prob.detach() + seq_log_ratio.detach().unsqueeze(-1)
    ratio = log_ratio.clamp(max=10.0).exp()
    loss1, loss2, losses = _ppo_clip(advantages, ratio, low, high)
    tis = truncated_is_weights(old_log_prob, rollout_log_probs, config, rollout_is_weights)
    loss = _aggregate(losses, response_mask, "seq-mean-token-mean", config, loss_scale, tis)
    metrics = _ratio_metrics(neg_kl.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP), response_mask)
    metrics["pg_clipfrac"] = float(masked_mean((loss2 > loss1).float(), response_mask))
    metrics["pg_clipfrac_lower"] = 0.0
    return loss, metrics


def compute_policy_loss_gpg(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                            response_mask: torch.Tensor, loss_agg_mode: str = "token-mean", config: Any = None,
                            rollout_log_probs: torch.Tensor | None = None, *, loss_scale: LossScale | None = None,
                            rollout_is_weights: torch.Tensor | None = None,
                            dp_size: int | None = None, batch_num_tokens: int | None = None,
                            global_batch_size: int | None = None,
                            ) -> tuple[torch.Tensor, dict[str, float]]:
    """GPG: the plain policy gradient ``-A log_prob`` (no ratio, no clipping)."""
    old_log_prob, log_prob, advantages, rollout_log_probs, rollout_is_weights, loss_scale = _inputs(
        old_log_prob, log_prob, advantages, response_mask, config, loss_scale, rollout_log_probs, rollout_is_weights,
        dp_size, batch_num_tokens, global_batch_size)
    tis = truncated_is_weights(old_log_prob, rollout_log_probs, config, rollout_is_weights)
    loss = _aggregate(-advantages * log_prob, response_mask, loss_agg_mode, config, loss_scale, tis)
    metrics = _ratio_metrics(_log_ratio(old_log_prob, log_prob), response_mask)
    metrics["pg_clipfrac"] = 0.0
    return loss, metrics


def _centred_cov(advantages: torch.Tensor, log_prob: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-token ``(A - mean A)(log p - mean log p)`` with means over the masked tokens."""
    logp = log_prob.detach()
    return (advantages - masked_mean(advantages, mask)) * (logp - masked_mean(logp, mask))


def compute_policy_loss_clip_cov(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                                 response_mask: torch.Tensor, loss_agg_mode: str = "token-mean", config: Any = None,
                                 rollout_log_probs: torch.Tensor | None = None, *,
                                 loss_scale: LossScale | None = None, rollout_is_weights: torch.Tensor | None = None,
                                 dp_size: int | None = None, batch_num_tokens: int | None = None,
                                 global_batch_size: int | None = None,
                                 ) -> tuple[torch.Tensor, dict[str, float]]:
    """Clip-Cov: PPO clip, and the gradient of ``max(1, clip_cov_ratio * #tokens)`` random tokens whose
    centred cov(A, log p) lies in ``(clip_cov_lb, clip_cov_ub)`` (and that the ratio clip left alone) is cut."""
    old_log_prob, log_prob, advantages, rollout_log_probs, rollout_is_weights, loss_scale = _inputs(
        old_log_prob, log_prob, advantages, response_mask, config, loss_scale, rollout_log_probs, rollout_is_weights,
        dp_size, batch_num_tokens, global_batch_size)
    low, high = clip_range(config)
    frac = float(policy_option(config, "clip_cov_ratio", 0.0002))
    lb, ub = float(policy_option(config, "clip_cov_lb", 1.0)), float(policy_option(config, "clip_cov_ub", 5.0))
    if frac <= 0:
        raise ValueError(f"policy_loss.clip_cov_ratio must be > 0, got {frac}")
    neg_kl = _log_ratio(old_log_prob, log_prob)
    loss1, loss2, clipped = _ppo_clip(advantages, neg_kl.exp(), low, high)
    valid = response_mask > 0
    cov = _centred_cov(advantages, log_prob, response_mask)
    candidates = ((cov > lb) & (cov < ub) & valid & ~(loss2 > loss1)).nonzero()
    n_cut = min(max(int(frac * int(valid.sum())), 1), len(candidates))
    keep = torch.ones_like(clipped)
    if n_cut:
        pick = candidates[torch.randperm(len(candidates), device=candidates.device)[:n_cut]]
        keep[pick[:, 0], pick[:, 1]] = 0
    tis = truncated_is_weights(old_log_prob, rollout_log_probs, config, rollout_is_weights)
    loss = _aggregate(clipped * keep, response_mask, loss_agg_mode, config, loss_scale, tis)
    metrics = _ratio_metrics(neg_kl, response_mask)
    metrics["pg_clipfrac"] = float(masked_mean((keep == 0).float(), response_mask))
    metrics["pg_clipfrac_ratio"] = float(masked_mean((loss2 > loss1).float(), response_mask))
    return loss, metrics


def compute_policy_loss_kl_cov(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                               response_mask: torch.Tensor, loss_agg_mode: str = "token-mean", config: Any = None,
                               rollout_log_probs: torch.Tensor | None = None, *, loss_scale: LossScale | None = None,
                               rollout_is_weights: torch.Tensor | None = None,
                               dp_size: int | None = None, batch_num_tokens: int | None = None,
                               global_batch_size: int | None = None,
                               ) -> tuple[torch.Tensor, dict[str, float]]:
    """KL-Cov: ``-A r``, plus ``ppo_kl_coef * |log p - log p_old|`` on the ``max(1, kl_cov_ratio * #tokens)``
    tokens with the largest centred cov(A, log p)."""
    old_log_prob, log_prob, advantages, rollout_log_probs, rollout_is_weights, loss_scale = _inputs(
        old_log_prob, log_prob, advantages, response_mask, config, loss_scale, rollout_log_probs, rollout_is_weights,
        dp_size, batch_num_tokens, global_batch_size)
    frac = float(policy_option(config, "kl_cov_ratio", 0.0002))
    coef = float(policy_option(config, "ppo_kl_coef", 0.1))
    if frac <= 0:
        raise ValueError(f"policy_loss.kl_cov_ratio must be > 0, got {frac}")
    neg_kl = _log_ratio(old_log_prob, log_prob)
    losses = -advantages * neg_kl.exp()
    valid = response_mask > 0
    n_valid = int(valid.sum())
    if n_valid:
        cov = _centred_cov(advantages, log_prob, response_mask).masked_fill(~valid, float("-inf"))
        top = torch.topk(cov.flatten(), max(int(frac * n_valid), 1)).indices
        penalised = torch.zeros(losses.numel(), dtype=torch.bool, device=losses.device)
        penalised[top] = True
        losses = losses + coef * neg_kl.abs() * penalised.view_as(losses)
    tis = truncated_is_weights(old_log_prob, rollout_log_probs, config, rollout_is_weights)
    loss = _aggregate(losses, response_mask, loss_agg_mode, config, loss_scale, tis)
    metrics = _ratio_metrics(neg_kl, response_mask)
    metrics["ppo_kl_abs"] = float(masked_mean(neg_kl.detach().abs(), response_mask))
    metrics["pg_clipfrac"] = 0.0
    return loss, metrics


def compute_policy_loss_cispo(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                              response_mask: torch.Tensor, loss_agg_mode: str = "token-mean", config: Any = None,
                              rollout_log_probs: torch.Tensor | None = None, *, loss_scale: LossScale | None = None,
                              rollout_is_weights: torch.Tensor | None = None,
                              dp_size: int | None = None, batch_num_tokens: int | None = None,
                              global_batch_size: int | None = None,
                              ) -> tuple[torch.Tensor, dict[str, float]]:
    """CISPO: clip the importance weight, not the update: ``-sg(clip(r, 1-low, 1+high)) A log p``.

    As in verl both bounds come from ``clip_ratio_low/high``; the paper's "no lower
    bound" is ``clip_ratio_low: 1.0``.
    """
    old_log_prob, log_prob, advantages, rollout_log_probs, rollout_is_weights, loss_scale = _inputs(
        old_log_prob, log_prob, advantages, response_mask, config, loss_scale, rollout_log_probs, rollout_is_weights,
        dp_size, batch_num_tokens, global_batch_size)
    low, high = clip_range(config)
    neg_kl = _log_ratio(old_log_prob, log_prob)
    ratio = neg_kl.exp()
    weight = ratio.clamp(1 - low, 1 + high).detach()
    tis = truncated_is_weights(old_log_prob, rollout_log_probs, config, rollout_is_weights)
    loss = _aggregate(-weight * advantages * log_prob, response_mask, loss_agg_mode, config, loss_scale, tis)
    metrics = _ratio_metrics(neg_kl, response_mask)
    metrics["pg_clipfrac"] = float(masked_mean((ratio.detach() != weight).float(), response_mask))
    metrics["pg_clipfrac_lower"] = 0.0
    return loss, metrics


def compute_policy_loss_sapo(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                             response_mask: torch.Tensor, loss_agg_mode: str = "seq-mean-token-mean",
                             config: Any = None, rollout_log_probs: torch.Tensor | None = None, *,
                             loss_scale: LossScale | None = None, rollout_is_weights: torch.Tensor | None = None,
                             dp_size: int | None = None, batch_num_tokens: int | None = None,
                             global_batch_size: int | None = None,
                             ) -> tuple[torch.Tensor, dict[str, float]]:
    """SAPO: a smooth gate instead of a hard clip, ``-A * 4/tau * sigmoid(tau (r - 1))``.

    ``tau = tau_pos`` (1.0) where ``A > 0``, else ``tau_neg`` (1.05). Always
    aggregated ``seq-mean-token-mean``, as in the paper and verl.
    """
    old_log_prob, log_prob, advantages, rollout_log_probs, rollout_is_weights, loss_scale = _inputs(
        old_log_prob, log_prob, advantages, response_mask, config, loss_scale, rollout_log_probs, rollout_is_weights,
        dp_size, batch_num_tokens, global_batch_size)
    tau_pos = float(policy_option(config, "tau_pos", 1.0))
    tau_neg = float(policy_option(config, "tau_neg", 1.05))
    if tau_pos <= 0 or tau_neg <= 0:
        raise ValueError(f"SAPO temperatures tau_pos={tau_pos}, tau_neg={tau_neg} must be > 0")
    neg_kl = _log_ratio(old_log_prob, log_prob)
    tau = torch.where(advantages > 0, tau_pos, tau_neg).to(log_prob.dtype)
    gate = torch.sigmoid(tau * (neg_kl.exp() - 1)) * 4 / tau
    tis = truncated_is_weights(old_log_prob, rollout_log_probs, config, rollout_is_weights)
    loss = _aggregate(-gate * advantages, response_mask, "seq-mean-token-mean", config, loss_scale, tis)
    metrics = _ratio_metrics(neg_kl, response_mask)
    metrics["pg_clipfrac"] = 0.0
    metrics["pg_clipfrac_lower"] = 0.0
    return loss, metrics


def compute_policy_loss_geo_mean(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                                 response_mask: torch.Tensor, loss_agg_mode: str = "token-mean", config: Any = None,
                                 rollout_log_probs: torch.Tensor | None = None, *,
                                 loss_scale: LossScale | None = None, rollout_is_weights: torch.Tensor | None = None,
                                 dp_size: int | None = None, batch_num_tokens: int | None = None,
                                 global_batch_size: int | None = None,
                                 ) -> tuple[torch.Tensor, dict[str, float]]:
    """GMPO: per sequence ``-mean_t(A) * exp(mean_t clip(log r_t))``, the clip sign-aware (pessimistic) per token.

    A sequence-level loss: ``loss_agg_mode`` is ignored (as in verl); the mean is over
    sequences with at least one token, or ``/ global_batch_size * dp_size`` with ``loss_scale``.
    """
    old_log_prob, log_prob, advantages, rollout_log_probs, rollout_is_weights, loss_scale = _inputs(
        old_log_prob, log_prob, advantages, response_mask, config, loss_scale, rollout_log_probs, rollout_is_weights,
        dp_size, batch_num_tokens, global_batch_size)
    low, high = clip_range(config)
    mask = response_mask.to(log_prob.dtype)
    neg_kl = _log_ratio(old_log_prob, log_prob)
    sign = torch.sign(advantages)
    clamped = neg_kl.clamp(-low, high)
    pessimistic = sign * torch.minimum(sign * neg_kl, sign * clamped)
    lengths = mask.sum(-1).clamp(min=1)
    seq_ratio = torch.exp((pessimistic * mask).sum(-1) / lengths)
    seq_adv = (advantages * mask).sum(-1) / lengths
    per_seq = -seq_adv * seq_ratio
    tis = truncated_is_weights(old_log_prob, rollout_log_probs, config, rollout_is_weights)
    if tis is not None:  # token weights -> one per sequence: their geometric mean (verl)
        per_seq = per_seq * torch.exp((torch.log(tis + 1e-10) * mask).sum(-1) / lengths)
    valid = (mask.sum(-1) > 0).to(per_seq.dtype)
    if loss_scale is not None and loss_scale.global_batch_size is not None:
        loss = (per_seq * valid).sum() / loss_scale.global_batch_size * loss_scale.dp_size
    else:
        loss = (per_seq * valid).sum() / valid.sum().clamp(min=1)
    clipped = (clamped != neg_kl).detach()
    metrics = _ratio_metrics(neg_kl, response_mask)
    metrics["pg_clipfrac"] = float(masked_mean((clipped & (advantages > 0)).float(), response_mask))
    metrics["pg_clipfrac_lower"] = float(masked_mean((clipped & (advantages < 0)).float(), response_mask))
    return loss, metrics


def compute_policy_loss_dro(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                            response_mask: torch.Tensor, loss_agg_mode: str = "token-mean", config: Any = None,
                            rollout_log_probs: torch.Tensor | None = None, *, loss_scale: LossScale | None = None,
                            rollout_is_weights: torch.Tensor | None = None,
                            dp_size: int | None = None, batch_num_tokens: int | None = None,
                            global_batch_size: int | None = None,
                            ) -> tuple[torch.Tensor, dict[str, float]]:
    """DRO (Direct Reward Optimization): ``-(A log p - beta/2 (log p - log p_old)^2)``.

    ``beta`` is ``policy_loss.dro_beta`` (> 0, required): a quadratic penalty on the
    log-ratio instead of a clip.
    """
    old_log_prob, log_prob, advantages, rollout_log_probs, rollout_is_weights, loss_scale = _inputs(
        old_log_prob, log_prob, advantages, response_mask, config, loss_scale, rollout_log_probs, rollout_is_weights,
        dp_size, batch_num_tokens, global_batch_size)
    beta = policy_option(config, "dro_beta", None)
    if beta is None or float(beta) <= 0:
        raise ValueError(f"actor.policy_loss.dro_beta must be > 0 for loss_mode 'dro', got {beta!r}")
    log_ratio = log_prob - old_log_prob
    losses = -(log_prob * advantages - 0.5 * float(beta) * log_ratio.square())
    tis = truncated_is_weights(old_log_prob, rollout_log_probs, config, rollout_is_weights)
    loss = _aggregate(losses, response_mask, loss_agg_mode, config, loss_scale, tis)
    metrics = _ratio_metrics(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP), response_mask)
    return loss, metrics


def _dppo(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor,
          loss_agg_mode: str, config: Any, rollout_log_probs: torch.Tensor | None, loss_scale: LossScale | None,
          rollout_is_weights: torch.Tensor | None, divergence: str) -> tuple[torch.Tensor, dict[str, float]]:
    """DPPO (arXiv 2602.04879): ``-A sg(min(r, clip_ratio_c)) log p`` on the tokens inside a divergence trust region.

    The region bounds the change of the sampled token's probability: total
    variation ``|p - p_old|`` (``dppo_tv``) or the KL between the two Bernoulli
    distributions ``(p, 1-p)`` (``dppo_kl``), by ``clip_ratio_high`` where ``A > 0``
    and ``clip_ratio_low`` otherwise (each defaulting to ``clip_ratio``). Only the
    direction the advantage pushes is limited. ``clip_ratio_c`` (default 20)
    truncates the ratio (TIS) instead of dual-clip.
    """
    low, high = clip_range(config)
    clip_c = float(cfg_get(config, "clip_ratio_c", 20.0))
    neg_kl = _log_ratio(old_log_prob, log_prob)
    ratio = neg_kl.exp()
    truncated = ratio.clamp(max=clip_c).detach()
    prob, old_prob = log_prob.detach().exp(), old_log_prob.exp()
    if divergence == "tv":
        inside_pos = (prob - old_prob) <= high
        inside_neg = (prob - old_prob) >= -low
    else:
        binary_kl = old_prob * (old_log_prob - log_prob.detach()) + (1 - old_prob) * torch.log(
            (1.0 - old_prob + 1e-8) / (1.0 - prob + 1e-8))
        inside_pos = (binary_kl <= high) | (prob <= old_prob)
        inside_neg = (binary_kl <= low) | (prob >= old_prob)
    inside = torch.where(advantages > 0, inside_pos, inside_neg).to(log_prob.dtype)
    losses = -advantages * truncated * log_prob * inside
    tis = truncated_is_weights(old_log_prob, rollout_log_probs, config, rollout_is_weights)
    loss = _aggregate(losses, response_mask, loss_agg_mode, config, loss_scale, tis)
    metrics = _ratio_metrics(neg_kl, response_mask)
    metrics["pg_clipfrac"] = float(masked_mean(1.0 - inside, response_mask))
    metrics["pg_clipfrac_lower"] = float(masked_mean((ratio.detach() > clip_c).float() * inside, response_mask))
    return loss, metrics


def compute_policy_loss_dppo_tv(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                                response_mask: torch.Tensor, loss_agg_mode: str = "token-mean", config: Any = None,
                                rollout_log_probs: torch.Tensor | None = None, *, loss_scale: LossScale | None = None,
                                rollout_is_weights: torch.Tensor | None = None,
                                dp_size: int | None = None, batch_num_tokens: int | None = None,
                                global_batch_size: int | None = None,
                                ) -> tuple[torch.Tensor, dict[str, float]]:
    """DPPO-Binary-TV: trust region ``|p - p_old|`` <= ``clip_ratio_high`` (A > 0) / ``clip_ratio_low`` (A <= 0)."""
    old_log_prob, log_prob, advantages, rollout_log_probs, rollout_is_weights, loss_scale = _inputs(
        old_log_prob, log_prob, advantages, response_mask, config, loss_scale, rollout_log_probs, rollout_is_weights,
        dp_size, batch_num_tokens, global_batch_size)
    return _dppo(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_log_probs,
                 loss_scale, rollout_is_weights, "tv")


def compute_policy_loss_dppo_kl(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                                response_mask: torch.Tensor, loss_agg_mode: str = "token-mean", config: Any = None,
                                rollout_log_probs: torch.Tensor | None = None, *, loss_scale: LossScale | None = None,
                                rollout_is_weights: torch.Tensor | None = None,
                                dp_size: int | None = None, batch_num_tokens: int | None = None,
                                global_batch_size: int | None = None,
                                ) -> tuple[torch.Tensor, dict[str, float]]:
    """DPPO-Binary-KL: trust region on the Bernoulli KL of the sampled token's probability (see ``dppo_tv``)."""
    old_log_prob, log_prob, advantages, rollout_log_probs, rollout_is_weights, loss_scale = _inputs(
        old_log_prob, log_prob, advantages, response_mask, config, loss_scale, rollout_log_probs, rollout_is_weights,
        dp_size, batch_num_tokens, global_batch_size)
    return _dppo(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_log_probs,
                 loss_scale, rollout_is_weights, "kl")


def compute_policy_loss_reinforce(rollout_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                                  response_mask: torch.Tensor, loss_agg_mode: str = "seq-mean-token-sum",
                                  config: Any = None, rollout_is_weights: torch.Tensor | None = None, *,
                                  loss_scale: LossScale | None = None,
                                  ) -> tuple[torch.Tensor, dict[str, float]]:
    """REINFORCE with optional importance weights: ``-w A log p`` (no ratio, no clip); verl's helper of
    ``bypass_mode``. ``ppo_kl`` is measured against the rollout's log-probs."""
    rollout_log_prob, log_prob, advantages, _, rollout_is_weights, loss_scale = _inputs(
        rollout_log_prob, log_prob, advantages, response_mask, config, loss_scale, None, rollout_is_weights,
        None, None, None)
    losses = -advantages * log_prob
    if rollout_is_weights is not None:
        losses = losses * rollout_is_weights.detach()
    loss = _aggregate(losses, response_mask, loss_agg_mode, config, loss_scale, None)
    return loss, _ratio_metrics(_log_ratio(rollout_log_prob, log_prob), response_mask)


def compute_policy_loss_bypass_mode(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                                    response_mask: torch.Tensor, loss_agg_mode: str = "token-mean",
                                    config: Any = None, rollout_log_probs: torch.Tensor | None = None, *,
                                    loss_scale: LossScale | None = None,
                                    rollout_is_weights: torch.Tensor | None = None,
                                    dp_size: int | None = None, batch_num_tokens: int | None = None,
                                    global_batch_size: int | None = None,
                                    ) -> tuple[torch.Tensor, dict[str, float]]:
    """Bypass mode: ``old_log_prob`` *is* the rollout's log-prob (no separate old-log-prob pass).

    Reads ``policy_loss.rollout_correction`` (verl's names): importance weights
    ``pi_current / pi_rollout`` (``rollout_is``, ``rollout_is_threshold``,
    ``rollout_is_batch_normalize``) and rejection sampling (``rollout_rs``,
    ``rollout_rs_threshold``) are computed here, on the current log-probs. With
    ``loss_type: ppo_clip`` (default) the PPO ratio already is that IS ratio, so the
    weights only feed metrics and rejection only shrinks the mask; with
    ``loss_type: reinforce`` the loss is ``-w A log p``. ``rollout_is_weights``
    passed in is ignored (they are computed here, as in verl).
    """
    from polyrl.algorithms.rollout_correction import (
        compute_rollout_correction_and_rejection_mask,
        rollout_correction_settings,
    )

    block = policy_option(config, "rollout_correction", None)
    if block is None:
        raise ValueError("loss_mode 'bypass_mode' needs actor.policy_loss.rollout_correction (verl's "
                         "algorithm.rollout_correction block; the trainer copies it when "
                         "algorithm.rollout_correction.bypass_mode is true)")
    settings = rollout_correction_settings(block) or dict(block)
    scale = resolve_loss_scale(loss_scale, dp_size, batch_num_tokens, global_batch_size)
    valid = response_mask != 0
    check_same_shape(old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages, response_mask=response_mask)
    weights: torch.Tensor | None = None
    mask, corr_metrics = response_mask, dict[str, float]()
    if bool(valid.any()):  # an all-padding micro-batch (inside a mini-batch) has nothing to correct
        weights, mask, corr_metrics = compute_rollout_correction_and_rejection_mask(
            masked_select_zero(log_prob.detach(), valid), masked_select_zero(old_log_prob, valid), response_mask,
            rollout_is=settings.get("rollout_is"), rollout_is_threshold=settings.get("rollout_is_threshold", 2.0),
            rollout_is_batch_normalize=bool(settings.get("rollout_is_batch_normalize", False)),
            rollout_rs=settings.get("rollout_rs"), rollout_rs_threshold=settings.get("rollout_rs_threshold"))
    loss_type = settings.get("loss_type", "ppo_clip")
    if loss_type == "reinforce":
        loss, metrics = compute_policy_loss_reinforce(old_log_prob, log_prob, advantages, mask, loss_agg_mode,
                                                      config, rollout_is_weights=weights, loss_scale=scale)
    elif loss_type == "ppo_clip":
        loss, metrics = compute_policy_loss_vanilla(old_log_prob, log_prob, advantages, mask, loss_agg_mode, config,
                                                    loss_scale=scale)
    else:
        raise ValueError(f"policy_loss.rollout_correction.loss_type={loss_type!r}: choose 'ppo_clip' or 'reinforce'")
    metrics.update(corr_metrics)
    return loss, metrics


#: name -> function; registered by polyrl.algorithms.hooks
BUILTIN_POLICY_LOSSES = {
    "vanilla": compute_policy_loss_vanilla,
    "gspo": compute_policy_loss_gspo,
    "gpg": compute_policy_loss_gpg,
    "clip_cov": compute_policy_loss_clip_cov,
    "kl_cov": compute_policy_loss_kl_cov,
    "cispo": compute_policy_loss_cispo,
    "sapo": compute_policy_loss_sapo,
    "geo_mean": compute_policy_loss_geo_mean,
    "dro": compute_policy_loss_dro,
    "dppo_tv": compute_policy_loss_dppo_tv,
    "dppo_kl": compute_policy_loss_dppo_kl,
    "bypass_mode": compute_policy_loss_bypass_mode,
}
