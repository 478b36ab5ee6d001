"""The loss functions the workers hand to ``Engine.train_batch``.

Each is a :class:`polyrl.protocols.LossFn`: it gets the forward pass's outputs
for a micro-batch and the mini-batch's global :class:`~polyrl.protocols.LossScale`,
and returns the micro-batch's share of the loss plus metrics (the micro-batch's own
values, which the engines average: :func:`loss_metric`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch
from tensordict import TensorDict

from polyrl.protocols import LossScale


class VerlActorConfigView:
    """The actor config as verl's losses read it: attributes, ``.get(key, default)`` and ``global_batch_info``.

    polyrl's configs are dataclasses; a loss copied from verl calls ``config.get("clip_ratio_c", 3.0)``
    and spreads ``**config.global_batch_info`` (``dp_size``, ``batch_num_tokens``,
    ``global_batch_size``, ``loss_scale_factor``) into ``agg_loss``. Nested blocks are viewed the same way.
    """

    def __init__(self, config: Any, global_batch_info: dict[str, Any] | None = None) -> None:
        self._config = config
        self.global_batch_info = dict(global_batch_info or {})

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        value = self._config.get(name) if isinstance(self._config, Mapping) else getattr(self._config, name)
        return VerlActorConfigView(value) if _is_block(value) else value

    def get(self, key: str, default: Any = None) -> Any:
        """``config.<key>`` or ``default`` when missing or None (verl's ``BaseConfig.get``)."""
        try:
            value = getattr(self, key)
        except (AttributeError, KeyError):
            return default
        return default if value is None else value

    def __contains__(self, key: str) -> bool:
        return self.get(key) is not None

    def __repr__(self) -> str:
        return f"VerlActorConfigView({self._config!r})"


def _is_block(value: Any) -> bool:
    return dataclasses.is_dataclass(value) and not isinstance(value, type)


def make_actor_loss(cfg: Any, *, on_policy: bool = False) -> Callable[..., tuple[torch.Tensor, dict[str, float]]]:
    """PPO-family policy loss + optional entropy bonus + optional KL-to-reference loss.

    ``on_policy``: the batch carries no ``old_log_probs`` because this update is the first and only
    pass over it; the current log-probs, detached, are the old ones (ratio 1, the same gradient).

    The policy loss gets every argument :class:`polyrl.protocols.PolicyLoss` declares:
    verl's six, ``rollout_log_probs`` (the legacy ``tis_imp_ratio_cap``), ``loss_scale`` and
    ``rollout_is_weights`` (rollout correction); a loss written for verl, declaring fewer, was
    adapted once at look-up (:func:`polyrl.algorithms.as_policy_loss`) and runs unchanged: its
    ``config`` is a :class:`VerlActorConfigView` whose ``global_batch_info`` carries the
    mini-batch's global counts.
    """
    from polyrl.algorithms import agg_loss, get_policy_loss_fn, kl_penalty, masked_mean
    from polyrl.algorithms.policy_losses import policy_option
    from polyrl.algorithms.rollout_correction import compute_rollout_correction_weights
    from polyrl.algorithms.torch_functional import masked_select_zero

    policy_loss_fn = get_policy_loss_fn(cfg.policy_loss.loss_mode)  # takes every PolicyLoss keyword
    use_tis = bool(policy_option(cfg, "tis_imp_ratio_cap", 0))
    correction = dict(policy_option(cfg, "rollout_correction", None) or {})
    # on-policy (no old-log-prob pass): importance weights per token or per sequence need only this micro-batch
    weights_in_loss = on_policy and bool(correction.get("rollout_is")) and not correction.get("bypass_mode")

    def actor_loss(out: Mapping[str, torch.Tensor], mb: TensorDict,
                   scale: LossScale) -> tuple[torch.Tensor, dict[str, float]]:
        mask = mb["response_mask"]
        log_prob = out["log_probs"]
        old_log_prob = log_prob.detach() if on_policy else mb["old_log_probs"]
        keys = mb.keys()
        metrics: dict[str, float] = {}
        weights = mb["rollout_is_weights"] if "rollout_is_weights" in keys else None
        if weights is None and weights_in_loss and "rollout_log_probs" in keys:
            weights, is_metrics = compute_rollout_correction_weights(
                log_prob.detach() - mb["rollout_log_probs"], mask, correction["rollout_is"],
                correction.get("rollout_is_threshold", 2.0))
            metrics.update({f"rollout_corr/{k}": v for k, v in is_metrics.items()})
        # the legacy TIS cap reads the rollout's log-probs; rollout-correction weights win over it
        rollout_log_probs = mb["rollout_log_probs"] if weights is None and use_tis and "rollout_log_probs" in keys \
            else None
        info = {"dp_size": scale.dp_size, "batch_num_tokens": scale.batch_num_tokens,
                "global_batch_size": scale.global_batch_size,
                "loss_scale_factor": policy_option(cfg, "loss_scale_factor", None)}
        pg_loss, pg_metrics = policy_loss_fn(
            old_log_prob, log_prob, mb["advantages"], mask, cfg.loss_agg_mode, VerlActorConfigView(cfg, info),
            rollout_log_probs=rollout_log_probs, loss_scale=scale, rollout_is_weights=weights,
        )
        loss = pg_loss
        # verl's losses name their metrics "actor/..." already; polyrl's are bare
        metrics.update({(k if "/" in k else f"actor/{k}"): _float(v) for k, v in pg_metrics.items()})
        part = share_fraction(mask, cfg.loss_agg_mode, scale)  # loss terms as this micro-batch's own values
        metrics["actor/pg_loss"] = _float(pg_loss) / part
        if on_policy and "rollout_log_probs" in keys:  # the trainer-vs-rollout mismatch, as when recomputed
            metrics["rollout/logprob_diff_mean"] = _float(masked_mean((mb["rollout_log_probs"] - old_log_prob).abs(), mask))
        if "entropy" in out:
            entropy = agg_loss(out["entropy"], mask, cfg.loss_agg_mode, loss_scale=scale)
            metrics["actor/entropy"] = _float(entropy) / part
            if cfg.entropy_coeff:
                loss = loss - cfg.entropy_coeff * entropy
        if cfg.use_kl_loss:
            # select response tokens first: a NaN in padding would otherwise reach the gradient through the KL
            valid = mask != 0
            kld = kl_penalty(masked_select_zero(log_prob, valid), masked_select_zero(mb["ref_log_prob"], valid),
                             cfg.kl_loss_type)
            kl_loss = agg_loss(kld, mask, cfg.loss_agg_mode, loss_scale=scale)
            loss = loss + cfg.kl_loss_coef * kl_loss
            metrics["actor/kl_loss"] = _float(kl_loss) / part
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
        return loss, {**{k: _float(v) for k, v in metrics.items()},
                      "critic/vf_loss": loss_metric(loss, mb["response_mask"], cfg.loss_agg_mode, scale)}

    return critic_loss


def sft_loss(out: Mapping[str, torch.Tensor], mb: TensorDict, scale: LossScale):
    """Negative log-likelihood of the response tokens, token-mean over the global mini-batch."""
    from polyrl.algorithms import agg_loss

    nll = agg_loss(-out["log_probs"], mb["response_mask"], "token-mean", loss_scale=scale)
    return nll, {"sft/loss": loss_metric(nll, mb["response_mask"], "token-mean", scale)}


def loss_metric(share: torch.Tensor, mask: torch.Tensor, loss_agg_mode: str, scale: LossScale | None) -> float:
    """A loss term as a metric: the micro-batch's own aggregate of it, ``share`` divided by
    :func:`share_fraction`.

    The loss itself is the micro-batch's share of the mini-batch's (normalised by the global counts of
    ``scale``), so that the gradients of the micro-batches add up; the engines average their micro-batches'
    metrics, under which a share would read ``1 / n`` of the value with ``n`` micro-batches (the entropy of a
    run with ``micro_batch_size`` half the mini-batch read half of itself)."""
    return _float(share) / share_fraction(mask, loss_agg_mode, scale)


def share_fraction(mask: torch.Tensor, loss_agg_mode: str, scale: LossScale | None) -> float:
    """The fraction of the mini-batch's loss that a micro-batch's ``loss_agg_mode`` aggregate under ``scale``
    is: the share of an all-ones term, exact for every linear aggregation. 1 without ``scale`` or where the
    micro-batch has no response token (a padding micro-batch)."""
    if scale is None:
        return 1.0
    from polyrl.algorithms import agg_loss

    ones = torch.ones(mask.shape, dtype=torch.float32, device=mask.device)
    whole = float(agg_loss(ones, mask, loss_agg_mode))
    part = float(agg_loss(ones, mask, loss_agg_mode, loss_scale=scale)) / whole if whole > 0 else 0.0
    return part if part > 0 else 1.0


def _float(value: Any) -> float:
    if isinstance(value, torch.Tensor):
        return float(value.detach().float().mean())
    return float(value)
