"""Registers the built-in advantage estimators and policy losses."""

from polyrl.hookspecs import hookimpl

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
}
_LOSSES = ["vanilla", "gspo", "gpg", "clip_cov", "kl_cov", "cispo", "sapo", "geo_mean"]


@hookimpl
def register_advantage_estimators(register):
    for name, attr in _ESTIMATORS.items():
        register(name, f"polyrl.algorithms.advantages:{attr}", needs_values=name == "gae")


@hookimpl
def register_policy_losses(register):
    for name in _LOSSES:
        register(name, f"polyrl.algorithms.policy_losses:compute_policy_loss_{name}")
