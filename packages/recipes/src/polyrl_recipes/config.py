"""The config blocks of the recipes: ``trainer: {name: <recipe>, <recipe>: {...}}``.

Each dataclass is registered as the config schema ``trainer.<recipe>``, so a misspelled key is an error
with a suggestion before anything starts, and the trainer reads its block as ``config.trainer.plugin_config``.
Key names follow verl's recipe configs where verl has one (``sppo_eta`` -> ``eta``, PF-PPO's
``reweight_method`` / ``weight_pow``, PRIME's ``beta_train``, ``reward_dpo_coef``, ``reward_gt_coef``,
distillation's ``loss_mode``, ``topk``, ``use_policy_gradient``...). See docs/recipes.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from polyrl.config.roles import EngineRoleConfig, ModelConfig, OptimConfig


def _role(optim: OptimConfig | None = None) -> EngineRoleConfig:
    """A role block whose ``model.path`` may be left out (empty: the recipe decides; OmegaConf would refuse the
    core's ``???`` default inside a plugin's block)."""
    return EngineRoleConfig(model=ModelConfig(path=""), optim=optim or OptimConfig())


@dataclass
class ReMaxConfig:
    """ReMax: REINFORCE with the reward of each prompt's greedy response as its baseline."""

    #: Sampling temperature of the baseline rollout (0: greedy, the paper's choice).
    baseline_temperature: float = 0.0


@dataclass
class VAPOConfig:
    """VAPO: PPO with a value model, decoupled and length-adaptive GAE, value pre-training."""

    #: GAE lambda of the critic's targets (VAPO: 1.0, unbiased Monte-Carlo returns).
    lam_critic: float = 1.0
    #: GAE lambda of the actor's advantages when ``length_adaptive`` is off.
    lam_actor: float = 0.95
    #: Per response, ``lam_actor = 1 - 1 / (alpha * length)`` (VAPO's length-adaptive GAE).
    length_adaptive: bool = True
    #: ``alpha`` of the length-adaptive lambda (VAPO: 0.05).
    alpha: float = 0.05
    #: Steps that train only the critic (on samples of the starting policy) before the actor trains; sets
    #: ``critic.warmup_steps`` (VAPO: 50).
    value_pretrain_steps: int = 50


@dataclass
class PFPPOConfig:
    """PF-PPO (policy filtration): resample each batch by a weight of its reward (verl's ``algorithm.pf_ppo``)."""

    #: ``pow`` (weight ``|score| ** weight_pow``), ``max_min`` (keep only the batch's best and worst scores),
    #: ``max_random`` (best scores weigh 0.4, the rest 0.1).
    reweight_method: str = "pow"
    weight_pow: float = 2.0


@dataclass
class PRIMEConfig:
    """PRIME: an implicit process reward model trained online from outcome labels."""

    #: The implicit PRM: a causal LM trained with its own optimizer (its ``model.path`` defaults to the
    #: actor's; the PRM's reference is the run's reference policy, the actor's starting model).
    prm: EngineRoleConfig = field(default_factory=lambda: _role(
        optim=OptimConfig(lr=1e-6, weight_decay=0.0, grad_clip=10.0)))
    #: ``beta`` of the implicit reward ``beta * log(pi_prm / pi_ref)`` and of the PRM's cross-entropy loss.
    beta_train: float = 0.05
    #: Weight of the PRM's token rewards and of the outcome reward in the advantage (RLOO on each, summed).
    reward_dpo_coef: float = 5.0
    reward_gt_coef: float = 5.0
    #: ``batch_norm``: divide the token rewards by the batch's largest absolute reward-to-go; ``none``.
    prime_norm: str = "batch_norm"
    #: ``before`` (verl's default: update the PRM on the batch, then score it), ``after`` (score with the
    #: update's own forward pass), ``none`` (a frozen PRM).
    update: str = "before"
    #: Prompts per PRM optimizer step (0: ``actor.ppo_mini_batch_size``).
    mini_batch_size: int = 0


@dataclass
class SPPOConfig:
    """SPPO: self-play preference optimisation, ``(log pi/pi_t - eta (P(y > pi_t) - 1/2))^2``."""

    #: ``eta`` (verl's ``sppo_eta``): the scale of the preference target.
    eta: float = 1.0
    #: ``pairwise`` (the paper: each sample's win rate against the other samples of its prompt) or
    #: ``softmean`` (verl's recipe: ``reward - softmean_eta(rewards)`` over the batch).
    win_rate: str = "pairwise"
    #: ``pairwise``: 0 compares rewards (win 1, tie 1/2, loss 0); > 0 is Bradley-Terry,
    #: ``sigmoid((r_i - r_j) / preference_temperature)``.
    preference_temperature: float = 0.0


@dataclass
class DistillConfig:
    """On-policy distillation: the student samples, a frozen teacher scores every token."""

    #: The teacher: any engine, its own model (its tokenizer must map onto the student's).
    teacher: EngineRoleConfig = field(default_factory=_role)
    #: ``k1`` / ``kl``, ``k2`` / ``mse``, ``k3`` / ``low_var_kl``, ``abs``: per-token reverse KL
    #: ``KL(student || teacher)`` estimated on the sampled token; ``forward_kl_topk``: forward KL on the
    #: teacher's top-``topk`` tokens (verl's names; verl's default ``k3``).
    loss_mode: str = "k3"
    #: The teacher's top-k (``forward_kl_topk``).
    topk: int = 32
    #: Reverse-KL modes: the negative per-token KL is an advantage for the run's policy loss (the on-policy
    #: distillation objective of Thinking Machines; use ``k1``), instead of a loss backpropagated directly.
    use_policy_gradient: bool = False
    #: Add the run's own policy loss (``algorithm.adv_estimator`` on the reward) to the distillation loss.
    use_task_rewards: bool = True
    #: Weight of the distillation loss next to the task's policy loss (``use_task_rewards``).
    coef: float = 1.0
    #: Clamp each token's distillation loss to ``[-loss_max_clamp, loss_max_clamp]`` (null: no clamp).
    loss_max_clamp: float | None = None
    #: Clamp log-probs from below in ``forward_kl_topk`` (null: no clamp).
    log_prob_min_clamp: float | None = None
