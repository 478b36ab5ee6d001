"""Registers the built-in advantage estimators and policy losses (one of polyrl's ``DEFAULT_PLUGINS``).

Import strings keep ``import polyrl.algorithms.hooks`` light: a function's module
is imported on first look-up.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from polyrl.hookspecs import hookimpl

#: name -> function in polyrl.algorithms.advantages (verl's names)
_ESTIMATORS = {
    "gae": "compute_gae_advantage_return",
    "grpo": "compute_grpo_outcome_advantage",
    "grpo_passk": "compute_grpo_passk_outcome_advantage",
    "rloo": "compute_rloo_outcome_advantage",
    "reinforce_plus_plus": "compute_reinforce_plus_plus_outcome_advantage",
    "reinforce_plus_plus_baseline": "compute_reinforce_plus_plus_baseline_outcome_advantage",
    "remax": "compute_remax_outcome_advantage",
    "opo": "compute_opo_outcome_advantage",
    "gpg": "compute_gpg_outcome_advantage",
    "grpo_vectorized": "compute_grpo_vectorized_outcome_advantage",
    "rloo_vectorized": "compute_rloo_vectorized_outcome_advantage",
    "gdpo": "compute_gdpo_outcome_advantage",
    "gigpo": "compute_gigpo_outcome_advantage",
    "optimal_token_baseline": "compute_optimal_token_baseline_advantage",
    "tir_optimal_token_baseline": "compute_multi_turn_optimal_token_baseline_advantage",
}
#: loss_mode names; each is polyrl.algorithms.policy_losses:compute_policy_loss_<name>
_LOSSES = ("vanilla", "gspo", "gpg", "clip_cov", "kl_cov", "cispo", "sapo", "geo_mean", "dro", "dppo_tv", "dppo_kl",
           "bypass_mode")


#: Batch fields an estimator cannot run without (metadata ``needs_fields``; the trainer checks them at start-up)
_NEEDS_FIELDS = {
    "remax": ["reward_baselines"],  # the greedy rollouts' rewards: trainer.name=remax (polyrl-recipes)
    "optimal_token_baseline": ["old_log_probs", "sum_pi_squared"],
    "tir_optimal_token_baseline": ["old_log_probs", "sum_pi_squared"],
}


@hookimpl
def register_advantage_estimators(register: Callable[..., Any]) -> None:
    """Register verl's estimators; ``gae`` is marked ``needs_values`` (the trainer builds a critic for it), and
    those that read more than rewards and groups name those batch fields in ``needs_fields``."""
    for name, attr in _ESTIMATORS.items():
        register(name, f"polyrl.algorithms.advantages:{attr}", needs_values=name == "gae",
                 needs_fields=_NEEDS_FIELDS.get(name, []))


@hookimpl
def register_policy_losses(register: Callable[..., Any]) -> None:
    """Register verl's policy losses under their ``actor.policy_loss.loss_mode`` names."""
    for name in _LOSSES:
        register(name, f"polyrl.algorithms.policy_losses:compute_policy_loss_{name}")
