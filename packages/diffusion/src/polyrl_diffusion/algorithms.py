"""Flow-GRPO's advantage estimator and policy loss, with verl's signatures, and the DiffusionNFT loss.

Flow-GRPO (Liu et al. 2025, arXiv 2505.05470) treats every trained denoising step of a
sample as one "token": ``response_mask`` is ``[B, T]`` over the trained timesteps and
``log_prob`` / ``old_log_prob`` are the Gaussian log-densities of those SDE transitions.

- :func:`compute_flow_grpo_outcome_advantage` (registered as advantage estimator
  ``flow_grpo``): one scalar reward per image, normalised within its prompt group
  (or by the batch's std), clipped, and given to every trained step of the image.
- :func:`compute_policy_loss_flow_grpo` (registered as policy loss ``flow_grpo``): the
  PPO clipped ratio per trained step, plus an optional KL to the reference policy on
  the step means, ``||mu_theta - mu_ref||^2 / (2 sigma^2)`` (:func:`flow_grpo_kl`).
- :func:`compute_diffusion_nft_loss`: DiffusionNFT (Zheng et al. 2025, arXiv 2509.16117),
  flow matching with implicit positive / negative policies weighted by the optimality
  probability ``r`` (:func:`optimality_probability`). It needs no log-probs, so it is
  not a verl policy loss; :mod:`polyrl_diffusion.nft` wires it into the trainer.

The standard-deviation decision (docs/diffusion.md, "Algorithms"): group and global
standard deviations are taken over *samples* (one reward per image), never over the
reward tensor expanded to ``[B, T]``. torch's unbiased std over the expanded tensor
divides ``T * sum (r - mean)^2`` by ``N T - 1`` instead of ``N - 1``, so it shrinks
the std by ``sqrt(T (N - 1) / (N T - 1))`` and the advantages grow with the number of
trained steps ``T``; per sample they do not depend on ``T``.
"""

from __future__ import annotations

from typing import Any

import torch

from polyrl.algorithms.advantages import clean_padding, group_ids
from polyrl.algorithms.aggregation import agg_loss
from polyrl.algorithms.checks import cfg_get, check_finite, check_nonempty_mask, check_same_shape
from polyrl.algorithms.policy_losses import clip_range, policy_option, truncated_is_weights
from polyrl.algorithms.torch_functional import masked_mean, masked_select_zero
from polyrl.protocols import LossScale

#: Flow-GRPO's epsilon added to the std (its reference code uses 1e-4)
FLOW_GRPO_EPS = 1e-4
#: Flow-GRPO's default advantage clip (``train.adv_clip_max``)
ADV_CLIP_MAX = 5.0
LOG_RATIO_CLAMP = 20.0


def _option(config: Any, key: str, override: Any, default: Any) -> Any:
    """``override`` when given, else ``config.<key>``, else ``config.extra.<key>``, else ``default``."""
    if override is not None:
        return override
    value = cfg_get(config, key, None)
    if value is None:
        value = cfg_get(cfg_get(config, "extra", None), key, None)
    return default if value is None else value


def sample_scores(token_level_rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """One reward per sample ``[B]``: the row sum of ``token_level_rewards`` over its trained steps.

    The reward manager puts an image's reward on one step (the last), so the row sum is that
    reward whatever ``T`` is. NaN/inf in masked steps are ignored; anywhere else they raise.
    """
    check_same_shape(token_level_rewards=token_level_rewards, response_mask=response_mask)
    if token_level_rewards.dim() != 2:
        raise ValueError("token_level_rewards must be [batch, trained_steps], got "
                         f"{tuple(token_level_rewards.shape)}")
    check_finite("token_level_rewards", token_level_rewards, response_mask)
    check_nonempty_mask("response_mask", response_mask)
    return clean_padding(token_level_rewards, response_mask).sum(-1)


@torch.no_grad()
def compute_flow_grpo_outcome_advantage(token_level_rewards: torch.Tensor, response_mask: torch.Tensor,
                                        index: Any = None, config: Any = None, epsilon: float = FLOW_GRPO_EPS,
                                        norm_adv_by_std_in_grpo: bool | None = None, global_std: bool | None = None,
                                        adv_clip_max: float | None = None, std_unbiased: bool | None = None,
                                        **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Flow-GRPO advantages ``clip((r - mean_g) / (std + epsilon), -adv_clip_max, adv_clip_max)``.

    ``r`` is each image's reward (:func:`sample_scores`), ``g`` its prompt group (``index``).
    ``std`` is, as Flow-GRPO's ``PerPromptStatTracker`` with its ``global_std: True`` (its default and every
    recipe's), the std of all rewards of the batch (one value per sample; see the module docstring for why
    never over the ``[B, T]`` expansion); ``global_std=False``: the group's std over its samples. It is the
    population std (numpy's, the reference's); ``std_unbiased=True``: the unbiased one (torch's, DanceGRPO's and
    MixGRPO's, which the flow_grpo trainer selects for those variants with their ``epsilon`` 1e-8).
    ``norm_adv_by_std_in_grpo=False`` skips the division (Dr.GRPO). A group of one sample gets advantage 0: it
    has no baseline to compare with. ``adv_clip_max`` <= 0 turns clipping off. Options come as keywords or from
    ``config`` (``algorithm``; also ``algorithm.extra``). Every trained step of an image gets its advantage.
    """
    scores = sample_scores(token_level_rewards, response_mask).double()
    norm = bool(_option(config, "norm_adv_by_std_in_grpo", norm_adv_by_std_in_grpo, True))
    use_global = bool(_option(config, "global_std", global_std, True))
    unbiased = bool(_option(config, "std_unbiased", std_unbiased, False))
    clip = float(_option(config, "adv_clip_max", adv_clip_max, ADV_CLIP_MAX))
    gid = group_ids(index, scores.shape[0], scores.device)
    n_groups = int(gid.max()) + 1
    counts = torch.bincount(gid, minlength=n_groups).double()
    mean = torch.zeros(n_groups, dtype=torch.float64, device=scores.device).index_add_(0, gid, scores) / counts
    centred = scores - mean[gid]
    if norm:
        if use_global:
            std = scores.std(unbiased=unbiased) if scores.numel() > 1 else torch.ones((), dtype=torch.float64)
            std = std.expand_as(scores)
        else:
            sq = torch.zeros_like(mean).index_add_(0, gid, centred**2)
            std = torch.sqrt(sq / ((counts - 1).clamp(min=1) if unbiased else counts))[gid]
        centred = centred / (std + epsilon)
    adv = torch.where(counts[gid] > 1, centred, torch.zeros_like(centred))
    if clip > 0:
        adv = adv.clamp(-clip, clip)
    out = masked_select_zero(adv.to(token_level_rewards.dtype).unsqueeze(-1).expand_as(token_level_rewards)
                             * response_mask.to(token_level_rewards.dtype), response_mask != 0)
    return out, out.clone()


def flow_grpo_kl(prev_sample_mean: torch.Tensor, ref_prev_sample_mean: torch.Tensor,
                 std_dev_t: torch.Tensor, dt: torch.Tensor | None = None) -> torch.Tensor:
    """KL per trained step ``[B, T]`` between the policy's and the reference's Gaussian transitions.

    Both transitions have the same std ``s`` (the sampler's noise at that step), so
    ``KL = ||mu_theta - mu_ref||^2 / (2 s^2)``; the squared distance is *averaged* over the
    latent dimensions, the same reduction as the step log-probs (Flow-GRPO's code does both).
    With ``dt = sigma - sigma_next`` ``[B, T]`` the std is the transition's, ``s = std_dev_t sqrt(dt)``
    (the exact KL of the two steps); without it ``s = std_dev_t``, Flow-GRPO's code (whose KL is
    the exact one times ``dt``: a per-step reweighting that ``kl_coef`` cannot absorb).
    ``prev_sample_mean``: ``[B, T, *latent]``; ``std_dev_t``: ``[B, T]`` or broadcastable to the means.
    """
    check_same_shape(prev_sample_mean=prev_sample_mean, ref_prev_sample_mean=ref_prev_sample_mean)
    if prev_sample_mean.dim() < 2:
        raise ValueError(f"prev_sample_mean must be [batch, steps, *latent], got {tuple(prev_sample_mean.shape)}")
    sq = (prev_sample_mean - ref_prev_sample_mean.detach()) ** 2
    sq = sq.flatten(2).mean(-1) if sq.dim() > 2 else sq
    sigma = std_dev_t
    while sigma.dim() > 2:
        sigma = sigma.flatten(2).mean(-1)  # a per-step sigma broadcast over the latent: one value per step
    if sigma.shape != sq.shape:
        sigma = sigma.expand_as(sq)
    if dt is not None:
        sigma = sigma * dt.detach().to(sigma.dtype).expand_as(sq).clamp(min=0).sqrt()
    if bool((sigma <= 0).any()):
        raise ValueError("std_dev_t must be > 0 on every trained step for the KL on the step means "
                         "(a step with noise level 0 is an ODE step: leave it out of response_mask)")
    return sq / (2 * sigma.detach().to(sq.dtype) ** 2)


def compute_policy_loss_flow_grpo(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                                  response_mask: torch.Tensor, loss_agg_mode: str = "token-mean", config: Any = None,
                                  rollout_log_probs: torch.Tensor | None = None, *,
                                  loss_scale: LossScale | None = None, rollout_is_weights: torch.Tensor | None = None,
                                  prev_sample_mean: torch.Tensor | None = None,
                                  ref_prev_sample_mean: torch.Tensor | None = None,
                                  std_dev_t: torch.Tensor | None = None, step_dt: torch.Tensor | None = None,
                                  kl_coef: float | None = None,
                                  **kwargs: Any) -> tuple[torch.Tensor, dict[str, float]]:
    """Flow-GRPO: ``max(-A r_t, -A clip(r_t, 1 - low, 1 + high))`` per trained step ``t``, aggregated by
    ``loss_agg_mode`` (``token-mean``: mean over the trained steps of the batch), plus
    ``kl_coef * agg(KL_t)`` with :func:`flow_grpo_kl` when the step means are given.

    ``r_t = exp(log_prob - old_log_prob)`` is the ratio of the step's transition densities.
    ``clip_ratio`` / ``clip_ratio_low`` / ``clip_ratio_high`` come from ``config`` as for every
    verl loss (Flow-GRPO's SD3 recipe uses 1e-4: the per-step ratios of image models move
    little). ``kl_coef``: the keyword, else ``config.kl_loss_coef`` when ``config.use_kl_loss``.
    ``step_dt`` (``sigmas - next_sigmas``) makes the KL exact (see :func:`flow_grpo_kl`).
    """
    check_same_shape(old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages,
                     response_mask=response_mask, rollout_log_probs=rollout_log_probs,
                     rollout_is_weights=rollout_is_weights)
    if log_prob.dim() != 2:
        raise ValueError(f"log_prob must be [batch, trained_steps], got {tuple(log_prob.shape)}")
    info = cfg_get(config, "global_batch_info", None)
    if loss_scale is None and info:
        from polyrl.algorithms.aggregation import resolve_loss_scale

        loss_scale = resolve_loss_scale(None, cfg_get(info, "dp_size", None), cfg_get(info, "batch_num_tokens", None),
                                        cfg_get(info, "global_batch_size", None))
    if loss_scale is None:
        check_nonempty_mask("response_mask", response_mask)
    check_finite("advantages", advantages, response_mask)
    check_finite("old_log_prob", old_log_prob, response_mask)
    valid = response_mask != 0
    old_log_prob, log_prob = masked_select_zero(old_log_prob, valid), masked_select_zero(log_prob, valid)
    advantages = masked_select_zero(advantages, valid)
    low, high = clip_range(config)
    log_ratio = (log_prob - old_log_prob).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = log_ratio.exp()
    loss1 = -advantages * ratio
    loss2 = -advantages * ratio.clamp(1 - low, 1 + high)
    losses = torch.maximum(loss1, loss2)
    tis = truncated_is_weights(old_log_prob, None if rollout_log_probs is None
                               else masked_select_zero(rollout_log_probs, valid), config,
                               None if rollout_is_weights is None else masked_select_zero(rollout_is_weights, valid))
    if tis is not None:
        losses = losses * tis
    factor = policy_option(config, "loss_scale_factor", None)
    loss = agg_loss(losses, response_mask, loss_agg_mode, loss_scale_factor=factor, loss_scale=loss_scale)
    ratio_d = ratio.detach()
    metrics = {
        "ppo_kl": float(masked_mean(-log_ratio.detach(), response_mask)),
        "ratio_mean": float(masked_mean(ratio_d, response_mask)) if bool(valid.any()) else 1.0,
        "ratio_max": float(ratio_d[valid].max()) if bool(valid.any()) else 1.0,
        "ratio_min": float(ratio_d[valid].min()) if bool(valid.any()) else 1.0,
        "pg_clipfrac": float(masked_mean((loss2 > loss1).float(), response_mask)) if bool(valid.any()) else 0.0,
    }
    if kl_coef is None:
        kl_coef = float(cfg_get(config, "kl_loss_coef", 0.0)) if cfg_get(config, "use_kl_loss", False) else 0.0
    if prev_sample_mean is not None and ref_prev_sample_mean is not None:
        if std_dev_t is None:
            raise ValueError("flow_grpo loss: std_dev_t (the sampler's std per step) is needed with the step means")
        if prev_sample_mean.shape[:2] != response_mask.shape:
            raise ValueError(f"prev_sample_mean {tuple(prev_sample_mean.shape)} must start with the response_mask "
                             f"shape {tuple(response_mask.shape)} (batch, trained steps)")
        kl = masked_select_zero(flow_grpo_kl(prev_sample_mean, ref_prev_sample_mean, std_dev_t, step_dt), valid)
        kl_loss = agg_loss(kl, response_mask, loss_agg_mode, loss_scale=loss_scale)
        metrics["kl_loss"] = float(kl_loss.detach())
        if kl_coef:
            loss = loss + kl_coef * kl_loss
    elif kl_coef:
        raise ValueError("flow_grpo loss: a KL coefficient is set but prev_sample_mean / ref_prev_sample_mean "
                         "were not given (the engine must pass the step means of the policy and the reference)")
    return loss, metrics


def optimality_probability(advantages: torch.Tensor, adv_clip_max: float = ADV_CLIP_MAX) -> torch.Tensor:
    """DiffusionNFT's ``r = 1/2 + 1/2 clip(A / adv_clip_max, -1, 1)`` in ``[0, 1]`` from normalised rewards ``A``."""
    if adv_clip_max <= 0:
        raise ValueError(f"adv_clip_max must be > 0, got {adv_clip_max}")
    return 0.5 + 0.5 * (advantages / adv_clip_max).clamp(-1.0, 1.0)


def compute_diffusion_nft_loss(v_theta: torch.Tensor, v_old: torch.Tensor, v_target: torch.Tensor,
                               reward_prob: torch.Tensor, *, beta: float = 1.0, adaptive_weight: bool = False,
                               t: torch.Tensor | None = None, v_ref: torch.Tensor | None = None,
                               kl_coef: float = 0.0, sample_weight: torch.Tensor | None = None,
                               policy_scale: float = 1.0) -> tuple[torch.Tensor, dict[str, float]]:
    """DiffusionNFT: ``mean_i [ r_i ||v+_i - v_i||^2 + (1 - r_i) ||v-_i - v_i||^2 ] / beta``.

    ``v+ = (1 - beta) v_old + beta v_theta`` and ``v- = (1 + beta) v_old - beta v_theta`` are the
    implicit positive and negative policies; ``v_old`` (the sampling policy's velocity, detached)
    and ``v_target`` (the flow-matching target, e.g. ``noise - x0``) are given; ``||.||^2`` is the
    mean over the latent dimensions. With every ``r = 1`` and ``beta = 1`` it is plain flow
    matching ``||v_theta - v||^2``. The optimum per sample is ``v_old + (2 r - 1)(v - v_old) / beta``.
    The division by ``beta`` (as in the authors' code) keeps the gradient at ``v_theta = v_old``
    independent of ``beta``.

    ``adaptive_weight``: the authors' per-sample normalisation, each branch's squared error divided
    by its detached mean absolute error in x0 space (``x0_hat - x0 = t (v - v_hat)``; needs ``t``
    ``[B]``). ``v_ref`` with ``kl_coef``: adds ``kl_coef * ||v_theta - v_ref||^2``. ``policy_scale`` multiplies
    the policy term (not the KL): the authors multiply it by their ``adv_clip_max`` (5), which makes the gradient
    at ``v_theta = v_old`` proportional to the clipped advantage ``A`` itself.
    ``sample_weight`` ``[B]`` (0/1) leaves padding samples out.
    """
    check_same_shape(v_theta=v_theta, v_old=v_old, v_target=v_target)
    if beta <= 0:
        raise ValueError(f"DiffusionNFT beta must be > 0, got {beta}")
    b = v_theta.shape[0]
    r = reward_prob.reshape(-1).to(v_theta.dtype)
    if r.shape[0] != b:
        raise ValueError(f"reward_prob has {r.shape[0]} values for a batch of {b} samples")
    if not bool(torch.isfinite(r).all()) or bool(((r < 0) | (r > 1)).any()):
        raise ValueError("reward_prob must be finite and in [0, 1] (see optimality_probability)")
    v_old = v_old.detach()
    v_pos = (1 - beta) * v_old + beta * v_theta
    v_neg = (1 + beta) * v_old - beta * v_theta
    pos_sq = ((v_pos - v_target) ** 2).flatten(1).mean(-1)
    neg_sq = ((v_neg - v_target) ** 2).flatten(1).mean(-1)
    if adaptive_weight:
        if t is None:
            raise ValueError("adaptive_weight needs t, the forward-process time of each sample [B]")
        tt = t.reshape(b, *([1] * (v_theta.dim() - 1))).to(v_theta.dtype)
        with torch.no_grad():
            w_pos = (tt * (v_pos - v_target)).abs().flatten(1).mean(-1).clamp(min=1e-5)
            w_neg = (tt * (v_neg - v_target)).abs().flatten(1).mean(-1).clamp(min=1e-5)
        t2 = (tt**2).reshape(b)
        pos_sq, neg_sq = t2 * pos_sq / w_pos, t2 * neg_sq / w_neg
    per_sample = (r * pos_sq + (1 - r) * neg_sq) / beta
    weight = torch.ones(b, dtype=v_theta.dtype, device=v_theta.device) if sample_weight is None \
        else sample_weight.reshape(-1).to(v_theta.dtype)
    denom = weight.sum().clamp(min=1)
    loss = policy_scale * (per_sample * weight).sum() / denom
    metrics = {"nft/policy_loss": float(loss.detach()), "nft/r_mean": float((r * weight).sum() / denom),
               "nft/old_deviation": float((((v_theta.detach() - v_old) ** 2).flatten(1).mean(-1) * weight).sum() / denom)}
    if v_ref is not None and kl_coef:
        kl = (((v_theta - v_ref.detach()) ** 2).flatten(1).mean(-1) * weight).sum() / denom
        loss = loss + kl_coef * kl
        metrics["nft/kl_loss"] = float(kl.detach())
    return loss, metrics
