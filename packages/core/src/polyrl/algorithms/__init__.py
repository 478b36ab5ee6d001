"""RL algorithms: advantage estimators, policy losses, KL and loss aggregation, with verl's names.

Look-ups go through the plugin registries, so a third-party plugin's estimator or
loss is found exactly like a built-in one::

    from polyrl.algorithms import get_adv_estimator_fn, get_policy_loss_fn
    adv, ret = get_adv_estimator_fn("grpo")(token_level_rewards, response_mask, index=uids)

The names verl users import from ``verl.trainer.ppo.core_algos`` (estimators,
losses, ``agg_loss``, ``kl_penalty``, KL controllers...) are importable from here;
``verl.utils.torch_functional``'s helpers from :mod:`polyrl.algorithms.torch_functional`.
"""

from __future__ import annotations

from enum import Enum
from typing import TYPE_CHECKING, Any

from polyrl.errors import RegistryError
from polyrl.lazy import lazy_getattr

if TYPE_CHECKING:
    from polyrl.algorithms.advantages import (
        compute_gae_advantage_return,
        compute_gdpo_outcome_advantage,
        compute_gpg_outcome_advantage,
        compute_grpo_outcome_advantage,
        compute_grpo_passk_outcome_advantage,
        compute_grpo_vectorized_outcome_advantage,
        compute_multi_turn_optimal_token_baseline_advantage,
        compute_opo_outcome_advantage,
        compute_optimal_token_baseline_advantage,
        compute_reinforce_plus_plus_baseline_outcome_advantage,
        compute_reinforce_plus_plus_outcome_advantage,
        compute_remax_outcome_advantage,
        compute_rloo_outcome_advantage,
        compute_rloo_vectorized_outcome_advantage,
    )
    from polyrl.algorithms.aggregation import agg_loss
    from polyrl.algorithms.kl import (
        AdaptiveKLController,
        FixedKLController,
        apply_kl_penalty,
        get_kl_controller,
        kl_penalty,
    )
    from polyrl.algorithms.loss_terms import compute_entropy_loss, compute_value_loss
    from polyrl.algorithms.policy_losses import (
        compute_policy_loss_bypass_mode,
        compute_policy_loss_cispo,
        compute_policy_loss_clip_cov,
        compute_policy_loss_dppo_kl,
        compute_policy_loss_dppo_tv,
        compute_policy_loss_dro,
        compute_policy_loss_geo_mean,
        compute_policy_loss_gpg,
        compute_policy_loss_gspo,
        compute_policy_loss_kl_cov,
        compute_policy_loss_reinforce,
        compute_policy_loss_sapo,
        compute_policy_loss_vanilla,
    )
    from polyrl.algorithms.rollout_correction import compute_rollout_correction_and_rejection_mask
    from polyrl.algorithms.torch_functional import (
        clip_by_value,
        entropy_from_logits,
        logprobs_from_logits,
        masked_mean,
        masked_sum,
        masked_var,
        masked_whiten,
    )
    from polyrl.protocols import PolicyLoss

#: public name -> module, imported on first use (PEP 562) so that loading ``polyrl.algorithms.hooks``
#: (``polyrl plugins``) does not import torch
_LAZY: dict[str, str] = {
    "agg_loss": "polyrl.algorithms.aggregation",
    **dict.fromkeys(("AdaptiveKLController", "FixedKLController", "apply_kl_penalty", "get_kl_controller", "kl_penalty"),
                    "polyrl.algorithms.kl"),
    **dict.fromkeys(("compute_entropy_loss", "compute_value_loss"), "polyrl.algorithms.loss_terms"),
    **dict.fromkeys(("clip_by_value", "entropy_from_logits", "logprobs_from_logits", "masked_mean", "masked_sum",
                     "masked_var", "masked_whiten"), "polyrl.algorithms.torch_functional"),
    **dict.fromkeys(("compute_gae_advantage_return", "compute_gdpo_outcome_advantage",
                     "compute_gpg_outcome_advantage", "compute_grpo_outcome_advantage",
                     "compute_grpo_passk_outcome_advantage", "compute_grpo_vectorized_outcome_advantage",
                     "compute_multi_turn_optimal_token_baseline_advantage", "compute_opo_outcome_advantage",
                     "compute_optimal_token_baseline_advantage",
                     "compute_reinforce_plus_plus_baseline_outcome_advantage",
                     "compute_reinforce_plus_plus_outcome_advantage", "compute_remax_outcome_advantage",
                     "compute_rloo_outcome_advantage", "compute_rloo_vectorized_outcome_advantage"),
                    "polyrl.algorithms.advantages"),
    **dict.fromkeys(("compute_policy_loss_bypass_mode", "compute_policy_loss_cispo", "compute_policy_loss_clip_cov",
                     "compute_policy_loss_dppo_kl", "compute_policy_loss_dppo_tv", "compute_policy_loss_dro",
                     "compute_policy_loss_geo_mean", "compute_policy_loss_gpg", "compute_policy_loss_gspo",
                     "compute_policy_loss_kl_cov", "compute_policy_loss_reinforce", "compute_policy_loss_sapo",
                     "compute_policy_loss_vanilla"), "polyrl.algorithms.policy_losses"),
    "compute_rollout_correction_and_rejection_mask": "polyrl.algorithms.rollout_correction",
}


__getattr__ = lazy_getattr(__name__, _LAZY)


class UnknownAlgorithmError(RegistryError, ValueError):
    """An advantage estimator or policy loss name nobody registered.

    A ``ValueError`` like verl's (``except ValueError`` in verl code keeps working) and a
    :class:`~polyrl.errors.RegistryError` like every unknown registry name in polyrl.
    """


class AdvantageEstimator(str, Enum):
    """verl's enum of built-in estimator names; ``get_adv_estimator_fn`` takes a member or a plain string."""

    GAE = "gae"
    GRPO = "grpo"
    REINFORCE_PLUS_PLUS = "reinforce_plus_plus"
    REINFORCE_PLUS_PLUS_BASELINE = "reinforce_plus_plus_baseline"
    REMAX = "remax"
    RLOO = "rloo"
    OPO = "opo"
    GRPO_PASSK = "grpo_passk"
    GPG = "gpg"
    RLOO_VECTORIZED = "rloo_vectorized"
    GRPO_VECTORIZED = "grpo_vectorized"
    OPTIMAL_TOKEN_BASELINE = "optimal_token_baseline"
    TIR_OPTIMAL_TOKEN_BASELINE = "tir_optimal_token_baseline"
    GDPO = "gdpo"


def _lookup(kind: str, name: str | Enum) -> Any:
    from polyrl.plugins import get_plugin_manager

    key = name.value if isinstance(name, Enum) else name
    registry = get_plugin_manager().registry(kind)
    try:
        registry.entry(key)
    except RegistryError as exc:
        raise UnknownAlgorithmError(str(exc)) from None
    return registry.get(key)


def get_adv_estimator_fn(name_or_enum: str | Enum) -> Any:
    """The advantage estimator registered as ``name_or_enum`` (``grpo``, ``gae``, a plugin's own...).

    An unknown name raises :class:`UnknownAlgorithmError` (a ``ValueError``) listing the registered ones.
    """
    return _lookup("advantage_estimator", name_or_enum)


def get_policy_loss_fn(name: str) -> PolicyLoss:
    """The policy loss registered as ``name`` (``vanilla``, ``gspo``, a plugin's own...), callable with every
    argument :class:`polyrl.protocols.PolicyLoss` declares (see :func:`as_policy_loss`).

    An unknown name raises :class:`UnknownAlgorithmError` (a ``ValueError``) listing the registered ones.
    """
    return as_policy_loss(_lookup("policy_loss", name))


#: The keywords :class:`polyrl.protocols.PolicyLoss` declares beyond verl's six arguments.
POLICY_LOSS_KEYWORDS = ("rollout_log_probs", "loss_scale", "rollout_is_weights")

_adapted: dict[Any, Any] = {}


def as_policy_loss(fn: Any) -> PolicyLoss:
    """``fn`` as a :class:`~polyrl.protocols.PolicyLoss`: itself when its signature takes every keyword of
    :data:`POLICY_LOSS_KEYWORDS` (or ``**kwargs``); otherwise, once per function, a wrapper that takes them all
    and passes ``fn`` those it declares and that are not ``None`` (a loss written for verl declares
    ``rollout_log_probs`` or ``rollout_is_weights`` and reads the global counts from ``config``)."""
    try:
        return _adapted[fn]
    except (KeyError, TypeError):  # not adapted yet (TypeError: an unhashable callable, adapted each time)
        pass
    takes = _declared_keywords(fn)
    adapted = fn if takes == set(POLICY_LOSS_KEYWORDS) else _keyword_filter(fn, takes)
    try:
        _adapted[fn] = adapted
    except TypeError:
        pass
    return adapted


def _keyword_filter(fn: Any, takes: set[str]) -> Any:
    import functools

    @functools.wraps(fn)
    def policy_loss(old_log_prob: Any, log_prob: Any, advantages: Any, response_mask: Any,
                    loss_agg_mode: str = "token-mean", config: Any = None, rollout_log_probs: Any = None, *,
                    loss_scale: Any = None, rollout_is_weights: Any = None) -> Any:
        given = {"rollout_log_probs": rollout_log_probs, "loss_scale": loss_scale,
                 "rollout_is_weights": rollout_is_weights}
        return fn(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
                  **{k: v for k, v in given.items() if k in takes and v is not None})

    del policy_loss.__wrapped__  # its own signature is the protocol's, not fn's
    policy_loss.__polyrl_adapts__ = fn  # type: ignore[attr-defined]
    return policy_loss


def _declared_keywords(fn: Any) -> set[str]:
    """The keywords of :data:`POLICY_LOSS_KEYWORDS` that ``fn`` accepts (all of them for ``**kwargs``)."""
    import inspect

    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # a builtin or C callable without a signature: give it verl's six only
        return set()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return set(POLICY_LOSS_KEYWORDS)
    return {p.name for p in params if p.name in POLICY_LOSS_KEYWORDS and p.kind is not inspect.Parameter.POSITIONAL_ONLY}


def compute_advantage(name: str, **kwargs: Any) -> tuple[Any, Any]:
    """Shortcut: ``get_adv_estimator_fn(name)(**kwargs)``."""
    return get_adv_estimator_fn(name)(**kwargs)


__all__ = [
    "POLICY_LOSS_KEYWORDS",
    "AdaptiveKLController",
    "AdvantageEstimator",
    "FixedKLController",
    "UnknownAlgorithmError",
    "agg_loss",
    "apply_kl_penalty",
    "as_policy_loss",
    "clip_by_value",
    "compute_advantage",
    "compute_entropy_loss",
    "compute_gae_advantage_return",
    "compute_gdpo_outcome_advantage",
    "compute_gpg_outcome_advantage",
    "compute_grpo_outcome_advantage",
    "compute_grpo_passk_outcome_advantage",
    "compute_grpo_vectorized_outcome_advantage",
    "compute_multi_turn_optimal_token_baseline_advantage",
    "compute_opo_outcome_advantage",
    "compute_optimal_token_baseline_advantage",
    "compute_policy_loss_bypass_mode",
    "compute_policy_loss_cispo",
    "compute_policy_loss_clip_cov",
    "compute_policy_loss_dppo_kl",
    "compute_policy_loss_dppo_tv",
    "compute_policy_loss_dro",
    "compute_policy_loss_geo_mean",
    "compute_policy_loss_gpg",
    "compute_policy_loss_gspo",
    "compute_policy_loss_kl_cov",
    "compute_policy_loss_reinforce",
    "compute_policy_loss_sapo",
    "compute_policy_loss_vanilla",
    "compute_reinforce_plus_plus_baseline_outcome_advantage",
    "compute_reinforce_plus_plus_outcome_advantage",
    "compute_remax_outcome_advantage",
    "compute_rloo_outcome_advantage",
    "compute_rloo_vectorized_outcome_advantage",
    "compute_rollout_correction_and_rejection_mask",
    "compute_value_loss",
    "entropy_from_logits",
    "get_adv_estimator_fn",
    "get_kl_controller",
    "get_policy_loss_fn",
    "kl_penalty",
    "logprobs_from_logits",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
]
