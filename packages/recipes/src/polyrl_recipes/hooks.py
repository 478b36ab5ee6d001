"""polyrl hooks of polyrl-recipes. Imports nothing heavy: each recipe's module loads when a run selects it."""

from polyrl import hookimpl

#: name -> (module, class, one line for ``polyrl plugins``, batch fields it produces)
_TRAINERS = {
    "remax": ("remax", "ReMaxTrainer", "ReMax: REINFORCE with each prompt's greedy-response reward as baseline",
              ["reward_baselines"]),
    "vapo": ("vapo", "VAPOTrainer", "VAPO: PPO with decoupled, length-adaptive GAE and value pre-training", []),
    "pf_ppo": ("pf_ppo", "PFPPOTrainer", "PF-PPO: resample each batch by a weight of its rewards", []),
    "sppo": ("sppo", "SPPOTrainer", "SPPO: self-play preference optimisation from pairwise win rates", []),
    "prime": ("prime", "PRIMETrainer", "PRIME: an implicit process reward model trained online from outcome labels",
              ["prm_scores"]),
    "distill": ("distill", "DistillTrainer", "on-policy distillation from a teacher role (reverse KL, top-k forward KL)",
                []),
}


@hookimpl
def register_trainers(register):
    for name, (module, cls, description, provides) in _TRAINERS.items():
        register(name, f"polyrl_recipes.{module}:{cls}", description=description, provides_fields=provides)


@hookimpl
def register_config_schemas(register):
    for name, cls in (("remax", "ReMaxConfig"), ("vapo", "VAPOConfig"), ("pf_ppo", "PFPPOConfig"),
                      ("sppo", "SPPOConfig"), ("prime", "PRIMEConfig"),
                      ("distill", "DistillConfig")):
        register(f"trainer.{name}", f"polyrl_recipes.config:{cls}")


@hookimpl
def register_advantage_estimators(register):
    register("vapo", "polyrl_recipes.vapo:compute_vapo_advantage_return", needs_values=True,
             description="VAPO's decoupled (actor / critic lambdas), length-adaptive GAE")
    register("prime", "polyrl_recipes.prime:compute_prime_advantage", needs_fields=["prm_scores"],
             description="PRIME: RLOO on the implicit PRM's token rewards plus RLOO on the outcome, whitened")
    register("sppo", "polyrl_recipes.sppo:compute_sppo_advantage",
             description="SPPO's regression target eta (P(y > pi_t) - 1/2) from the group's pairwise win rates")


@hookimpl
def register_policy_losses(register):
    register("sppo", "polyrl_recipes.sppo:compute_policy_loss_sppo",
             description="SPPO: (log pi/pi_t summed over the response - target)^2 per sequence")
