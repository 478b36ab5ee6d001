"""Advantage estimators with verl's names and signatures, vectorised over the batch.

Every estimator: ``fn(token_level_rewards, response_mask, index=None, config=None, **kw)
-> (advantages, returns)``, both ``[B, R]`` and zero on masked tokens. Grouping is
by ``index`` (the prompt uid): samples of one prompt share it. Formulas and
references: docs/algorithms.md.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from polyrl.algorithms.core import cfg_get, check_finite, check_same_shape, masked_whiten

EPS = 1e-6


def group_ids(index: Any, size: int) -> torch.Tensor:
    """Dense group ids ``[B]`` from uids (numpy array, list or tensor of any hashable)."""
    if index is None:
        raise ValueError("index (the group id of each sample) is required by group-based estimators")
    if isinstance(index, torch.Tensor):
        index = index.cpu().numpy()
    arr = np.asarray(index, dtype=object) if not isinstance(index, np.ndarray) else index
    if len(arr) != size:
        raise ValueError(f"index has {len(arr)} entries for a batch of {size}")
    _, inverse = np.unique(arr.astype(str), return_inverse=True)
    return torch.as_tensor(inverse.reshape(-1), dtype=torch.long)


def group_stats(scores: torch.Tensor, gid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample group mean, unbiased std and group size; singleton groups get mean 0, std 1 (verl).

    Computed in float64 so a constant-reward group gets exactly zero deviation (in
    float32 the rounding error of the mean, divided by ``std + eps``, is not zero).
    """
    dtype = scores.dtype
    scores = scores.double()
    n_groups = int(gid.max()) + 1 if gid.numel() else 0
    counts = torch.bincount(gid, minlength=n_groups).to(scores.dtype)
    sums = torch.zeros(n_groups, dtype=scores.dtype).index_add_(0, gid, scores)
    mean = sums / counts.clamp(min=1)
    sq = torch.zeros(n_groups, dtype=scores.dtype).index_add_(0, gid, (scores - mean[gid]) ** 2)
    std = torch.sqrt(sq / (counts - 1).clamp(min=1))
    single = counts == 1
    mean = torch.where(single, torch.zeros_like(mean), mean)
    std = torch.where(single, torch.ones_like(std), std)
    return mean[gid].to(dtype), std[gid].to(dtype), counts[gid].to(dtype)


def _outcome(token_level_rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    check_same_shape(token_level_rewards=token_level_rewards, response_mask=response_mask)
    check_finite("token_level_rewards", token_level_rewards)
    return token_level_rewards.sum(dim=-1)


def _tile(scores: torch.Tensor, response_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    adv = scores.unsqueeze(-1) * response_mask
    return adv, adv


def compute_grpo_outcome_advantage(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Any = None,
                                   config: Any = None, epsilon: float = EPS, norm_adv_by_std_in_grpo: bool | None = None,
                                   **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO: ``(r - mean_group) / (std_group + eps)``; without std normalisation it is Dr.GRPO."""
    scores = _outcome(token_level_rewards, response_mask)
    gid = group_ids(index, scores.shape[0])
    mean, std, _ = group_stats(scores, gid)
    scores = scores.double()
    norm = norm_adv_by_std_in_grpo if norm_adv_by_std_in_grpo is not None else cfg_get(config, "norm_adv_by_std_in_grpo", True)
    scores = (scores - mean.double()) / (std.double() + epsilon) if norm else scores - mean.double()
    return _tile(scores.to(token_level_rewards.dtype), response_mask)


def compute_grpo_passk_outcome_advantage(token_level_rewards: torch.Tensor, response_mask: torch.Tensor,
                                         index: Any = None, config: Any = None, epsilon: float = EPS,
                                         **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass@k GRPO: only the best sample of a group gets ``(r_max - r_second) [/ (std + eps)]``."""
    scores = _outcome(token_level_rewards, response_mask)
    gid = group_ids(index, scores.shape[0])
    _, std, counts = group_stats(scores, gid)
    if bool((counts < 2).any()):
        raise ValueError("grpo_passk needs at least 2 samples per group (rollout.n >= 2)")
    n_groups = int(gid.max()) + 1
    order = torch.argsort(scores, descending=True, stable=True)
    order = order[torch.argsort(gid[order], stable=True)]  # grouped, best first within each group
    starts = torch.cumsum(torch.bincount(gid, minlength=n_groups), 0) - torch.bincount(gid, minlength=n_groups)
    best, second = order[starts], order[starts + 1]
    gap = scores[best] - scores[second]
    if cfg_get(config, "norm_adv_by_std_in_grpo", True):
        gap = gap / (std[best] + epsilon)
    out = torch.zeros_like(scores)
    out[best] = gap
    return _tile(out, response_mask)


def compute_rloo_outcome_advantage(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Any = None,
                                   config: Any = None, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO: ``r_i - mean(r_j, j != i)`` within the group (singletons keep their reward)."""
    scores = _outcome(token_level_rewards, response_mask)
    gid = group_ids(index, scores.shape[0])
    mean, _, counts = group_stats(scores, gid)
    factor = counts / (counts - 1).clamp(min=1)
    scores = torch.where(counts > 1, scores * factor - mean * factor, scores)
    return _tile(scores, response_mask)


def compute_opo_outcome_advantage(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Any = None,
                                  config: Any = None, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """OPO: the length-weighted group mean as the optimal baseline."""
    scores = _outcome(token_level_rewards, response_mask)
    gid = group_ids(index, scores.shape[0])
    lengths = response_mask.sum(-1).to(scores.dtype)
    n_groups = int(gid.max()) + 1
    num = torch.zeros(n_groups, dtype=scores.dtype).index_add_(0, gid, lengths * scores)
    den = torch.zeros(n_groups, dtype=scores.dtype).index_add_(0, gid, lengths)
    counts = torch.bincount(gid, minlength=n_groups)
    baseline = torch.where(counts > 1, num / den.clamp(min=1e-8), torch.zeros_like(num))
    return _tile(scores - baseline[gid], response_mask)


def compute_gpg_outcome_advantage(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Any = None,
                                  config: Any = None, f_norm: float = 1.0, alpha: float = 1.0,
                                  **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """GPG: ``alpha * (r - mean_group) / f_norm`` with ``alpha = B / #nonzero rewards``."""
    scores = _outcome(token_level_rewards, response_mask)
    gid = group_ids(index, scores.shape[0])
    mean, _, _ = group_stats(scores, gid)
    m = torch.count_nonzero(scores)
    alpha = scores.shape[0] / m.clamp(min=1) * alpha
    return _tile(alpha * (scores - mean) / f_norm, response_mask)


def compute_reinforce_plus_plus_baseline_outcome_advantage(token_level_rewards: torch.Tensor,
                                                           response_mask: torch.Tensor, index: Any = None,
                                                           config: Any = None, **kwargs: Any
                                                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ with a group-mean baseline, then whitened over the batch."""
    scores = _outcome(token_level_rewards, response_mask)
    gid = group_ids(index, scores.shape[0])
    mean, _, _ = group_stats(scores, gid)
    tiled = (scores - mean).unsqueeze(-1) * response_mask
    adv = masked_whiten(tiled, response_mask) * response_mask
    return adv, adv


def _discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    returns = torch.zeros_like(rewards)
    running = torch.zeros(rewards.shape[0], dtype=rewards.dtype)
    for t in reversed(range(rewards.shape[1])):  # a loop over time, vectorised over the batch
        running = rewards[:, t] + gamma * running
        returns[:, t] = running
        running = running * mask[:, t]
    return returns


def compute_reinforce_plus_plus_outcome_advantage(token_level_rewards: torch.Tensor, response_mask: torch.Tensor,
                                                  index: Any = None, config: Any = None, gamma: float | None = None,
                                                  **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++: discounted returns, whitened over the batch."""
    check_same_shape(token_level_rewards=token_level_rewards, response_mask=response_mask)
    check_finite("token_level_rewards", token_level_rewards)
    gamma = gamma if gamma is not None else cfg_get(config, "gamma", 1.0)
    returns = _discounted_returns(token_level_rewards, response_mask, gamma)
    adv = masked_whiten(returns, response_mask) * response_mask
    return adv, returns


def compute_remax_outcome_advantage(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Any = None,
                                    config: Any = None, reward_baselines: torch.Tensor | None = None,
                                    **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax: returns minus the greedy response's reward (``reward_baselines``, ``[B]``)."""
    check_same_shape(token_level_rewards=token_level_rewards, response_mask=response_mask)
    check_finite("token_level_rewards", token_level_rewards)
    if reward_baselines is None:
        raise ValueError("remax needs reward_baselines (the greedy response's reward per sample)")
    returns = (token_level_rewards * response_mask).flip(-1).cumsum(-1).flip(-1)
    adv = returns - reward_baselines.unsqueeze(-1) * response_mask
    return adv * response_mask, returns


def compute_gae_advantage_return(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Any = None,
                                 config: Any = None, values: torch.Tensor | None = None, gamma: float | None = None,
                                 lam: float | None = None, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE (Schulman et al., 2016) over the response tokens; advantages whitened, returns = adv + V."""
    if values is None:
        raise ValueError("gae needs values (the critic's value per response token)")
    check_same_shape(token_level_rewards=token_level_rewards, values=values, response_mask=response_mask)
    check_finite("token_level_rewards", token_level_rewards)
    gamma = gamma if gamma is not None else cfg_get(config, "gamma", 1.0)
    lam = lam if lam is not None else cfg_get(config, "lam", 1.0)
    mask = response_mask.to(values.dtype)
    next_values = torch.zeros(values.shape[0], dtype=values.dtype)
    last = torch.zeros_like(next_values)
    adv = torch.zeros_like(values)
    for t in reversed(range(values.shape[1])):
        delta = token_level_rewards[:, t] + gamma * next_values - values[:, t]
        new_last = delta + gamma * lam * last
        # padding positions pass the running quantities through unchanged
        next_values = values[:, t] * mask[:, t] + (1 - mask[:, t]) * next_values
        last = new_last * mask[:, t] + (1 - mask[:, t]) * last
        adv[:, t] = last
    returns = adv + values
    adv = masked_whiten(adv, mask) * mask
    return adv, returns * mask


#: name -> function, registered by polyrl.algorithms.hooks
BUILTIN_ESTIMATORS = {
    "gae": compute_gae_advantage_return,
    "grpo": compute_grpo_outcome_advantage,
    "grpo_passk": compute_grpo_passk_outcome_advantage,
    "rloo": compute_rloo_outcome_advantage,
    "reinforce_plus_plus": compute_reinforce_plus_plus_outcome_advantage,
    "reinforce_plus_plus_baseline": compute_reinforce_plus_plus_baseline_outcome_advantage,
    "remax": compute_remax_outcome_advantage,
    "opo": compute_opo_outcome_advantage,
    "gpg": compute_gpg_outcome_advantage,
}
