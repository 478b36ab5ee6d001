"""The trainer's config schema: one dataclass per block of the YAML file.

Field names follow verl's where verl has one (``data.train_batch_size``,
``actor.ppo_mini_batch_size``, ``algorithm.adv_estimator``...). The
configuration reference in ``docs/configuration.md`` is generated from these
dataclasses (``python -m polyrl.config.reference``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from polyrl.config.roles import EngineRoleConfig, ModelConfig, OptimConfig, RolloutConfig
from polyrl.rewards.config import RewardConfig


@dataclass
class DataConfig:
    """Training and validation data (verl's row format; see docs/rewards_and_data.md)."""

    train_files: list[str] = field(default_factory=list)
    val_files: list[str] = field(default_factory=list)
    #: Prompts per training step (each sampled ``rollout.n`` times).
    train_batch_size: int = 16
    #: Prompts per validation generation call; 0 means all at once.
    val_batch_size: int = 0
    #: Longest prompt in tokens after the chat template; longer prompts follow ``truncation``.
    max_prompt_length: int = 256
    #: Longest response in tokens (``rollout.response_length`` follows it unless set).
    max_response_length: int = 256
    #: ``error`` | ``left`` | ``right`` | ``filter`` (drop over-long prompts and count them).
    truncation: str = "filter"
    apply_chat_template: bool = True
    shuffle: bool = True
    seed: int = 1
    #: Use at most this many validation prompts (0: all).
    val_max_samples: int = 0


@dataclass
class PolicyLossConfig:
    """verl's ``actor.policy_loss`` block."""

    loss_mode: str = "vanilla"
    clip_cov_ratio: float = 0.0002
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 0.0002
    ppo_kl_coef: float = 0.1
    #: Truncated importance sampling against the rollout's own log-probs (0 disables).
    tis_imp_ratio_cap: float = 0.0
    #: SAPO temperatures / GSPO etc. read extra fields from here.
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class ActorConfig(EngineRoleConfig):
    """The policy being trained."""

    #: Prompts per optimizer step (times ``rollout.n`` rows).
    ppo_mini_batch_size: int = 8
    ppo_epochs: int = 1
    shuffle: bool = False
    #: ``auto``: skip the separate old-log-prob forward pass when the update is on-policy (one PPO epoch,
    #: one mini-batch per step, no KL in the reward); the update then uses its own detached log-probs as the
    #: old ones, which is the same number. ``always``: recompute them every step.
    recompute_old_log_prob: str = "auto"
    clip_ratio: float = 0.2
    clip_ratio_low: float | None = None
    clip_ratio_high: float | None = None
    #: Dual-clip lower bound for negative advantages.
    clip_ratio_c: float = 3.0
    loss_agg_mode: str = "token-mean"
    entropy_coeff: float = 0.0
    #: KL to the reference policy as a loss term (GRPO style) instead of in the reward.
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)


@dataclass
class CriticConfig(EngineRoleConfig):
    """The value model for PPO with GAE; used only when the estimator needs values."""

    ppo_mini_batch_size: int = 8
    ppo_epochs: int = 1
    cliprange_value: float = 0.5
    loss_agg_mode: str = "token-mean"
    #: Optimizer steps on the critic before the actor starts updating.
    warmup_steps: int = 0


@dataclass
class RefConfig:
    """The reference policy for KL. ``enable: auto`` turns it on when a KL term is used.

    With a LoRA actor the reference is the actor with its adapter disabled (no second model).
    """

    enable: str = "auto"  # auto | true | false
    engine: str = ""  # empty: the actor's engine
    micro_batch_size: int = 8
    plugin_config: Any = None


@dataclass
class KLControlConfig:
    """KL coefficient controller for KL-in-reward: ``fixed`` or ``adaptive``."""

    type: str = "fixed"
    kl_coef: float = 0.001
    horizon: int = 10000
    target_kl: float = 0.1


@dataclass
class FilterGroupsConfig:
    """DAPO dynamic sampling: drop groups whose samples all got the same ``metric`` and refill."""

    enable: bool = False
    metric: str = "acc"
    #: Generation rounds per step before giving up on filling the batch (0: unlimited).
    max_num_gen_batches: int = 4


@dataclass
class AlgorithmConfig:
    """How advantages and KL are computed (verl's ``algorithm`` block)."""

    adv_estimator: str = "grpo"
    gamma: float = 1.0
    lam: float = 1.0
    norm_adv_by_std_in_grpo: bool = True
    use_kl_in_reward: bool = False
    kl_penalty: str = "kl"
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    #: Extra estimator arguments (``pass_k`` for grpo_passk, ...).
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class TrainerSection:
    """The loop, placement, logging and checkpoints."""

    #: Where everything of this run goes (config, manifest, metrics, checkpoints, plots).
    run_dir: str = "runs/polyrl"
    project_name: str = "polyrl"
    experiment_name: str = "run"
    total_epochs: int = 1
    #: Stop after this many steps (0: run ``total_epochs``).
    total_steps: int = 0
    #: ``ray`` (worker groups of Ray actors) or ``local`` (every role in this process, one rank).
    executor: str = "ray"
    #: Worker processes per role group (data-parallel size).
    n_workers: int = 1
    #: ``colocated`` (actor, rollout, reference and critic share each worker) or ``split``
    #: (rollout in its own pool of ``rollout_workers`` processes).
    placement: str = "colocated"
    rollout_workers: int = 1
    #: Platform name (``cpu``, ``cuda``, a plugin's ``npu``) or ``auto``.
    device: str = "auto"
    #: CPUs Ray may use on this machine (0: all).
    ray_num_cpus: int = 0
    #: Validate every N steps (0: never) and before training.
    test_freq: int = 0
    val_before_train: bool = True
    #: pass@k of validation uses ``rollout.val_n`` samples; mean@1 uses the first.
    save_freq: int = 0
    #: Keep only the newest N checkpoints (0: keep all).
    max_checkpoints: int = 2
    #: ``auto`` (continue from the newest checkpoint in run_dir), ``disable``, or a checkpoint path.
    resume: str = "auto"
    #: ``console``, ``jsonl``, ``tensorboard``, ``wandb``, ``mlflow``.
    logger: list[str] = field(default_factory=lambda: ["console", "jsonl"])
    progress_bar: bool = True
    seed: int = 1
    #: Weight sync bucket size in MiB.
    weight_bucket_mb: int = 256
    #: Reorder each step's batch so every data-parallel rank gets about the same number of tokens, keeping
    #: each prompt's samples together (verl's ``balance_batch``); ranks wait less for each other.
    balance_batch: bool = True


@dataclass
class PolyrlConfig:
    """The whole run."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    trainer: TrainerSection = field(default_factory=TrainerSection)


@dataclass
class SFTConfig:
    """``polyrl sft``: supervised fine-tuning with the same engines (loss on response tokens)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    actor: EngineRoleConfig = field(default_factory=EngineRoleConfig)
    trainer: TrainerSection = field(default_factory=TrainerSection)
    #: Optimizer steps per epoch are ``len(data) // data.train_batch_size``.
    #: Key of the response text in a row (or use the last assistant message of ``messages``).
    response_key: str = "response"


__all__ = [
    "ActorConfig",
    "AlgorithmConfig",
    "CriticConfig",
    "DataConfig",
    "EngineRoleConfig",
    "FilterGroupsConfig",
    "KLControlConfig",
    "ModelConfig",
    "OptimConfig",
    "PolicyLossConfig",
    "PolyrlConfig",
    "RefConfig",
    "RolloutConfig",
    "SFTConfig",
    "TrainerSection",
]
