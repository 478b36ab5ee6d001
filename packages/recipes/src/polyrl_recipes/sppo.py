"""SPPO (Wu et al., "Self-Play Preference Optimization for Language Model Alignment", arXiv 2405.00675).

Each iteration samples from the current policy ``pi_t`` and regresses the log-ratio of every response onto its
estimated win rate against ``pi_t``::

    loss(y) = ( log pi(y|x) / pi_t(y|x)  -  eta * (P(y > pi_t | x) - 1/2) )^2

``P(y > pi_t | x)`` is estimated from the prompt's own samples (``rollout.n`` of them): the mean over the
other samples ``y'`` of the preference ``P(y > y')``, which comes from the rewards (``win_rate: pairwise``;
with ``preference_temperature`` 0 a comparison: win 1, tie 1/2, loss 0; above 0 Bradley-Terry). verl's recipe
instead uses ``reward - softmean_eta(rewards over the batch)`` (``win_rate: softmean``), kept as an option and
tested against verl's numbers. The estimator returns the target ``eta (P - 1/2)`` on every response token; the
``sppo`` loss squares the gap to the summed token log-ratio (docs/recipes.md, "SPPO").
"""

from __future__ import annotations

from typing import Any

import torch

from polyrl.algorithms import agg_loss, masked_mean
from polyrl.algorithms.advantages import clean_padding, group_ids
from polyrl.algorithms.checks import cfg_get, check_finite, check_nonempty_mask, check_same_shape
from polyrl.algorithms.torch_functional import masked_select_zero
from polyrl.errors import ConfigError
from polyrl.protocols import LossScale
from polyrl_recipes.base import RecipeTrainer
from polyrl_recipes.config import SPPOConfig

__all__ = ["SPPOTrainer", "compute_policy_loss_sppo", "compute_sppo_advantage", "pairwise_win_rates", "softmean"]

WIN_RATES = ("pairwise", "softmean")


def softmean(x: torch.Tensor, beta: float, dim: int = -1, keepdim: bool = False) -> torch.Tensor:
    """``SoftMean_beta(x) = log(mean(exp(beta x))) / beta`` (the arithmetic mean when ``beta`` is 0)."""
    if beta == 0.0:
        return x.mean(dim=dim, keepdim=keepdim)
    n = torch.tensor(float(x.shape[dim]), dtype=x.dtype, device=x.device)
    return (torch.logsumexp(beta * x, dim=dim, keepdim=keepdim) - n.log()) / beta


def pairwise_win_rates(scores: torch.Tensor, gid: torch.Tensor, temperature: float = 0.0,
                       chunk: int = 1024) -> torch.Tensor:
    """Each sample's mean preference over the other samples of its group, ``[B]`` (float64).

    ``P(i > j)`` is ``1`` / ``1/2`` / ``0`` as ``scores[i]`` is above / equal to / below ``scores[j]``
    (``temperature`` 0), or ``sigmoid((scores[i] - scores[j]) / temperature)``. A sample alone in its group has
    no opponent: its win rate is ``1/2``. Rows are compared in chunks of ``chunk`` (memory ``chunk x B``).
    """
    s = scores.double()
    n = s.shape[0]
    counts = torch.bincount(gid, minlength=int(gid.max()) + 1)[gid].double() if n else s
    out = torch.empty_like(s)
    for start in range(0, n, chunk):
        rows = slice(start, min(start + chunk, n))
        diff = s[rows, None] - s[None, :]
        pref = torch.sigmoid(diff / temperature) if temperature > 0 else (diff > 0).double() + 0.5 * (diff == 0).double()
        same = gid[rows, None] == gid[None, :]
        # drop the sample's own comparison (1/2 under either rule)
        wins = torch.where(same, pref, torch.zeros_like(pref)).sum(-1) - 0.5
        out[rows] = wins
    return torch.where(counts > 1, out / (counts - 1).clamp(min=1), torch.full_like(out, 0.5))


@torch.no_grad()
def compute_sppo_advantage(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Any = None,
                           config: Any = None, eta: float | None = None, win_rate: str | None = None,
                           preference_temperature: float | None = None,
                           **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """SPPO's regression target on every response token, as ``(target, target)``.

    ``win_rate="pairwise"`` (default): ``eta * (P_i - 1/2)`` with ``P_i`` the sample's win rate within its
    prompt group (:func:`pairwise_win_rates`; needs ``index``). ``"softmean"`` (verl's recipe): ``eta * (r_i -
    SoftMean_eta(r))`` over the whole batch. ``r_i`` is the sequence reward (sum of ``token_level_rewards``).
    Options come as keywords or from ``config`` / its ``extra`` (``trainer.sppo`` puts them there).
    """
    check_same_shape(token_level_rewards=token_level_rewards, response_mask=response_mask)
    check_finite("token_level_rewards", token_level_rewards, response_mask)
    check_nonempty_mask("response_mask", response_mask)
    extra = cfg_get(config, "extra", None)

    def option(name: str, given: Any, default: Any) -> Any:
        return given if given is not None else cfg_get(config, name, cfg_get(extra, name, default))

    eta = float(option("sppo_eta", eta, option("eta", None, 1.0)))
    mode = str(option("win_rate", win_rate, "pairwise"))
    temperature = float(option("preference_temperature", preference_temperature, 0.0))
    scores = clean_padding(token_level_rewards, response_mask).sum(-1).double()
    if mode == "pairwise":
        gid = group_ids(index, scores.shape[0], scores.device)
        target = eta * (pairwise_win_rates(scores, gid, temperature) - 0.5)
    elif mode == "softmean":
        target = eta * (scores - softmean(scores, eta, dim=-1, keepdim=True))
    else:
        raise ValueError(f"sppo: win_rate={mode!r}; choose one of {', '.join(WIN_RATES)}")
    mask = response_mask.to(token_level_rewards.dtype)
    tiled = masked_select_zero(target.to(token_level_rewards.dtype).unsqueeze(-1) * mask, mask)
    return tiled, tiled


def _per_sequence(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The mean of ``values`` over each row's masked tokens (a value tiled on every token comes back as is)."""
    return masked_select_zero(values, mask).sum(-1) / mask.sum(-1).clamp(min=1)


def compute_policy_loss_sppo(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                             response_mask: torch.Tensor, loss_agg_mode: str = "seq-mean-token-sum",
                             config: Any = None, rollout_log_probs: torch.Tensor | None = None, *,
                             loss_scale: LossScale | None = None, rollout_is_weights: torch.Tensor | None = None,
                             ) -> tuple[torch.Tensor, dict[str, float]]:
    """SPPO's squared loss ``(sum_t log pi(y_t)/pi_t(y_t) - target)^2`` per sequence, averaged over sequences.

    ``advantages`` hold the target on every token (:func:`compute_sppo_advantage`); ``old_log_prob`` are
    ``pi_t``'s (the policy that sampled). The loss is per sequence whatever ``loss_agg_mode`` says (verl's
    recipe: the mean over samples), normalised by the mini-batch's global sequence count (``loss_scale``);
    ``rollout_is_weights`` weight each sequence by their mean over its tokens.
    """
    check_same_shape(old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages, response_mask=response_mask,
                     rollout_is_weights=rollout_is_weights)
    info = cfg_get(config, "global_batch_info", None)
    if loss_scale is None and info and cfg_get(info, "global_batch_size", None) is not None:  # verl's spelling
        loss_scale = LossScale(dp_size=int(cfg_get(info, "dp_size", 1) or 1),
                               batch_num_tokens=cfg_get(info, "batch_num_tokens", None),
                               global_batch_size=int(cfg_get(info, "global_batch_size")))
    if loss_scale is None:  # alone, an all-padding micro-batch has nothing to train on
        check_nonempty_mask("response_mask", response_mask)
    check_finite("advantages", advantages, response_mask)
    check_finite("old_log_prob", old_log_prob, response_mask)
    mask = response_mask.to(log_prob.dtype)
    valid = mask != 0
    log_ratio = masked_select_zero(log_prob - old_log_prob, valid).sum(-1)
    target = _per_sequence(advantages.to(log_prob.dtype), mask)
    per_seq = (log_ratio - target) ** 2
    if rollout_is_weights is not None:
        per_seq = per_seq * _per_sequence(rollout_is_weights.detach().to(log_prob.dtype), mask)
    # the sequence's loss on its first token, so agg_loss's sequence mode normalises by the global counts
    first = valid & (valid.long().cumsum(-1) == 1)
    loss_mat = torch.where(first, per_seq.unsqueeze(-1).expand_as(log_prob), torch.zeros_like(log_prob))
    loss = agg_loss(loss_mat, mask, "seq-mean-token-sum", loss_scale=loss_scale)
    rows = valid.any(-1)
    metrics = {
        "sppo/log_ratio_mean": float(log_ratio.detach()[rows].mean()) if rows.any() else 0.0,
        "sppo/target_mean": float(target.detach()[rows].mean()) if rows.any() else 0.0,
        "ppo_kl": float(masked_mean((old_log_prob - log_prob).detach(), mask)),
    }
    return loss, metrics


class SPPOTrainer(RecipeTrainer):
    """``trainer.name=sppo``: the ``sppo`` estimator (win-rate targets) and the ``sppo`` loss (``trainer.sppo``,
    :class:`SPPOConfig`). Several PPO epochs or mini-batches per step make the log-ratio move away from 0; with a
    single on-policy pass the loss's gradient is a policy gradient with advantage ``2 eta (P - 1/2)``."""

    recipe = "sppo"
    adv_estimator = "sppo"
    loss_mode = "sppo"
    options_cls = SPPOConfig

    def configure(self, config: Any) -> None:
        super().configure(config)
        o = self.options
        if o.win_rate not in WIN_RATES:
            raise ConfigError(f"trainer.sppo.win_rate={o.win_rate!r}: choose one of {', '.join(WIN_RATES)}")
        if o.preference_temperature < 0:
            raise ConfigError(f"trainer.sppo.preference_temperature={o.preference_temperature}: must be 0 or more")
        if o.win_rate == "pairwise" and config.rollout.n < 2:
            raise ConfigError(f"rollout.n={config.rollout.n}: SPPO's pairwise win rates compare the samples of a "
                              "prompt; set rollout.n to 2 or more (or trainer.sppo.win_rate=softmean)")
        config.algorithm.extra = {**dict(config.algorithm.extra), "eta": o.eta, "win_rate": o.win_rate,
                                  "preference_temperature": o.preference_temperature}
