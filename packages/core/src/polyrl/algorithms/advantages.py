"""Advantage estimators with verl's names and signatures, vectorised over the batch.

Every estimator: ``fn(token_level_rewards, response_mask, index=None, config=None, **kw)
-> (advantages, returns)``, both ``[B, R]`` and zero on masked tokens. Grouping is
by ``index`` (the prompt uid; a numpy array of strings or ints, a list or a
tensor): samples of one prompt share it. Group statistics come from one
``unique(return_inverse=True)`` plus ``bincount``/``index_add_``, never a Python
loop per sample or group (GAE and REINFORCE++ loop over time steps, vectorised
over the batch, as any causal recursion must). GAE also takes verl's positional order
``(token_level_rewards, values, response_mask, gamma, lam)``. NaN/inf in padding
(``response_mask`` 0) never changes a result. Formulas and papers: docs/algorithms.md.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from polyrl.algorithms.checks import cfg_get, check_finite, check_nonempty_mask, check_same_shape
from polyrl.algorithms.torch_functional import masked_select_zero, masked_whiten

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


def clean_padding(values: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """``values`` with every non-finite entry in padding (``response_mask == 0``) set to 0.

    Finite values in padding stay: a reward manager may put the outcome on a trailing
    tool token, and verl's outcome estimators sum the whole row.
    """
    return torch.where((response_mask != 0) | torch.isfinite(values), values, torch.zeros_like(values))


def _check(token_level_rewards: torch.Tensor, response_mask: torch.Tensor,
           **others: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate the inputs; return the rewards (NaN/inf in padding zeroed) and the sequence scores (row sums).

    The fast path checks per-row sums (a NaN/inf anywhere in a row makes its sum
    non-finite): one pass over ``[B, R]`` instead of an ``isfinite`` pass.
    """
    check_same_shape(token_level_rewards=token_level_rewards, response_mask=response_mask, **others)
    if token_level_rewards.dim() != 2:
        raise ValueError(f"token_level_rewards must be [batch, response_length], got {tuple(token_level_rewards.shape)}")
    rewards = token_level_rewards
    scores = rewards.sum(-1)
    if not bool(torch.isfinite(scores).all()):
        check_finite("token_level_rewards", rewards, response_mask)
        rewards = clean_padding(rewards, response_mask)
        scores = rewards.sum(-1)
        if not bool(torch.isfinite(scores).all()):
            raise ValueError("token_level_rewards overflow when summed per sequence; rescale the reward")
    if not bool(response_mask.sum(-1).any()):
        check_nonempty_mask("response_mask", response_mask)
    for name, value in others.items():
        if value is not None:
            check_finite(name, value, response_mask)
    return rewards, scores


def _tile(scores: torch.Tensor, response_mask: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    adv = masked_select_zero(scores.to(dtype).unsqueeze(-1) * response_mask.to(dtype), response_mask)
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
    scores = _check(token_level_rewards, response_mask)[1]
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
    scores = _check(token_level_rewards, response_mask)[1].double()
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
    scores = _check(token_level_rewards, response_mask)[1].double()
    mean, _, counts = group_stats(scores, group_ids(index, scores.shape[0], scores.device))
    factor = counts / (counts - 1).clamp(min=1)
    out = torch.where(counts > 1, (scores - mean) * factor, scores)
    return _tile(out, response_mask, token_level_rewards.dtype)


@torch.no_grad()
def compute_opo_outcome_advantage(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Any = None,
                                  config: Any = None, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """OPO: ``r_i - sum_g(len_j r_j) / sum_g(len_j)``, the length-weighted optimal baseline; singletons keep ``r``."""
    scores = _check(token_level_rewards, response_mask)[1].double()
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
    scores = _check(token_level_rewards, response_mask)[1].double()
    mean, _, _ = group_stats(scores, group_ids(index, scores.shape[0], scores.device))
    scale = alpha * scores.shape[0] / max(int(torch.count_nonzero(scores)), 1)
    return _tile(scale * (scores - mean) / f_norm, response_mask, token_level_rewards.dtype)


@torch.no_grad()
def compute_reinforce_plus_plus_baseline_outcome_advantage(token_level_rewards: torch.Tensor,
                                                           response_mask: torch.Tensor, index: Any = None,
                                                           config: Any = None, epsilon: float = EPS, **kwargs: Any
                                                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++-baseline: ``r - mean_g`` on every response token, then whitened over the whole batch."""
    scores = _check(token_level_rewards, response_mask)[1].double()
    mean, _, _ = group_stats(scores, group_ids(index, scores.shape[0], scores.device))
    mask = response_mask.to(token_level_rewards.dtype)
    tiled, _ = _tile(scores - mean, mask, token_level_rewards.dtype)
    adv = masked_whiten(tiled, mask)
    return adv, adv


def _discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """``G_t = r_t + gamma G_{t+1}`` over the tokens where ``mask`` is set; 0 elsewhere.

    Masked tokens inside a response (tool output between assistant turns) are
    skipped, not counted as time steps: the running return passes over them
    unchanged and they get 0 (verl main, #7300).
    """
    returns = torch.zeros_like(rewards)
    running = torch.zeros(rewards.shape[0], dtype=rewards.dtype, device=rewards.device)
    valid = mask != 0
    for t in reversed(range(rewards.shape[1])):  # over time only; vectorised over the batch
        step = rewards[:, t] + gamma * running
        returns[:, t] = torch.where(valid[:, t], step, torch.zeros_like(step))
        running = torch.where(valid[:, t], step, running)
    return returns


@torch.no_grad()
def compute_reinforce_plus_plus_outcome_advantage(token_level_rewards: torch.Tensor, response_mask: torch.Tensor,
                                                  index: Any = None, config: Any = None, gamma: float | None = None,
                                                  **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++: discounted returns over the model's tokens (``gamma``, default ``config.gamma`` or 1),
    whitened over the batch. Tool/environment tokens (``response_mask`` 0) get 0 and do not break the return."""
    rewards, _ = _check(token_level_rewards, response_mask)
    gamma = gamma if gamma is not None else cfg_get(config, "gamma", 1.0)
    mask = response_mask.to(token_level_rewards.dtype)
    returns = _discounted_returns(rewards, mask, gamma)
    return masked_whiten(returns, mask), returns


@torch.no_grad()
def compute_remax_outcome_advantage(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Any = None,
                                    config: Any = None, reward_baselines: torch.Tensor | None = None,
                                    **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax: reward-to-go minus the greedy response's reward ``reward_baselines`` (``[B]``)."""
    rewards, _ = _check(token_level_rewards, response_mask)
    if reward_baselines is None:
        raise ValueError("remax needs reward_baselines=[B] tensor: the reward of each prompt's greedy response")
    reward_baselines = torch.as_tensor(reward_baselines, dtype=token_level_rewards.dtype,
                                       device=token_level_rewards.device).reshape(-1)
    if reward_baselines.shape[0] != token_level_rewards.shape[0]:
        raise ValueError(f"reward_baselines has {reward_baselines.shape[0]} entries for a batch of "
                         f"{token_level_rewards.shape[0]}")
    check_finite("reward_baselines", reward_baselines)
    mask = response_mask.to(token_level_rewards.dtype)
    returns = masked_select_zero(rewards * mask, mask).flip(-1).cumsum(-1).flip(-1)
    adv = masked_select_zero(returns - reward_baselines.unsqueeze(-1), mask)
    return adv, returns


@torch.no_grad()
def compute_gae_advantage_return(token_level_rewards: torch.Tensor, values: torch.Tensor | None = None,
                                 response_mask: torch.Tensor | None = None, gamma: float | None = None,
                                 lam: float | None = None, index: Any = None, config: Any = None,
                                 **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE(gamma, lam) over the response tokens with the critic's ``values``; advantages whitened, returns ``A + V``.

    verl's signature: ``compute_gae_advantage_return(token_level_rewards, values,
    response_mask, gamma, lam)``, positionally or by keyword. ``gamma``/``lam``
    default to ``config.gamma``/``config.lam`` (1.0). Masked tokens inside a
    response (tool output) are skipped: their value and TD error do not enter the
    recursion, as in verl. Unlike verl, advantages and returns are 0 on padding.
    """
    if values is None:
        raise ValueError("gae needs values=[B, R] (the critic's value of each response token)")
    if response_mask is None:
        raise ValueError("gae needs response_mask=[B, R]")
    rewards, _ = _check(token_level_rewards, response_mask, values=values)
    gamma = gamma if gamma is not None else cfg_get(config, "gamma", 1.0)
    lam = lam if lam is not None else cfg_get(config, "lam", 1.0)
    valid = response_mask != 0
    values = masked_select_zero(values, valid)
    rewards = masked_select_zero(rewards, valid | torch.isfinite(rewards))
    next_value = torch.zeros(values.shape[0], dtype=values.dtype, device=values.device)
    last = torch.zeros_like(next_value)
    adv = torch.zeros_like(values)
    for t in reversed(range(values.shape[1])):  # over time only; vectorised over the batch
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        v = valid[:, t]
        next_value = torch.where(v, values[:, t], next_value)
        last = torch.where(v, delta + gamma * lam * last, last)
        adv[:, t] = last
    mask = response_mask.to(values.dtype)
    returns = masked_select_zero(adv + values, mask)
    return masked_whiten(adv, mask), returns


@torch.no_grad()
def compute_rloo_vectorized_outcome_advantage(token_level_rewards: torch.Tensor, response_mask: torch.Tensor,
                                              index: Any = None, config: Any = None, epsilon: float = EPS,
                                              **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's ``rloo_vectorized``: RLOO, except that a singleton group gets advantage 0 (``rloo`` keeps ``r``)."""
    scores = _check(token_level_rewards, response_mask)[1].double()
    mean, _, counts = group_stats(scores, group_ids(index, scores.shape[0], scores.device))
    factor = counts / (counts - 1).clamp(min=1)
    out = torch.where(counts > 1, (scores - mean) * factor, torch.zeros_like(scores))
    return _tile(out, response_mask, token_level_rewards.dtype)


#: verl's ``grpo_vectorized`` is the same estimator as ``grpo`` (this one is vectorised already)
compute_grpo_vectorized_outcome_advantage = compute_grpo_outcome_advantage


def _component_scores(config: Any, non_tensor_batch: Any, reward_components: Any, size: int,
                      device: torch.device) -> tuple[list[torch.Tensor], list[float] | None]:
    """GDPO's per-sample reward components and their weights, from ``reward_components`` or verl's
    ``non_tensor_batch`` with the keys ``algorithm.gdpo_reward_keys``."""
    keys = cfg_get(config, "gdpo_reward_keys", None) or cfg_get(cfg_get(config, "extra", None), "gdpo_reward_keys")
    weights = cfg_get(config, "gdpo_reward_weights", None) or cfg_get(cfg_get(config, "extra", None),
                                                                        "gdpo_reward_weights")
    source = reward_components if reward_components is not None else non_tensor_batch
    if source is None:
        return [], None
    if not keys:
        if reward_components is None:
            return [], None  # verl: without gdpo_reward_keys, GDPO is GRPO on the summed reward, whitened
        keys = list(reward_components)
    scores = []
    for key in keys:
        if key not in source:
            raise ValueError(f"gdpo: reward component '{key}' (algorithm.gdpo_reward_keys) is not in the batch; "
                             f"available: {', '.join(map(str, source))}. The reward function must return a dict "
                             f"with '{key}'")
        column = torch.as_tensor(np.asarray(source[key], dtype=np.float64), device=device).reshape(-1)
        if column.numel() != size:
            raise ValueError(f"gdpo: reward component '{key}' has {column.numel()} values for {size} samples")
        check_finite(f"reward component '{key}'", column)
        scores.append(column)
    if weights is not None and len(list(weights)) != len(keys):
        raise ValueError(f"gdpo: {len(list(weights))} gdpo_reward_weights for {len(keys)} gdpo_reward_keys")
    return scores, (None if weights is None else [float(w) for w in weights])


@torch.no_grad()
def compute_gdpo_outcome_advantage(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Any = None,
                                   config: Any = None, epsilon: float = EPS,
                                   norm_adv_by_std_in_grpo: bool | None = None, non_tensor_batch: Any = None,
                                   reward_components: Any = None, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """GDPO (arXiv 2601.05242): GRPO-normalise each reward component within its group, sum them with
    ``gdpo_reward_weights`` (default 1 each), then whiten over the batch.

    Components come from ``reward_components`` (``{name: [B] scores}``) or, as in
    verl, from ``non_tensor_batch[key]`` for each key of ``algorithm.gdpo_reward_keys``
    (the reward function returns a dict with those keys). Without components it is
    GRPO on the summed reward, whitened.
    """
    _, total = _check(token_level_rewards, response_mask)
    components, weights = _component_scores(config, non_tensor_batch, reward_components, total.shape[0], total.device)
    if not components:
        components = [total]
    gid = group_ids(index, total.shape[0], total.device)
    norm = _norm_by_std(config, norm_adv_by_std_in_grpo)
    summed = torch.zeros_like(total, dtype=torch.float64)
    for i, comp in enumerate(components):
        mean, std, _ = group_stats(comp, gid)
        centred = comp.double() - mean
        # float32 like verl's GRPO per component: its whitening sees the same rounding
        part = (centred / (std + epsilon) if norm else centred).to(token_level_rewards.dtype)
        summed = summed + (weights[i] if weights is not None else 1.0) * part.double()
    tiled, _ = _tile(summed, response_mask, token_level_rewards.dtype)
    adv = masked_whiten(tiled, response_mask.to(token_level_rewards.dtype))
    return adv, adv


def _reward_to_go(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return masked_select_zero(rewards * mask, mask).flip(-1).cumsum(-1).flip(-1)


def _path_variance(old_log_probs: torch.Tensor | None, sum_pi_squared: torch.Tensor | None, mask: torch.Tensor,
                   rollout_is_weights: torch.Tensor | None) -> torch.Tensor:
    """``W_t = sum_{j<=t} (1 - 2 pi_j + sum pi^2) [* rho_j^2]`` over the response tokens (float64)."""
    assert old_log_probs is not None and sum_pi_squared is not None, "checked by _otb_inputs"
    w = 1 - 2 * old_log_probs.double().exp() + sum_pi_squared.double()
    if rollout_is_weights is not None:
        w = w * rollout_is_weights.double() ** 2
    return masked_select_zero(w, mask).cumsum(-1)


def _zero_tail(baselines: torch.Tensor, lengths: torch.Tensor, gid: torch.Tensor, members: torch.Tensor) -> None:
    """Zero the baseline of a group's single longest trajectory beyond the second-longest length (in place).

    ``members`` marks the samples that belong to a group of at least two.
    """
    n_groups = int(gid.max()) + 1
    lengths = lengths.long()
    longest = torch.full((n_groups,), -1, dtype=torch.long, device=lengths.device)
    longest = longest.scatter_reduce(0, gid[members], lengths[members], "amax")
    is_longest = members & (lengths == longest[gid])
    n_longest = torch.zeros(n_groups, dtype=torch.long, device=lengths.device).index_add_(
        0, gid, is_longest.long())
    others = torch.where(members & ~is_longest, lengths, torch.full_like(lengths, -1))
    second = torch.full((n_groups,), -1, dtype=torch.long, device=lengths.device).scatter_reduce(
        0, gid, others, "amax")
    rows = is_longest & (n_longest[gid] == 1) & (second[gid] >= 0)
    cut = torch.arange(baselines.shape[1], device=baselines.device)[None, :] >= second[gid][:, None]
    baselines.masked_fill_(rows[:, None] & cut, 0.0)


def _group_baseline(returns: torch.Tensor, weights: torch.Tensor, gid: torch.Tensor, members: torch.Tensor,
                    epsilon: float) -> torch.Tensor:
    """Per group and time step ``sum_i G_i W_i / (sum_i W_i + eps)``; 0 for samples outside ``members``."""
    n_groups = int(gid.max()) + 1
    num = torch.zeros(n_groups, returns.shape[1], dtype=torch.float64, device=returns.device)
    num.index_add_(0, gid, returns * weights)
    den = torch.zeros_like(num).index_add_(0, gid, weights)
    baseline = (num / (den + epsilon))[gid]
    return torch.where(members[:, None], baseline, torch.zeros_like(baseline))


def _otb_inputs(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, old_log_probs: torch.Tensor | None,
                sum_pi_squared: torch.Tensor | None, rollout_is_weights: torch.Tensor | None, name: str,
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rewards (padding cleaned), ``old_log_probs`` and ``sum_pi_squared`` of an OTB estimator, checked."""
    if old_log_probs is None or sum_pi_squared is None:
        raise ValueError(f"{name} needs old_log_probs=[B, R] and sum_pi_squared=[B, R] (sum over the vocabulary of "
                         "pi^2 at each token, from the engine's forward pass: "
                         "polyrl.algorithms.torch_functional.calculate_sum_pi_squared_from_logits)")
    rewards, _ = _check(token_level_rewards, response_mask, old_log_probs=old_log_probs,
                        sum_pi_squared=sum_pi_squared, rollout_is_weights=rollout_is_weights)
    return rewards, old_log_probs, sum_pi_squared


@torch.no_grad()
def compute_optimal_token_baseline_advantage(token_level_rewards: torch.Tensor, response_mask: torch.Tensor,
                                             index: Any = None, old_log_probs: torch.Tensor | None = None,
                                             sum_pi_squared: torch.Tensor | None = None,
                                             rollout_is_weights: torch.Tensor | None = None,
                                             handle_zero_tail: bool = True, epsilon: float = 1e-8,
                                             config: Any = None, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Optimal Token Baseline: a baseline per prompt group and time step, ``B_t = sum G_t W_t / sum W_t``.

    ``G_t`` is the reward-to-go, ``W_t`` the cumulative path-variance proxy
    ``sum_{j<=t} 1 - 2 pi_j + sum_v pi_v^2`` (times ``rollout_is_weights^2`` when
    given). Singleton groups get no baseline. ``handle_zero_tail``: the part of a
    group's single longest response beyond the second-longest gets no baseline.
    Returns ``((G - B) * mask, G)``.
    """
    rewards, old_log_probs, sum_pi_squared = _otb_inputs(
        token_level_rewards, response_mask, old_log_probs, sum_pi_squared, rollout_is_weights, "optimal_token_baseline")
    valid = response_mask != 0
    mask = valid.double()
    returns = _reward_to_go(rewards.double(), mask)
    weights = masked_select_zero(_path_variance(old_log_probs, sum_pi_squared, mask, rollout_is_weights), mask)
    gid = group_ids(index, rewards.shape[0], rewards.device)
    members = torch.bincount(gid)[gid] > 1
    baselines = _group_baseline(returns, weights, gid, members, epsilon)
    if handle_zero_tail:
        _zero_tail(baselines, mask.sum(-1), gid, members)
    adv = masked_select_zero(returns - baselines, mask)
    dtype = token_level_rewards.dtype
    return adv.to(dtype), returns.to(dtype)


@torch.no_grad()
def compute_multi_turn_optimal_token_baseline_advantage(
        token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Any = None,
        old_log_probs: torch.Tensor | None = None, sum_pi_squared: torch.Tensor | None = None,
        rollout_is_weights: torch.Tensor | None = None, handle_zero_tail: bool = True, epsilon: float = 1e-8,
        config: Any = None, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``tir_optimal_token_baseline``: the Optimal Token Baseline over the *model's* tokens only.

    For tool-integrated (multi-turn) responses: each response's tokens with
    ``response_mask`` 1 are packed to the left before the baseline is taken per
    step, so the i-th model token of one response is compared with the i-th of
    the others, whatever tool output came between. Empty responses are left out
    of their group. Returns ``(advantages, reward-to-go)``.
    """
    rewards, old_log_probs, sum_pi_squared = _otb_inputs(
        token_level_rewards, response_mask, old_log_probs, sum_pi_squared, rollout_is_weights,
        "tir_optimal_token_baseline")
    valid = response_mask != 0
    mask = valid.double()
    returns = _reward_to_go(rewards.double(), mask)
    w_cum = _path_variance(old_log_probs, sum_pi_squared, mask, rollout_is_weights)
    lengths = valid.sum(-1)
    rows, cols = valid.nonzero(as_tuple=True)
    ranks = (valid.long().cumsum(-1) - 1)[rows, cols]
    width = max(int(lengths.max()), 1)
    packed_w = torch.zeros(rewards.shape[0], width, dtype=torch.float64, device=rewards.device)
    packed_g = torch.zeros_like(packed_w)
    packed_w[rows, ranks] = w_cum[rows, cols]
    packed_g[rows, ranks] = returns[rows, cols]
    gid = group_ids(index, rewards.shape[0], rewards.device)
    nonempty = lengths > 0
    members = nonempty & (torch.bincount(gid, weights=nonempty.double()).round().long()[gid] > 1)
    baselines = _group_baseline(packed_g, packed_w, gid, members, epsilon)
    if handle_zero_tail:
        _zero_tail(baselines, lengths, gid, members)
    adv = torch.zeros_like(returns)
    adv[rows, cols] = (packed_g - baselines)[rows, ranks]
    dtype = token_level_rewards.dtype
    return adv.to(dtype), returns.to(dtype)


_GIGPO_FIELDS = ("step_rewards", "anchor_key", "episode_id", "step_index")


def _episode_step_returns(step_rewards: torch.Tensor, episode: torch.Tensor, step_index: torch.Tensor,
                          gamma: float) -> torch.Tensor:
    """Each row's discounted return ``R_t = r_t + gamma R_{t+1}`` over the steps of its episode (rows of one
    episode: the same ``episode`` id, ordered by ``step_index``; a step missing from the batch counts as reward 0).
    Rows that share an episode and a step (padding copies) add their rewards."""
    eid = group_ids(episode, episode.shape[0], step_rewards.device)
    steps = step_index.to(device=step_rewards.device, dtype=torch.long)
    if bool((steps < 0).any()):
        raise ValueError("gigpo: step_index must be >= 0 (the step's position in its episode)")
    table = torch.zeros(int(eid.max()) + 1, int(steps.max()) + 1, dtype=torch.float64, device=step_rewards.device)
    table.index_put_((eid, steps), step_rewards.double(), accumulate=True)
    running = torch.zeros(table.shape[0], dtype=torch.float64, device=table.device)
    for t in reversed(range(table.shape[1])):  # over steps only; vectorised over the episodes
        running = table[:, t] + gamma * running
        table[:, t] = running
    return table[eid, steps]


def _episode_group_stats(scores: torch.Tensor, gid: torch.Tensor,
                         episode: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row group mean and std with one score per *episode* (its first row's): the paper's Eq. 3."""
    size = scores.shape[0]
    eid = group_ids(episode, size, scores.device)
    rows = torch.arange(size, device=scores.device)
    first = torch.full((int(eid.max()) + 1,), size, dtype=torch.long, device=scores.device)
    first = first.scatter_reduce(0, eid, rows, reduce="amin")
    ep_gid = gid[first]
    dense = torch.unique(ep_gid, return_inverse=True)[1]
    mean_e, std_e, _ = group_stats(scores[first], dense)
    n_groups = int(gid.max()) + 1
    mean_g = torch.zeros(n_groups, dtype=torch.float64, device=scores.device).scatter(0, ep_gid, mean_e)
    std_g = torch.ones(n_groups, dtype=torch.float64, device=scores.device).scatter(0, ep_gid, std_e)
    return mean_g[gid], std_g[gid]


@torch.no_grad()
def compute_gigpo_outcome_advantage(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Any = None,
                                    config: Any = None, step_rewards: torch.Tensor | None = None,
                                    anchor_key: torch.Tensor | None = None, episode_id: torch.Tensor | None = None,
                                    step_index: torch.Tensor | None = None, epsilon: float = EPS,
                                    step_advantage_w: float = 1.0, mode: str = "mean_norm",
                                    episode_stats: str = "steps", gamma: float | None = None,
                                    **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """GiGPO (Feng et al., NeurIPS 2025; verl-agent): ``A = A_episode + step_advantage_w * A_step`` per step row.

    Every row is one environment step (the ``stepwise`` agent loop). ``A_episode``: the row's score (the sum of its
    ``token_level_rewards``: the episode's return, which each of its rows carries) centred on its episode group
    (``index``: the trajectories from one initial state), over every step row of the group (``episode_stats=
    "steps"``, verl-agent's default) or over one score per episode (``"trajectories"``, the paper's Eq. 3).
    ``A_step``: the row's discounted return ``R_t = sum_k gamma^k r_{t+k}`` (from ``step_rewards`` along
    ``episode_id`` / ``step_index``; ``gamma`` defaults to ``config.gamma``) centred on its step group: the rows of
    the same episode group whose state before the action had the same ``anchor_key``. ``mode``: ``mean_norm``
    (centring only, verl-agent's default) or ``mean_std_norm`` (also divided by the group's unbiased std +
    ``epsilon``). An episode group of one row gets mean 0 and std 1 (as GRPO); a step group of one row gets
    ``A_step = 0``. ``step_advantage_w``, ``mode``, ``episode_stats`` come from ``algorithm.extra``.
    """
    missing = [name for name, value in zip(_GIGPO_FIELDS, (step_rewards, anchor_key, episode_id, step_index))
               if value is None]
    if missing:
        raise ValueError(f"gigpo needs the batch fields {missing}: the step rows of an environment agent loop "
                         "(agent_name: stepwise, docs/environments.md)")
    if mode not in ("mean_norm", "mean_std_norm"):
        raise ValueError(f"gigpo: algorithm.extra.mode={mode!r}: choose 'mean_norm' or 'mean_std_norm'")
    if episode_stats not in ("steps", "trajectories"):
        raise ValueError(f"gigpo: algorithm.extra.episode_stats={episode_stats!r}: choose 'steps' or 'trajectories'")
    assert step_rewards is not None and anchor_key is not None and episode_id is not None and step_index is not None
    scores = _check(token_level_rewards, response_mask)[1]
    size = scores.shape[0]
    for name, value in (("step_rewards", step_rewards), ("anchor_key", anchor_key), ("episode_id", episode_id),
                        ("step_index", step_index)):
        if value.shape != (size,):
            raise ValueError(f"gigpo: {name} must be [batch] ({size},), got {tuple(value.shape)}")
    if not bool(torch.isfinite(step_rewards).all()):
        raise ValueError("gigpo: step_rewards holds NaN/inf")
    std_norm = mode == "mean_std_norm"
    gid = group_ids(index, size, scores.device)

    if episode_stats == "steps":
        mean, std, _ = group_stats(scores, gid)
    else:
        mean, std = _episode_group_stats(scores, gid, episode_id)
    episode_adv = scores.double() - mean
    if std_norm:
        episode_adv = episode_adv / (std + epsilon)

    discount = float(gamma if gamma is not None else cfg_get(config, "gamma", 1.0))
    returns = _episode_step_returns(step_rewards, episode_id, step_index, discount)
    pairs = torch.stack([gid, anchor_key.to(device=scores.device, dtype=torch.long)], dim=1)
    step_gid = torch.unique(pairs, dim=0, return_inverse=True)[1]
    s_mean, s_std, s_count = group_stats(returns, step_gid)
    step_adv = torch.where(s_count > 1, returns - s_mean, torch.zeros_like(returns))
    if std_norm:
        step_adv = step_adv / (s_std + epsilon)
    return _tile(episode_adv + float(step_advantage_w) * step_adv, response_mask, token_level_rewards.dtype)


#: name -> function; registered by polyrl.algorithms.hooks
BUILTIN_ESTIMATORS = {
    "gae": compute_gae_advantage_return,
    "grpo": compute_grpo_outcome_advantage,
    "grpo_vectorized": compute_grpo_vectorized_outcome_advantage,
    "grpo_passk": compute_grpo_passk_outcome_advantage,
    "gdpo": compute_gdpo_outcome_advantage,
    "gigpo": compute_gigpo_outcome_advantage,
    "rloo": compute_rloo_outcome_advantage,
    "rloo_vectorized": compute_rloo_vectorized_outcome_advantage,
    "reinforce_plus_plus": compute_reinforce_plus_plus_outcome_advantage,
    "reinforce_plus_plus_baseline": compute_reinforce_plus_plus_baseline_outcome_advantage,
    "remax": compute_remax_outcome_advantage,
    "opo": compute_opo_outcome_advantage,
    "gpg": compute_gpg_outcome_advantage,
    "optimal_token_baseline": compute_optimal_token_baseline_advantage,
    "tir_optimal_token_baseline": compute_multi_turn_optimal_token_baseline_advantage,
}


#: batch fields the trainer hands an estimator whose signature names them (verl's keyword names); any other
#: tensor field a signature names is passed the same way (a plugin's ``prm_scores``)
BATCH_INPUTS = ("old_log_probs", "sum_pi_squared", "rollout_is_weights", "reward_baselines")

#: arguments the trainer passes itself, never taken from the batch
_TRAINER_ARGUMENTS = frozenset({"token_level_rewards", "response_mask", "index", "config", "values"})


def estimator_batch_kwargs(estimator: Any, batch: Any, reward_component_keys: Any = ()) -> dict[str, Any]:
    """The keyword arguments the trainer adds for ``estimator`` from ``batch`` (a TensorDict or mapping).

    Every tensor field of the batch the estimator's signature names as a parameter (:data:`BATCH_INPUTS` and
    any other, e.g. a field a trainer's ``before_advantage`` added), and ``reward_components`` (GDPO) from the
    batch fields ``_<key>`` of ``reward_component_keys``. An estimator taking ``**kwargs`` gets only the fields
    it names explicitly.
    """
    import inspect

    try:
        params = inspect.signature(estimator).parameters
    except (TypeError, ValueError):
        return {}
    names = {n for n, p in params.items() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    keys = set(batch.keys())
    out: dict[str, Any] = {name: batch[name] for name in sorted(names - _TRAINER_ARGUMENTS)
                           if name in keys and isinstance(batch[name], torch.Tensor)}
    components = list(reward_component_keys or ())
    if "reward_components" in names and components:
        missing = [k for k in components if f"_{k}" not in keys]
        if missing:
            raise ValueError(f"algorithm.gdpo_reward_keys {missing} are not among the reward function's outputs; "
                             "the reward function must return a dict holding each key")
        out["reward_components"] = {k: batch[f"_{k}"] for k in components}
    return out
