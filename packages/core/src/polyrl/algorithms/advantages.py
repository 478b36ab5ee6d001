"""Advantage estimators with verl's names and signatures, vectorised over the batch.

Every estimator: ``fn(token_level_rewards, response_mask, index=None, config=None, **kw)
-> (advantages, returns)``, both ``[B, R]`` and zero on masked tokens. Grouping is
by ``index`` (the prompt uid; a numpy array of strings or ints, a list or a
tensor): samples of one prompt share it. Group statistics come from one
``unique(return_inverse=True)`` plus ``bincount``/``index_add_``, never a Python
loop per sample or group (GAE and REINFORCE++ loop over time steps, vectorised
over the batch, as any causal recursion must). Formulas and papers: docs/algorithms.md.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from polyrl.algorithms.core import cfg_get, check_finite, check_nonempty_mask, check_same_shape, masked_whiten

EPS = 1e-6


def group_ids(index: Any, size: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Dense group ids ``[B]`` (0..G-1) from ``index``: a numpy array, list or tensor of uids."""
    if index is None:
        raise ValueError("index is required by this estimator: the group id (prompt uid) of each sample")
    if isinstance(index, torch.Tensor):
        if index.dim() != 1:
            raise ValueError(f"index must be 1-D with one uid per sample, got shape {tuple(index.shape)}")
        inverse = torch.unique(index, return_inverse=True)[1]
    else:
        arr = np.asarray(index)
        if arr.ndim != 1:
            raise ValueError(f"index must be 1-D with one uid per sample, got shape {arr.shape}")
        if arr.dtype == object:  # uid strings from a non-tensor batch field; str dtype sorts in C
            arr = arr.astype(str)
        inverse = torch.from_numpy(np.unique(arr, return_inverse=True)[1].reshape(-1).astype(np.int64))
    if inverse.numel() != size:
        raise ValueError(f"index has {inverse.numel()} entries for a batch of {size} samples")
    return inverse.to(device=device, dtype=torch.long)


def group_stats(scores: torch.Tensor, gid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample group mean, unbiased std and group size, in float64; singletons get mean 0, std 1 (verl).

    float64 so a constant-reward group gets exactly zero deviation: in float32 the
    rounding error of the mean, divided by ``std + 1e-6``, is not zero.
    """
    scores = scores.double()
    n_groups = int(gid.max()) + 1
    counts = torch.bincount(gid, minlength=n_groups).double()
    mean = torch.zeros(n_groups, dtype=torch.float64, device=scores.device).index_add_(0, gid, scores) / counts
    sq = torch.zeros_like(mean).index_add_(0, gid, (scores - mean[gid]) ** 2)
    std = torch.sqrt(sq / (counts - 1).clamp(min=1))
    single = counts == 1
    mean = torch.where(single, torch.zeros_like(mean), mean)
    std = torch.where(single, torch.ones_like(std), std)
    return mean[gid], std[gid], counts[gid]


def _check(token_level_rewards: torch.Tensor, response_mask: torch.Tensor,
           **others: torch.Tensor | None) -> torch.Tensor:
    """Validate the inputs; return the sequence scores ``token_level_rewards.sum(-1)``.

    Checks run on per-row sums (a NaN/inf anywhere in a row makes its sum non-finite):
    one pass over ``[B, R]`` instead of an ``isfinite`` pass, which is ~30x slower on CPU.
    """
    check_same_shape(token_level_rewards=token_level_rewards, response_mask=response_mask, **others)
    if token_level_rewards.dim() != 2:
        raise ValueError(f"token_level_rewards must be [batch, response_length], got {tuple(token_level_rewards.shape)}")
    scores = token_level_rewards.sum(-1)
    if not bool(torch.isfinite(scores).all()):
        check_finite("token_level_rewards", token_level_rewards)
        raise ValueError("token_level_rewards overflow when summed per sequence; rescale the reward")
    if not bool(response_mask.sum(-1).any()):
        check_nonempty_mask("response_mask", response_mask)
    for name, value in others.items():
        if value is not None:
            check_finite(name, value, response_mask)
    return scores


def _tile(scores: torch.Tensor, response_mask: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    adv = scores.to(dtype).unsqueeze(-1) * response_mask.to(dtype)
    return adv, adv


def _norm_by_std(config: Any, override: bool | None) -> bool:
    return bool(override) if override is not None else bool(cfg_get(config, "norm_adv_by_std_in_grpo", True))


@torch.no_grad()
def compute_grpo_outcome_advantage(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Any = None,
                                   config: Any = None, epsilon: float = EPS,
                                   norm_adv_by_std_in_grpo: bool | None = None,
                                   **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO: ``(r - mean_g) / (std_g + epsilon)``; with ``norm_adv_by_std_in_grpo`` false, ``r - mean_g`` (Dr.GRPO).

    ``r`` is the sequence reward (sum of ``token_level_rewards``); singleton groups
    use mean 0 and std 1, as verl does.
    """
    scores = _check(token_level_rewards, response_mask)
    mean, std, _ = group_stats(scores, group_ids(index, scores.shape[0], scores.device))
    centred = scores.double() - mean
    out = centred / (std + epsilon) if _norm_by_std(config, norm_adv_by_std_in_grpo) else centred
    return _tile(out, response_mask, token_level_rewards.dtype)


@torch.no_grad()
def compute_grpo_passk_outcome_advantage(token_level_rewards: torch.Tensor, response_mask: torch.Tensor,
                                         index: Any = None, config: Any = None, epsilon: float = EPS,
                                         norm_adv_by_std_in_grpo: bool | None = None,
                                         **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass@k GRPO: only the best sample of a group gets ``(r_max - r_second) [/ (std_g + epsilon)]``.

    Ties for the best go to the first such sample in batch order. Needs groups of at least 2.
    """
    scores = _check(token_level_rewards, response_mask).double()
    gid = group_ids(index, scores.shape[0], scores.device)
    _, std, counts = group_stats(scores, gid)
    if bool((counts < 2).any()):
        raise ValueError("grpo_passk needs at least 2 samples per index group (rollout.n >= 2)")
    n_groups = int(gid.max()) + 1
    order = torch.argsort(scores, descending=True, stable=True)
    order = order[torch.argsort(gid[order], stable=True)]  # grouped by id, best first within each group
    sizes = torch.bincount(gid, minlength=n_groups)
    starts = torch.cumsum(sizes, 0) - sizes
    best, second = order[starts], order[starts + 1]
    gap = scores[best] - scores[second]
    if _norm_by_std(config, norm_adv_by_std_in_grpo):
        gap = gap / (std[best] + epsilon)
    out = torch.zeros_like(scores)
    out[best] = gap
    return _tile(out, response_mask, token_level_rewards.dtype)


@torch.no_grad()
def compute_rloo_outcome_advantage(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Any = None,
                                   config: Any = None, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO: ``r_i - mean_{j != i} r_j = n/(n-1) (r_i - mean_g)`` within the group; singletons keep ``r``."""
    scores = _check(token_level_rewards, response_mask).double()
    mean, _, counts = group_stats(scores, group_ids(index, scores.shape[0], scores.device))
    factor = counts / (counts - 1).clamp(min=1)
    out = torch.where(counts > 1, (scores - mean) * factor, scores)
    return _tile(out, response_mask, token_level_rewards.dtype)


@torch.no_grad()
def compute_opo_outcome_advantage(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Any = None,
                                  config: Any = None, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """OPO: ``r_i - sum_g(len_j r_j) / sum_g(len_j)``, the length-weighted optimal baseline; singletons keep ``r``."""
    scores = _check(token_level_rewards, response_mask).double()
    gid = group_ids(index, scores.shape[0], scores.device)
    lengths = response_mask.sum(-1).double()
    n_groups = int(gid.max()) + 1
    num = torch.zeros(n_groups, dtype=torch.float64, device=scores.device).index_add_(0, gid, lengths * scores)
    den = torch.zeros_like(num).index_add_(0, gid, lengths)
    counts = torch.bincount(gid, minlength=n_groups)
    # a group whose responses are all empty has no length to weight by: no baseline
    baseline = torch.where((counts > 1) & (den > 0), num / den.clamp(min=1), torch.zeros_like(num))
    return _tile(scores - baseline[gid], response_mask, token_level_rewards.dtype)


@torch.no_grad()
def compute_gpg_outcome_advantage(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Any = None,
                                  config: Any = None, epsilon: float = EPS, f_norm: float = 1.0, alpha: float = 1.0,
                                  **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """GPG: ``alpha' (r - mean_g) / f_norm`` with ``alpha' = alpha * B / #nonzero(r)`` (verl ignores ``alpha``)."""
    scores = _check(token_level_rewards, response_mask).double()
    mean, _, _ = group_stats(scores, group_ids(index, scores.shape[0], scores.device))
    scale = alpha * scores.shape[0] / max(int(torch.count_nonzero(scores)), 1)
    return _tile(scale * (scores - mean) / f_norm, response_mask, token_level_rewards.dtype)


@torch.no_grad()
def compute_reinforce_plus_plus_baseline_outcome_advantage(token_level_rewards: torch.Tensor,
                                                           response_mask: torch.Tensor, index: Any = None,
                                                           config: Any = None, epsilon: float = EPS, **kwargs: Any
                                                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++-baseline: ``r - mean_g`` on every response token, then whitened over the whole batch."""
    scores = _check(token_level_rewards, response_mask).double()
    mean, _, _ = group_stats(scores, group_ids(index, scores.shape[0], scores.device))
    mask = response_mask.to(token_level_rewards.dtype)
    tiled = (scores - mean).to(token_level_rewards.dtype).unsqueeze(-1) * mask
    adv = masked_whiten(tiled, mask) * mask
    return adv, adv


def _discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """``G_t = r_t + gamma G_{t+1}``, restarted after the end of each response (verl's recursion)."""
    returns = torch.zeros_like(rewards)
    running = torch.zeros(rewards.shape[0], dtype=rewards.dtype, device=rewards.device)
    for t in reversed(range(rewards.shape[1])):  # over time only; vectorised over the batch
        running = rewards[:, t] + gamma * running
        returns[:, t] = running
        running = running * mask[:, t]
    return returns


@torch.no_grad()
def compute_reinforce_plus_plus_outcome_advantage(token_level_rewards: torch.Tensor, response_mask: torch.Tensor,
                                                  index: Any = None, config: Any = None, gamma: float | None = None,
                                                  **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++: discounted returns (``gamma``, default ``config.gamma`` or 1), whitened over the batch."""
    _check(token_level_rewards, response_mask)
    gamma = gamma if gamma is not None else cfg_get(config, "gamma", 1.0)
    mask = response_mask.to(token_level_rewards.dtype)
    returns = _discounted_returns(token_level_rewards, mask, gamma)
    adv = masked_whiten(returns, mask) * mask
    return adv, returns


@torch.no_grad()
def compute_remax_outcome_advantage(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Any = None,
                                    config: Any = None, reward_baselines: torch.Tensor | None = None,
                                    **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax: reward-to-go minus the greedy response's reward ``reward_baselines`` (``[B]``)."""
    _check(token_level_rewards, response_mask)
    if reward_baselines is None:
        raise ValueError("remax needs reward_baselines=[B] tensor: the reward of each prompt's greedy response")
    reward_baselines = torch.as_tensor(reward_baselines, dtype=token_level_rewards.dtype,
                                       device=token_level_rewards.device).reshape(-1)
    if reward_baselines.shape[0] != token_level_rewards.shape[0]:
        raise ValueError(f"reward_baselines has {reward_baselines.shape[0]} entries for a batch of "
                         f"{token_level_rewards.shape[0]}")
    check_finite("reward_baselines", reward_baselines)
    mask = response_mask.to(token_level_rewards.dtype)
    returns = (token_level_rewards * mask).flip(-1).cumsum(-1).flip(-1)
    adv = (returns - reward_baselines.unsqueeze(-1)) * mask
    return adv, returns


@torch.no_grad()
def compute_gae_advantage_return(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Any = None,
                                 config: Any = None, values: torch.Tensor | None = None, gamma: float | None = None,
                                 lam: float | None = None, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE(gamma, lam) over the response tokens with the critic's ``values``; advantages whitened, returns ``A + V``.

    ``gamma``/``lam`` default to ``config.gamma``/``config.lam`` (1.0). Masked
    tokens inside a response (tool output) are skipped: their value and TD error
    do not enter the recursion, as in verl.
    """
    if values is None:
        raise ValueError("gae needs values=[B, R] (the critic's value of each response token)")
    _check(token_level_rewards, response_mask, values=values)
    gamma = gamma if gamma is not None else cfg_get(config, "gamma", 1.0)
    lam = lam if lam is not None else cfg_get(config, "lam", 1.0)
    mask = response_mask.to(values.dtype)
    next_value = torch.zeros(values.shape[0], dtype=values.dtype, device=values.device)
    last = torch.zeros_like(next_value)
    adv = torch.zeros_like(values)
    for t in reversed(range(values.shape[1])):  # over time only; vectorised over the batch
        delta = token_level_rewards[:, t] + gamma * next_value - values[:, t]
        m = mask[:, t]
        next_value = values[:, t] * m + (1 - m) * next_value
        last = (delta + gamma * lam * last) * m + (1 - m) * last
        adv[:, t] = last
    returns = (adv + values) * mask
    return masked_whiten(adv, mask) * mask, returns


#: name -> function; registered by polyrl.algorithms.hooks
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
