"""RL algorithms: advantage estimators, policy losses, KL and loss aggregation, with verl's names.

Look-ups go through the plugin registries, so a third-party plugin's estimator or
loss is found exactly like a built-in one::

    from polyrl.algorithms import get_adv_estimator_fn, get_policy_loss_fn
    adv, ret = get_adv_estimator_fn("grpo")(token_level_rewards, response_mask, index=uids)
"""

from __future__ import annotations

from typing import Any

from polyrl.algorithms.core import (
    AdaptiveKLController,
    FixedKLController,
    agg_loss,
    apply_kl_penalty,
    compute_value_loss,
    entropy_from_logits,
    get_kl_controller,
    kl_penalty,
    masked_mean,
    masked_whiten,
)


def get_adv_estimator_fn(name: str) -> Any:
    """The advantage estimator registered as ``name`` (``grpo``, ``gae``, a plugin's own...)."""
    from polyrl.plugins import get_plugin_manager

    return get_plugin_manager().get("advantage_estimator", name)


def get_policy_loss_fn(name: str) -> Any:
    """The policy loss registered as ``name`` (``vanilla``, ``gspo``, a plugin's own...)."""
    from polyrl.plugins import get_plugin_manager

    return get_plugin_manager().get("policy_loss", name)


def compute_advantage(name: str, **kwargs: Any) -> tuple[Any, Any]:
    """Shortcut: ``get_adv_estimator_fn(name)(**kwargs)``."""
    return get_adv_estimator_fn(name)(**kwargs)


__all__ = [
    "AdaptiveKLController",
    "FixedKLController",
    "agg_loss",
    "apply_kl_penalty",
    "compute_advantage",
    "compute_value_loss",
    "entropy_from_logits",
    "get_adv_estimator_fn",
    "get_kl_controller",
    "get_policy_loss_fn",
    "kl_penalty",
    "masked_mean",
    "masked_whiten",
]
