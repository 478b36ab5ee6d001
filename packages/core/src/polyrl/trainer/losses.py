"""The loss functions the workers hand to ``Engine.train_batch``.

Each is a :class:`polyrl.protocols.LossFn`: it gets the forward pass's outputs
for a micro-batch and the mini-batch's global :class:`~polyrl.protocols.LossScale`,
and returns the micro-batch's share of the loss plus metrics.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from tensordict import TensorDict

from polyrl.protocols import LossScale


def make_actor_loss(cfg: Any, *, on_policy: bool = False):
    """PPO-family policy loss + optional entropy bonus + optional KL-to-reference loss.

    ``on_policy``: the batch carries no ``old_log_probs`` because this update is the first and only
    pass over it; the current log-probs, detached, are the old ones (ratio 1, the same gradient).
    """
    from polyrl.algorithms import agg_loss, get_policy_loss_fn, kl_penalty, masked_mean
    from polyrl.algorithms.policy_losses import policy_option

    policy_loss_fn = get_policy_loss_fn(cfg.policy_loss.loss_mode)
    use_tis = bool(policy_option(cfg, "tis_imp_ratio_cap", 0))

    def actor_loss(out: Mapping[str, torch.Tensor], mb: TensorDict, scale: LossScale):
        mask = mb["response_mask"]
        log_prob = out["log_probs"]
        old_log_prob = log_prob.detach() if on_policy else mb["old_log_probs"]
        pg_loss, pg_metrics = policy_loss_fn(
            old_log_prob=old_log_prob,
            log_prob=log_prob,
            advantages=mb["advantages"],
            response_mask=mask,
            loss_agg_mode=cfg.loss_agg_mode,
            config=cfg,
            rollout_log_probs=mb["rollout_log_probs"] if use_tis and "rollout_log_probs" in mb.keys() else None,
            loss_scale=scale,
        )
        loss = pg_loss
        metrics = {f"actor/{k}": _float(v) for k, v in pg_metrics.items()}
        metrics["actor/pg_loss"] = _float(pg_loss)
        if on_policy and "rollout_log_probs" in mb.keys():  # the trainer-vs-rollout mismatch, as when recomputed
            metrics["rollout/logprob_diff_mean"] = _float(masked_mean((mb["rollout_log_probs"] - old_log_prob).abs(), mask))
        if "entropy" in out:
            entropy = agg_loss(out["entropy"], mask, cfg.loss_agg_mode, loss_scale=scale)
            metrics["actor/entropy"] = _float(entropy)
            if cfg.entropy_coeff:
                loss = loss - cfg.entropy_coeff * entropy
        if cfg.use_kl_loss:
            kld = kl_penalty(log_prob, mb["ref_log_prob"], cfg.kl_loss_type)
            kl_loss = agg_loss(kld, mask, cfg.loss_agg_mode, loss_scale=scale)
            loss = loss + cfg.kl_loss_coef * kl_loss
            metrics["actor/kl_loss"] = _float(kl_loss)
        return loss, metrics

    return actor_loss


def make_critic_loss(cfg: Any):
    """Clipped value loss (verl's ``compute_value_loss``)."""
    from polyrl.algorithms import compute_value_loss

    def critic_loss(out: Mapping[str, torch.Tensor], mb: TensorDict, scale: LossScale):
        loss, metrics = compute_value_loss(
            out["values"], mb["returns"], mb["values"], mb["response_mask"], cfg.cliprange_value,
            cfg.loss_agg_mode, loss_scale=scale,
        )
        return loss, {**{k: _float(v) for k, v in metrics.items()}, "critic/vf_loss": _float(loss)}

    return critic_loss


def sft_loss(out: Mapping[str, torch.Tensor], mb: TensorDict, scale: LossScale):
    """Negative log-likelihood of the response tokens, token-mean over the global mini-batch."""
    from polyrl.algorithms import agg_loss

    nll = agg_loss(-out["log_probs"], mb["response_mask"], "token-mean", loss_scale=scale)
    return nll, {"sft/loss": _float(nll)}


def _float(value: Any) -> float:
    if isinstance(value, torch.Tensor):
        return float(value.detach().float().mean())
    return float(value)
