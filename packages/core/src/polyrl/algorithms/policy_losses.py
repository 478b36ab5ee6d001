"""Policy losses with verl's names and signature.

``fn(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
config=None, rollout_log_probs=None, *, loss_scale=None) -> (loss, metrics)``.
``config`` carries verl's actor fields (``clip_ratio``, ``clip_ratio_low``,
``clip_ratio_high``, ``clip_ratio_c``, ``policy_loss.*``) as an object or mapping.
Formulas and papers: docs/algorithms.md.
"""

from __future__ import annotations

from typing import Any

import torch

from polyrl.algorithms.core import agg_loss, cfg_get, check_same_shape, masked_mean
from polyrl.protocols import LossScale


def _clip_range(config: Any) -> tuple[float, float]:
    clip = cfg_get(config, "clip_ratio", 0.2)
    return cfg_get(config, "clip_ratio_low", clip), cfg_get(config, "clip_ratio_high", clip)


def _policy_cfg(config: Any, key: str, default: Any) -> Any:
    sub = cfg_get(config, "policy_loss", None)
    value = cfg_get(sub, key, None)
    if value is None:
        value = cfg_get(cfg_get(sub, "extra", None), key, default)
    return value


def _prepare(old_log_prob, log_prob, advantages, response_mask):
    check_same_shape(old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages, response_mask=response_mask)
    if response_mask.sum() == 0:
        raise ValueError("response_mask is all zero: no token to train on (check the batch's response_mask)")
    neg_kl = (log_prob - old_log_prob).clamp(-20.0, 20.0)
    return neg_kl, torch.exp(neg_kl)


def _tis_weight(old_log_prob: torch.Tensor, rollout_log_probs: torch.Tensor | None, config: Any) -> torch.Tensor | None:
    """Truncated importance sampling between the rollout's and the trainer's old policy (``tis_imp_ratio_cap``)."""
    cap = _policy_cfg(config, "tis_imp_ratio_cap", 0.0)
    if rollout_log_probs is None or not cap or cap <= 0:
        return None
    check_same_shape(old_log_prob=old_log_prob, rollout_log_probs=rollout_log_probs)
    return torch.exp((old_log_prob - rollout_log_probs).clamp(-20, 20)).clamp(max=cap).detach()


def _ratio_metrics(ratio: torch.Tensor, neg_kl: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    ratio, neg_kl = ratio.detach(), neg_kl.detach()
    valid = ratio[mask.bool()]
    return {
        "ppo_kl": float(masked_mean(-neg_kl, mask)),
        "ratio_mean": float(valid.mean()) if valid.numel() else 1.0,
        "ratio_max": float(valid.max()) if valid.numel() else 1.0,
        "ratio_min": float(valid.min()) if valid.numel() else 1.0,
    }


def compute_policy_loss_vanilla(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
                                config=None, rollout_log_probs=None, *, loss_scale: LossScale | None = None):
    """PPO clip with asymmetric ``clip_ratio_low/high`` and dual-clip ``clip_ratio_c`` for negative advantages."""
    neg_kl, ratio = _prepare(old_log_prob, log_prob, advantages, response_mask)
    low, high = _clip_range(config)
    clip_c = cfg_get(config, "clip_ratio_c", 3.0)
    if clip_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1 for dual-clip, got {clip_c}")
    loss1 = -advantages * ratio
    loss2 = -advantages * ratio.clamp(1 - low, 1 + high)
    clipped = torch.maximum(loss1, loss2)
    loss3 = -advantages * clip_c
    dual = torch.minimum(loss3, clipped)
    losses = torch.where(advantages < 0, dual, clipped)
    tis = _tis_weight(old_log_prob, rollout_log_probs, config)
    if tis is not None:
        losses = losses * tis
    loss = agg_loss(losses, response_mask, loss_agg_mode, loss_scale=loss_scale)
    metrics = _ratio_metrics(ratio, neg_kl, response_mask)
    metrics["pg_clipfrac"] = float(masked_mean((loss2 > loss1).float(), response_mask))
    metrics["pg_clipfrac_lower"] = float(masked_mean(((clipped > loss3) & (advantages < 0)).float(), response_mask))
    return loss, metrics


def compute_policy_loss_gspo(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="seq-mean-token-mean",
                             config=None, rollout_log_probs=None, *, loss_scale: LossScale | None = None):
    """GSPO: a sequence-level ratio (geometric mean of token ratios), token-level gradients, clipped."""
    neg_kl, ratio_tok = _prepare(old_log_prob, log_prob, advantages, response_mask)
    lengths = response_mask.sum(-1).clamp(min=1)
    seq_log_ratio = (neg_kl * response_mask).sum(-1) / lengths
    log_ratio = log_prob - log_prob.detach() + seq_log_ratio.detach().unsqueeze(-1)
    ratio = torch.exp(log_ratio.clamp(max=10.0))
    low, high = _clip_range(config)
    loss1 = -advantages * ratio
    loss2 = -advantages * ratio.clamp(1 - low, 1 + high)
    losses = torch.maximum(loss1, loss2)
    loss = agg_loss(losses, response_mask, "seq-mean-token-mean", loss_scale=loss_scale)
    metrics = _ratio_metrics(ratio, neg_kl, response_mask)
    metrics["pg_clipfrac"] = float(masked_mean((loss2 > loss1).float(), response_mask))
    return loss, metrics


def compute_policy_loss_gpg(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
                            config=None, rollout_log_probs=None, *, loss_scale: LossScale | None = None):
    """GPG: the plain policy gradient ``-log_prob * A`` (no ratio, no clipping)."""
    check_same_shape(log_prob=log_prob, advantages=advantages, response_mask=response_mask)
    loss = agg_loss(-log_prob * advantages, response_mask, loss_agg_mode, loss_scale=loss_scale)
    return loss, {"pg_clipfrac": 0.0, "ppo_kl": float(masked_mean(old_log_prob - log_prob.detach(), response_mask))}


def _centered_cov(advantages, log_prob, mask):
    valid = mask.bool()
    adv_c = advantages - advantages[valid].mean()
    logp_c = log_prob.detach() - log_prob.detach()[valid].mean()
    return adv_c * logp_c


def compute_policy_loss_clip_cov(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
                                 config=None, rollout_log_probs=None, *, loss_scale: LossScale | None = None):
    """Clip-Cov: PPO clip, plus the gradient of a random ``clip_cov_ratio`` of the tokens whose
    advantage/log-prob covariance lies in ``[clip_cov_lb, clip_cov_ub]`` is cut (entropy preservation)."""
    neg_kl, ratio = _prepare(old_log_prob, log_prob, advantages, response_mask)
    low, high = _clip_range(config)
    frac = _policy_cfg(config, "clip_cov_ratio", 0.0002)
    lb, ub = _policy_cfg(config, "clip_cov_lb", 1.0), _policy_cfg(config, "clip_cov_ub", 5.0)
    loss1 = -advantages * ratio
    loss2 = -advantages * ratio.clamp(1 - low, 1 + high)
    clip_by_ratio = loss2 > loss1
    cov = _centered_cov(advantages, log_prob, response_mask)
    candidates = ((cov > lb) & (cov < ub) & response_mask.bool()).nonzero(as_tuple=False)
    n_clip = max(int(frac * int(response_mask.sum())), 1)
    cut = torch.zeros_like(response_mask, dtype=torch.bool)
    if len(candidates):
        pick = candidates[torch.randperm(len(candidates))[: min(n_clip, len(candidates))]]
        cut[pick[:, 0], pick[:, 1]] = True
    keep = (~cut).to(loss1.dtype)
    losses = torch.maximum(loss1, loss2) * keep
    loss = agg_loss(losses, response_mask, loss_agg_mode, loss_scale=loss_scale)
    metrics = _ratio_metrics(ratio, neg_kl, response_mask)
    metrics["pg_clipfrac"] = float(masked_mean((clip_by_ratio | cut).float(), response_mask))
    return loss, metrics


def compute_policy_loss_kl_cov(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
                               config=None, rollout_log_probs=None, *, loss_scale: LossScale | None = None):
    """KL-Cov: plain ``-A * ratio``, plus ``ppo_kl_coef * |log_prob - old|`` on the top
    ``kl_cov_ratio`` tokens by advantage/log-prob covariance."""
    neg_kl, ratio = _prepare(old_log_prob, log_prob, advantages, response_mask)
    frac = _policy_cfg(config, "kl_cov_ratio", 0.0002)
    coef = _policy_cfg(config, "ppo_kl_coef", 0.1)
    losses = -advantages * ratio
    cov = _centered_cov(advantages, log_prob, response_mask).masked_fill(~response_mask.bool(), float("-inf"))
    k = max(int(frac * int(response_mask.sum())), 1)
    top = torch.topk(cov.flatten(), k).indices
    penalty = torch.zeros_like(losses).flatten()
    penalty[top] = coef * (log_prob - old_log_prob).abs().flatten()[top]
    losses = losses + penalty.view_as(losses)
    loss = agg_loss(losses, response_mask, loss_agg_mode, loss_scale=loss_scale)
    metrics = _ratio_metrics(ratio, neg_kl, response_mask)
    metrics["pg_clipfrac"] = 0.0
    return loss, metrics


def compute_policy_loss_cispo(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
                              config=None, rollout_log_probs=None, *, loss_scale: LossScale | None = None):
    """CISPO (MiniMax-M1): clip the importance weight, not the update: ``-sg(clip(r, max=1+eps_high)) * A * log_prob``."""
    neg_kl, ratio = _prepare(old_log_prob, log_prob, advantages, response_mask)
    _, high = _clip_range(config)
    weight = ratio.clamp(max=1 + high).detach()
    losses = -weight * advantages * log_prob
    loss = agg_loss(losses, response_mask, loss_agg_mode, loss_scale=loss_scale)
    metrics = _ratio_metrics(ratio, neg_kl, response_mask)
    metrics["pg_clipfrac"] = float(masked_mean((ratio > 1 + high).float(), response_mask))
    return loss, metrics


def compute_policy_loss_sapo(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
                             config=None, rollout_log_probs=None, *, loss_scale: LossScale | None = None):
    """SAPO: a smooth sigmoid gate instead of a hard clip, ``f(r) = 4/tau * sigmoid(tau (r - 1))``,
    with temperatures ``tau_pos`` / ``tau_neg`` for positive / negative advantages."""
    neg_kl, ratio = _prepare(old_log_prob, log_prob, advantages, response_mask)
    tau_pos = float(_policy_cfg(config, "tau_pos", 1.0))
    tau_neg = float(_policy_cfg(config, "tau_neg", 1.05))
    tau = torch.where(advantages > 0, torch.full_like(ratio, tau_pos), torch.full_like(ratio, tau_neg))
    gate = torch.sigmoid(tau * (ratio - 1)) * 4 / tau
    losses = -gate * advantages
    loss = agg_loss(losses, response_mask, loss_agg_mode, loss_scale=loss_scale)
    metrics = _ratio_metrics(ratio, neg_kl, response_mask)
    metrics["pg_clipfrac"] = 0.0
    return loss, metrics


def compute_policy_loss_geo_mean(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
                                 config=None, rollout_log_probs=None, *, loss_scale: LossScale | None = None):
    """GMPO: the geometric mean of token ratios per sequence, clipped token-wise in log space."""
    neg_kl, ratio_tok = _prepare(old_log_prob, log_prob, advantages, response_mask)
    low, high = _clip_range(config)
    sign = torch.sign(advantages)
    clamped = neg_kl.clamp(-low, high)
    pessimistic = sign * torch.minimum(sign * neg_kl, sign * clamped)
    lengths = response_mask.sum(-1).clamp(min=1)
    seq_ratio = torch.exp((pessimistic * response_mask).sum(-1) / lengths)
    seq_adv = (advantages * response_mask).sum(-1) / lengths
    per_seq = -seq_adv * seq_ratio
    valid = (response_mask.sum(-1) > 0).to(per_seq.dtype)
    if loss_scale is not None and loss_scale.global_batch_size:
        loss = (per_seq * valid).sum() / loss_scale.global_batch_size * loss_scale.dp_size
    else:
        loss = (per_seq * valid).sum() / valid.sum().clamp(min=1)
    metrics = _ratio_metrics(ratio_tok, neg_kl, response_mask)
    metrics["pg_clipfrac"] = float(masked_mean((clamped != neg_kl).float(), response_mask))
    return loss, metrics


BUILTIN_POLICY_LOSSES = {
    "vanilla": compute_policy_loss_vanilla,
    "gspo": compute_policy_loss_gspo,
    "gpg": compute_policy_loss_gpg,
    "clip_cov": compute_policy_loss_clip_cov,
    "kl_cov": compute_policy_loss_kl_cov,
    "cispo": compute_policy_loss_cispo,
    "sapo": compute_policy_loss_sapo,
    "geo_mean": compute_policy_loss_geo_mean,
}
