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
from polyrl.reward_models.config import RewardModelConfig
from polyrl.rewards.config import RewardConfig


@dataclass
class DataConfig:
    """Training and validation data (verl's row format; see docs/rewards_and_data.md)."""

    #: Training prompts: parquet or JSON-lines files of verl-format rows (``prompt``, ``data_source``,
    #: ``reward_model.ground_truth``...), or ``save_to_disk`` folders of HF datasets.
    train_files: list[str] = field(default_factory=list)
    #: Validation prompts, in the same format (empty: no validation).
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
    #: Render each row's ``prompt`` messages with the tokenizer's chat template (and its generation prompt);
    #: false, or a tokenizer without a template: the messages' text joined by newlines.
    apply_chat_template: bool = True
    #: Shuffle the training prompts each epoch.
    shuffle: bool = True
    #: Seed of that shuffle.
    seed: int = 1
    #: Use at most this many validation prompts (0: all).
    val_max_samples: int = 0
    #: The column holding each row's prompt (verl's ``data.prompt_key``).
    prompt_key: str = "prompt"
    #: The column naming each row's data source, which picks its reward function (verl's ``data.reward_fn_key``).
    reward_fn_key: str = "data_source"
    #: Where each row's ground truth is, dotted for a nested column (verl's rows: ``reward_model.ground_truth``).
    ground_truth_key: str = "reward_model.ground_truth"
    #: Extra keyword arguments of the tokenizer's ``apply_chat_template`` (``{enable_thinking: false}``).
    apply_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    #: The column of a row's images (verl's ``images``: paths, bytes or PIL images; one ``<image>`` in the
    #: prompt per image), for vision-language models (docs/vlm.md).
    image_key: str = "images"
    #: A row whose images cannot be used (missing file, not an image, placeholders and images that do not
    #: match): ``error`` (refuse the run, naming the file, row and image) or ``skip`` (drop it and count it).
    on_bad_row: str = "error"


@dataclass
class PolicyLossConfig:
    """verl's ``actor.policy_loss`` block."""

    #: The policy loss, by registered name: ``vanilla`` (PPO's clipped loss), ``gspo``, ``gpg``, ``clip_cov``,
    #: ``kl_cov``, ``cispo``, ``sapo``, ``geo_mean``, ``dro``, ``dppo_tv``, ``dppo_kl``, ``bypass_mode``, a plugin's.
    loss_mode: str = "vanilla"
    #: ``clip_cov``: fraction of tokens whose gradient is cut (those with the largest advantage-log-prob covariance).
    clip_cov_ratio: float = 0.0002
    #: ``clip_cov``: lower bound of the covariance a cut token may have.
    clip_cov_lb: float = 1.0
    #: ``clip_cov``: upper bound of the covariance a cut token may have.
    clip_cov_ub: float = 5.0
    #: ``kl_cov``: fraction of tokens (largest covariance) that get the KL penalty.
    kl_cov_ratio: float = 0.0002
    #: ``kl_cov``: coefficient of that penalty, ``|log p - log p_old|``.
    ppo_kl_coef: float = 0.1
    #: Truncated importance sampling against the rollout's own log-probs (0 disables). Kept for old configs:
    #: it means ``algorithm.rollout_correction.rollout_is: token`` with ``rollout_is_threshold`` = this cap.
    tis_imp_ratio_cap: float = 0.0
    #: DRO's quadratic log-ratio penalty (``loss_mode: dro``; must be > 0 then).
    dro_beta: float | None = None
    #: Filled by the trainer from ``algorithm.rollout_correction`` (the ``bypass_mode`` loss reads it here, as in verl).
    rollout_correction: dict[str, Any] = field(default_factory=dict)
    #: SAPO temperatures / GSPO etc. read extra fields from here.
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class ActorConfig(EngineRoleConfig):
    """The policy being trained."""

    #: Prompts per optimizer step (times ``rollout.n`` rows).
    ppo_mini_batch_size: int = 8
    #: Passes over each step's batch (each pass one optimizer step per mini-batch).
    ppo_epochs: int = 1
    #: Shuffle the rows before each pass over the batch, so that each mini-batch takes some samples of every
    #: prompt instead of whole groups (TRL's GRPOTrainer does; verl's default is off). On the quickstart task it
    #: learned more per batch (docs/benchmarks.md, "What the learning gap was").
    shuffle: bool = False
    #: ``auto``: skip the separate old-log-prob forward pass when the update is on-policy (one PPO epoch,
    #: one mini-batch per step, no KL in the reward); the update then uses its own detached log-probs as the
    #: old ones, which is the same number. ``always``: recompute them every step.
    recompute_old_log_prob: str = "auto"
    #: PPO's clip range: the probability ratio is clipped to ``[1 - clip_ratio, 1 + clip_ratio]``.
    clip_ratio: float = 0.2
    #: The lower side of that range alone (``null``: ``clip_ratio``).
    clip_ratio_low: float | None = None
    #: The upper side alone (``null``: ``clip_ratio``; DAPO's clip-higher raises it, e.g. 0.28).
    clip_ratio_high: float | None = None
    #: Dual-clip lower bound for negative advantages.
    clip_ratio_c: float = 3.0
    #: How token losses become the batch loss: ``token-mean``, ``token-sum``, ``seq-mean-token-sum``,
    #: ``seq-mean-token-mean``, ``seq-mean-token-sum-norm`` (verl's names; docs/algorithms.md).
    loss_agg_mode: str = "token-mean"
    #: Entropy bonus: ``entropy_coeff`` times the policy's entropy is subtracted from the loss (0: none).
    entropy_coeff: float = 0.0
    #: KL to the reference policy as a loss term (GRPO style) instead of in the reward.
    use_kl_loss: bool = False
    #: Weight of that KL loss.
    kl_loss_coef: float = 0.001
    #: KL estimator of that loss: ``kl`` (k1), ``abs``, ``mse`` (k2), ``low_var_kl`` (k3).
    kl_loss_type: str = "low_var_kl"
    #: ``seq-mean-token-sum-norm``'s divisor (verl's ``loss_scale_factor``); null: the response width.
    loss_scale_factor: float | None = None
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)


@dataclass
class CriticConfig(EngineRoleConfig):
    """The value model for PPO with GAE; used only when the estimator needs values."""

    #: ``auto``: a critic when the estimator needs values (``gae``, a plugin's ``needs_values``); ``true``: always
    #: (trained even when the estimator does not read its values); ``false``: never, and an estimator (or recipe)
    #: that needs one is refused at start-up (verl's ``critic.enable``).
    enable: str = "auto"
    #: Prompts per critic optimizer step (times ``rollout.n`` rows).
    ppo_mini_batch_size: int = 8
    #: Passes of the critic over each step's batch.
    ppo_epochs: int = 1
    #: Value clipping: new values stay within this distance of the old ones in the value loss.
    cliprange_value: float = 0.5
    #: How token value losses become the batch loss (as ``actor.loss_agg_mode``).
    loss_agg_mode: str = "token-mean"
    #: Optimizer steps on the critic before the actor starts updating.
    warmup_steps: int = 0


@dataclass
class RefConfig:
    """The reference policy for KL. ``enable: auto`` turns it on when a KL term is used.

    With a LoRA actor the reference is the actor with its adapter disabled (no second model).
    """

    #: ``auto`` (on when a KL term is used), ``true`` or ``false``.
    enable: str = "auto"
    #: The reference's engine (empty: the actor's).
    engine: str = ""
    #: Sequences per micro-batch of the reference's log-prob pass.
    micro_batch_size: int = 8
    plugin_config: Any = None


@dataclass
class KLControlConfig:
    """KL coefficient controller for KL-in-reward: ``fixed`` or ``adaptive``."""

    #: ``fixed`` or ``adaptive`` (the coefficient moves to keep the KL near ``target_kl``).
    type: str = "fixed"
    #: The KL coefficient (``adaptive``: its starting value).
    kl_coef: float = 0.001
    #: ``adaptive``: samples over which the coefficient adapts (larger: slower).
    horizon: int = 10000
    #: ``adaptive``: the KL the coefficient steers towards.
    target_kl: float = 0.1


@dataclass
class FilterGroupsConfig:
    """DAPO dynamic sampling: drop groups whose samples all got the same ``metric`` and refill."""

    #: Turn dynamic sampling on.
    enable: bool = False
    #: The per-sample value that must vary within a group: a key of the reward function's dict (``acc``,
    #: ``score``...).
    metric: str = "acc"
    #: Generation rounds per step before giving up on filling the batch (0: unlimited).
    max_num_gen_batches: int = 4


@dataclass
class RolloutCorrectionConfig:
    """verl's ``algorithm.rollout_correction``: weights / rejection for the rollout-vs-trainer log-prob gap
    (docs/algorithms.md, "Rollout correction")."""

    #: ``token``, ``sequence`` or null (no importance weights).
    rollout_is: str | None = None
    #: A number (TIS cap) or ``"lower_upper"`` (IcePop: weights outside the bounds become 0).
    rollout_is_threshold: Any = 2.0
    #: Divide the weights by their batch mean.
    rollout_is_batch_normalize: bool = False
    #: Rejection sampling criteria, comma-separated (``token_k1``, ``seq_mean_k3``, ...), or null.
    rollout_rs: str | None = None
    #: One threshold, or one per ``rollout_rs`` criterion (comma-separated; ``k1``: ``"lower_upper"``).
    rollout_rs_threshold: Any = None
    #: Use the rollout's log-probs as the old ones (no old-log-prob pass) with the ``bypass_mode`` loss.
    bypass_mode: bool = False
    #: Loss in bypass mode: ``ppo_clip`` or ``reinforce``.
    loss_type: str = "ppo_clip"


@dataclass
class AlgorithmConfig:
    """How advantages and KL are computed (verl's ``algorithm`` block)."""

    #: The advantage estimator, by registered name: ``grpo``, ``gae`` (PPO with a critic), ``rloo``,
    #: ``reinforce_plus_plus``, ``remax``, ``opo``, ``gpg``, ``grpo_passk``, ``gdpo``, ... (docs/algorithms.md).
    adv_estimator: str = "grpo"
    #: Discount factor (``gae``, ``reinforce_plus_plus``).
    gamma: float = 1.0
    #: GAE's lambda.
    lam: float = 1.0
    #: GRPO: divide each advantage by its group's reward std (false: Dr. GRPO's mean-only centring).
    norm_adv_by_std_in_grpo: bool = True
    #: Subtract ``kl_ctrl.kl_coef`` times the KL to the reference from the token rewards (PPO style).
    use_kl_in_reward: bool = False
    #: KL estimator for the reward penalty: ``kl`` (k1), ``abs``, ``mse`` (k2), ``low_var_kl`` (k3).
    kl_penalty: str = "kl"
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    #: GDPO: the reward components (keys of the reward function's dict) normalised one by one, and their weights.
    gdpo_reward_keys: list[str] = field(default_factory=list)
    #: One weight per ``gdpo_reward_keys`` entry (``null``: equal weights).
    gdpo_reward_weights: list[float] | None = None
    #: Extra estimator arguments (``pass_k`` for grpo_passk, ...).
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class OpenAIAgentConfig:
    """The ``openai_agent`` loop: an agent program trained through a local OpenAI API (docs/agents.md)."""

    #: The agent program: ``pkg.mod:fn`` or ``path/to/file.py:fn``, called as ``fn(client_kwargs, row)`` (sync or
    #: async) and returning the reward (a number, or a dict with ``reward``).
    run: str = ""
    #: What an episode trains: ``merged`` (the longest prefix-consistent chain of calls, one sequence) or
    #: ``per_call`` (one sample per call, each with the episode's reward).
    samples: str = "merged"
    #: Wall-clock seconds a program may run; past it its key is revoked and the episode counts as timed out.
    timeout_s: float = 300.0
    #: A failed episode (raised, timed out, never called the model, returned a non-number): ``score`` (train it
    #: with ``error_score``) or ``drop`` (its tokens masked out: it trains nothing).
    on_error: str = "score"
    #: The reward of a failed episode.
    error_score: float = 0.0
    #: Most chat completions per episode (more get HTTP 429).
    max_calls: int = 32


@dataclass
class AgentConfig:
    """Agent loops and their tools (docs/agents.md): the ``agent:`` block, given to every agent loop."""

    #: The loop of a row without ``agent_name`` (``single_turn``, ``tool_agent``, a plugin's).
    default_loop: str = "single_turn"
    #: Tools the loops may call: registry names, import strings (``pkg.mod:fn``) or ``{name: ..., <options>}``.
    tools: list[Any] = field(default_factory=list)
    #: How ``tool_agent`` finds calls in a turn: ``hermes``, ``qwen3_coder``, ``llama3_json`` or a plugin's parser.
    tool_parser: str = "hermes"
    #: Most assistant turns per trajectory (the last may still call tools; it then ends with ``max_turns``).
    max_turns: int = 4
    #: Most tool calls run per turn (extra calls get an error message).
    max_parallel_calls: int = 4
    #: Most tokens per assistant turn (0: whatever is left of ``data.max_response_length``).
    max_new_tokens_per_turn: int = 0
    #: A tool message longer than this many characters is cut (its middle replaced by ``...``).
    max_tool_response_length: int = 512
    #: Seconds a tool call may take before it becomes a "timed out" tool error.
    tool_timeout_s: float = 30.0
    #: Render the prompt with the allowed tools' schemas (``apply_chat_template(tools=...)``).
    tools_in_prompt: bool = True
    #: How tools' ``ToolResult.reward`` joins the sample's reward: ``sum`` (added to the final score), ``none``.
    tool_reward: str = "sum"
    #: Factor on the summed tool rewards.
    tool_reward_coef: float = 1.0
    openai_agent: OpenAIAgentConfig = field(default_factory=OpenAIAgentConfig)


@dataclass
class ProfileConfig:
    """torch.profiler traces of chosen steps (docs/profiling.md); ``polyrl profile RUN_DIR`` summarises them."""

    #: Steps to record (1-based), e.g. ``[2, 10]``: every worker process writes a Chrome trace per step to
    #: ``RUN_DIR/profile/step_N/<roles>_rank<r>.pt.trace.json`` (TensorBoard's profiler plugin reads the folder).
    steps: list[int] = field(default_factory=list)
    #: Also record allocations (shapes and memory events in the trace) and, on platforms that keep an allocation
    #: history (CUDA), a memory snapshot per process (``*.memory_snapshot.pickle``).
    memory: bool = False
    #: Record Python stacks of each operator (bigger traces, slower steps).
    with_stack: bool = False


@dataclass
class PhaseTimeoutsConfig:
    """Deadlines of single kinds of phase, in seconds; each left ``null`` takes ``trainer.phase_timeout_s``
    (docs/cluster.md, "Deadlines and restarts")."""

    #: Generating a step's samples (the wait for them in the asynchronous modes).
    generation: float | None = None
    #: Scoring a step's samples (reward functions, reward models).
    reward: float | None = None
    #: Each other worker-group call of a step: log-probs, values, critic and actor updates.
    worker_call: float | None = None
    #: Actor weights to the rollout.
    weight_sync: float | None = None
    #: Writing (or loading) a checkpoint.
    checkpoint: float | None = None
    #: One validation pass.
    validation: float | None = None


@dataclass
class TrainerSection:
    """The loop, placement, logging and checkpoints."""

    #: The trainer ``polyrl train`` runs: ``ppo`` (PPO / GRPO and family, built in) or one a plugin registers
    #: (``register_trainers``; e.g. ``flow_grpo`` from polyrl-diffusion). Its options go in a block named
    #: after it, ``trainer: {flow_grpo: {...}}``, validated by the schema the plugin registers as
    #: ``trainer.<name>`` and passed as ``trainer.plugin_config``.
    name: str = "ppo"
    #: Where everything of this run goes (config, manifest, metrics, checkpoints, plots).
    run_dir: str = "runs/polyrl"
    #: The W&B project and MLflow experiment (``trainer.logger``).
    project_name: str = "polyrl"
    #: The run's name in W&B and MLflow.
    experiment_name: str = "run"
    #: Passes over the training prompts (used when ``total_steps`` is 0).
    total_epochs: int = 1
    #: Stop after this many steps (0: run ``total_epochs``).
    total_steps: int = 0
    #: ``auto``, ``ray`` (worker groups of Ray actors; ``pip install 'polyrl[ray]'``) or ``local`` (every role in
    #: this process, one rank). ``auto``: ``local`` unless the run needs several processes (``n_workers > 1``,
    #: ``placement=split``, an async mode, ``ray_address``), then ``ray``. See docs/running.md, "Executors".
    executor: str = "auto"
    #: Worker processes per role group (data-parallel size).
    n_workers: int = 1
    #: Which pool of worker processes holds each role: ``colocated`` (every role shares each worker), ``split``
    #: (the rollout in its own pool of ``rollout_workers`` processes), or a mapping of roles to pool names
    #: (``{actor: a, rollout: b, critic: c, reward_model: c}``; roles left out go to the actor's pool) with
    #: the pools' sizes in ``pools``. See docs/placement.md.
    placement: Any = "colocated"
    #: Workers per named pool of a ``placement`` mapping (``{a: 2, b: 1, c: 1}``); the actor's pool defaults to
    #: ``n_workers``, the rollout's to ``rollout_workers``.
    pools: dict[str, int] = field(default_factory=dict)
    #: Workers of the rollout's pool with ``placement: split`` (and the default size of its pool in a mapping).
    rollout_workers: int = 1
    #: Platform name (``cpu``, ``cuda``, a plugin's ``npu``) or ``auto``.
    device: str = "auto"
    #: CPUs Ray may use on this machine (0: all).
    ray_num_cpus: int = 0
    #: Join this Ray cluster (``ray://host:10001``, ``host:6379`` or ``auto``) instead of starting a local Ray
    #: bound to loopback (empty: the ``RAY_ADDRESS`` environment variable, if set); see docs/cluster.md.
    ray_address: str = ""
    #: How each worker group's placement group lays its workers over nodes: ``PACK`` (as few nodes as fit,
    #: spreading over more when one is not enough), ``SPREAD``, ``STRICT_PACK`` (one node or fail),
    #: ``STRICT_SPREAD``.
    placement_strategy: str = "PACK"
    #: Seconds any phase of a step (generation, reward, each worker-group call, weight sync, checkpoint,
    #: validation) may take; past it the run stops with one line naming the phase, role, rank and host, every
    #: worker's Python stacks go to ``RUN_DIR/train.log``, and the last checkpoint stays whole (docs/cluster.md).
    phase_timeout_s: float = 1800.0
    #: Per-kind deadlines that differ from ``phase_timeout_s`` (``{generation: 3600, checkpoint: 600}``).
    phase_timeouts: PhaseTimeoutsConfig = field(default_factory=PhaseTimeoutsConfig)
    #: How many times a run that lost a worker process or a node resumes from its last checkpoint by itself
    #: (0: it stops with one line naming the lost worker; started again, it resumes).
    max_restarts: int = 0
    #: Seconds a restart waits for the cluster to offer the run's layout (its pools' CPUs and accelerators) again.
    restart_wait_s: float = 300.0
    #: ``placement=split``: how actor weights reach the rollout pool: ``collective`` (a process group between
    #: actor rank 0 and the rollout replicas' leaders, bucketed broadcasts over the platform's weight-sync
    #: backend), ``object_store`` (buckets through Ray's object store) or ``auto`` (collective: 3-4x faster
    #: than the object store even on CPU, docs/placement.md).
    weight_transfer: str = "auto"
    #: Validate every N steps (0: never) and at the last step; pass@k of validation uses ``rollout.val_n``
    #: samples, mean@1 the first.
    test_freq: int = 0
    #: Validate once before the first step (not on resume).
    val_before_train: bool = True
    #: Checkpoint every N steps and at the last step (0: never), so an interrupted run resumes.
    save_freq: int = 100
    #: Keep only the newest N checkpoints (0: keep all).
    max_checkpoints: int = 2
    #: ``auto`` (continue from the newest complete checkpoint in run_dir), ``disable``, or a checkpoint path.
    resume: str = "auto"
    #: Config keys (or their parents, e.g. ``actor.optim``) that may differ from the checkpoint's on resume;
    #: the new values apply from the resumed step on. Any other difference is refused.
    resume_override: list[str] = field(default_factory=list)
    #: ``console``, ``jsonl``, ``tensorboard``, ``wandb``, ``mlflow``.
    logger: list[str] = field(default_factory=lambda: ["console", "jsonl"])
    #: Write every training step's generations (prompt, response, score, reward extras, advantage, length, sample
    #: id) to ``<dir>/<step>.jsonl`` (empty: off; a relative path is under the run directory).
    rollout_data_dir: str = ""
    #: The same for every validation: ``auto`` is ``RUN_DIR/generations/validation``; empty: off.
    validation_data_dir: str = "auto"
    #: The first N validation samples as a table in TensorBoard / W&B / MLflow, where those loggers are on (0: none).
    log_val_generations: int = 10
    #: A step progress bar on the console (log lines print above it).
    progress_bar: bool = True
    #: The run's seed: driver RNG, each worker's (plus its rank), each step's sampling seed.
    seed: int = 1
    #: Weight sync bucket size in MiB.
    weight_bucket_mb: int = 256
    #: Reorder each step's batch so every data-parallel rank gets about the same number of tokens, keeping
    #: each prompt's samples together (verl's ``balance_batch``); ranks wait less for each other.
    balance_batch: bool = True
    #: ``sync`` (generate, then train), ``one_step_off_policy`` (step k+1 generates while step k trains) or
    #: ``fully_async`` (rollout streams prompt groups into a bounded queue); the last two need
    #: ``placement=split``. See docs/async.md.
    async_mode: str = "sync"
    #: ``fully_async``: a prompt group generated more than this many policy versions before the update that
    #: would train on it is dropped and its prompt generated again.
    async_max_staleness: int = 1
    #: ``fully_async``: generation in flight when new weights arrive is ``finish``ed on the old weights, or
    #: ``abort``ed (its result discarded) and its prompts generated again on the new weights.
    async_inflight: str = "finish"
    #: ``fully_async``: most prompt groups finished or in flight ahead of the trainer (0: ``data.train_batch_size``
    #: times ``max(1, async_max_staleness)``).
    async_queue_groups: int = 0
    #: ``fully_async``: prompt groups per generation call of a rollout worker (0: a batch spread over the workers).
    async_chunk_groups: int = 0
    #: Async modes: truncated importance-sampling cap on the policy gap (``pi_train / pi_rollout``), applied
    #: per token when ``algorithm.rollout_correction.rollout_is`` is unset (0: no correction).
    async_tis_cap: float = 2.0
    #: Rewrite ``RUN_DIR/report.html`` (``polyrl view``) every N steps, after each validation and at the end
    #: (0: only ``polyrl view`` writes it).
    report_freq: int = 10
    #: torch.profiler traces of chosen steps (``trainer.profile.steps=[2]``; docs/profiling.md).
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    #: The validated ``trainer.<name>`` block of a plugin trainer (filled by the config loader).
    plugin_config: Any = None


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
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    trainer: TrainerSection = field(default_factory=TrainerSection)


@dataclass
class SFTConfig:
    """``polyrl sft``: supervised fine-tuning with the same engines (loss on response tokens)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    actor: EngineRoleConfig = field(default_factory=EngineRoleConfig)
    trainer: TrainerSection = field(default_factory=TrainerSection)
    #: Key of the response text in a row (or use the last assistant message of ``messages``).
    #: Optimizer steps per epoch are ``len(data) // data.train_batch_size``.
    response_key: str = "response"


#: Value rules checked when a config is loaded (``polyrl.config.loader``): key -> ``"> 0"`` or ``">= 0"``.
#: A key a schema does not have (``rollout.n`` in ``polyrl sft``) is skipped.
VALUE_RULES: dict[str, str] = {
    "data.train_batch_size": "> 0", "data.val_batch_size": ">= 0", "data.max_prompt_length": "> 0",
    "data.max_response_length": "> 0", "data.val_max_samples": ">= 0",
    "actor.ppo_mini_batch_size": "> 0", "actor.ppo_epochs": "> 0", "actor.micro_batch_size": "> 0",
    "actor.optim.lr": ">= 0",
    "critic.ppo_mini_batch_size": "> 0", "critic.ppo_epochs": "> 0", "critic.micro_batch_size": "> 0",
    "ref.micro_batch_size": "> 0",
    "rollout.n": "> 0", "rollout.val_n": "> 0", "rollout.tensor_parallel_size": "> 0", "rollout.max_model_len": ">= 0",
    "rollout.max_batch_size": "> 0", "rollout.temperature": ">= 0", "rollout.val_temperature": ">= 0",
    "reward.timeout_s": ">= 0", "reward.num_workers": ">= 0",
    "reward_model.micro_batch_size": "> 0", "reward_model.max_length": ">= 0",
    "reward_model.max_token_len_per_gpu": "> 0", "reward_model.rollout.response_length": "> 0",
    "trainer.total_steps": ">= 0", "trainer.total_epochs": ">= 0", "trainer.n_workers": "> 0",
    "trainer.rollout_workers": "> 0", "trainer.test_freq": ">= 0", "trainer.save_freq": ">= 0",
    "trainer.max_checkpoints": ">= 0", "trainer.ray_num_cpus": ">= 0", "trainer.report_freq": ">= 0",
    "trainer.log_val_generations": ">= 0",
    "reward.max_failed_steps": ">= 0",
    "trainer.weight_bucket_mb": "> 0",
    # deadlines: 0 would stop every step at once (there is no "off": raise it instead)
    "trainer.phase_timeout_s": "> 0", "trainer.max_restarts": ">= 0", "trainer.restart_wait_s": ">= 0",
    **{f"trainer.phase_timeouts.{kind}": "> 0"
       for kind in ("generation", "reward", "worker_call", "weight_sync", "checkpoint", "validation")},
    # the asynchronous modes' numbers, checked before Ray starts (a bad one used to fail inside the rollout stream)
    "trainer.async_max_staleness": ">= 0", "trainer.async_queue_groups": ">= 0", "trainer.async_chunk_groups": ">= 0",
    "trainer.async_tis_cap": ">= 0",
}

#: verl's names of keys polyrl renamed, accepted in polyrl's layout too (verl name -> polyrl key). Giving both
#: spellings with different values is an error naming both.
VERL_SPELLINGS: dict[str, str] = {
    **{f"{role}.ppo_micro_batch_size_per_gpu": f"{role}.micro_batch_size" for role in ("actor", "critic")},
    **{f"{role}.ppo_max_token_len_per_gpu": f"{role}.max_token_len_per_gpu" for role in ("actor", "critic")},
    **{f"{role}.grad_clip": f"{role}.optim.grad_clip" for role in ("actor", "critic")},
    **{f"{role}.optim.clip_grad": f"{role}.optim.grad_clip" for role in ("actor", "critic")},
    **{f"{block}.enable_gradient_checkpointing": f"{block}.gradient_checkpointing"
       for block in ("model", "actor.model", "critic.model")},
    **{f"{block}.lora_rank": f"{block}.lora.rank" for block in ("model", "actor.model", "critic.model")},
    **{f"{block}.lora_alpha": f"{block}.lora.alpha" for block in ("model", "actor.model", "critic.model")},
    **{f"{block}.target_modules": f"{block}.lora.target_modules" for block in ("model", "actor.model", "critic.model")},
    "ref.log_prob_micro_batch_size_per_gpu": "ref.micro_batch_size",
    "rollout.tensor_model_parallel_size": "rollout.tensor_parallel_size",
    "rollout.val_kwargs.temperature": "rollout.val_temperature",
    "rollout.val_kwargs.top_p": "rollout.val_top_p",
    "rollout.val_kwargs.n": "rollout.val_n",
    "trainer.total_training_steps": "trainer.total_steps",
    "trainer.critic_warmup": "critic.warmup_steps",
    "trainer.max_actor_ckpt_to_keep": "trainer.max_checkpoints",
    "trainer.default_local_dir": "trainer.run_dir",
}


__all__ = [
    "ActorConfig",
    "AgentConfig",
    "AlgorithmConfig",
    "CriticConfig",
    "DataConfig",
    "EngineRoleConfig",
    "FilterGroupsConfig",
    "KLControlConfig",
    "ModelConfig",
    "OpenAIAgentConfig",
    "OptimConfig",
    "PhaseTimeoutsConfig",
    "PolicyLossConfig",
    "PolyrlConfig",
    "ProfileConfig",
    "RefConfig",
    "RolloutConfig",
    "SFTConfig",
    "TrainerSection",
]
