"""The PPO / GRPO trainer: the single controller's loop, top to bottom.

One step, in DESIGN.md's order::

    prompts -> agent loops -> rollout.generate -> reward manager -> old log-probs (actor)
            -> ref log-probs -> values (critic) -> advantage estimator -> critic update
            -> actor update (policy loss) -> weights_for_rollout -> rollout.update_weights
            -> checkpoint / validate / log

The algorithm runs here, in plain Python, on batches (TensorDicts); the models
live in worker groups (:mod:`polyrl.controller`).
"""

from __future__ import annotations

import inspect
import json
import logging
import random
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

from polyrl import batch as batch_ops
from polyrl.agent_loops.runner import agent_metrics, fold_tool_rewards, sample_of_rows
from polyrl.algorithms import masked_mean
from polyrl.config.loader import record_dict, to_dict, to_yaml
from polyrl.errors import ConfigError
from polyrl.logs import progress_bar, setup_run_logging
from polyrl.manifest import Manifest
from polyrl.models.paths import check_model_paths
from polyrl.protocols import ForwardProducts, SamplingParams
from polyrl.trainer.checkpoint import (
    CheckpointManager,
    config_differences,
    read_state,
    resolve_resume,
    truncate_metrics,
)
from polyrl.trainer.faults import fault_point
from polyrl.trainer.generations import reward_extras, sample_ids, write_jsonl
from polyrl.trainer.role_groups import RoleGroups, build_role_groups, plan_placement
from polyrl.trainer.roles import RoleSpec
from polyrl.trainer.run_dir import RunDirLock, prepare_run_dir
from polyrl.trainer.step_rows import expand_to_rows, pad_step_rows, step_row_divisor
from polyrl.trainer.updates import single_update_pass

log = logging.getLogger("polyrl")

#: Estimators that need a critic's values.
_NEEDS_CRITIC = {"gae"}

#: Batch fields an estimator may need (its registration's ``needs_fields``) that only a plugin trainer
#: produces, and a trainer that does: field -> (trainer name, distribution), for the start-up error.
_FIELD_PROVIDERS = {"reward_baselines": ("remax", "polyrl-recipes")}


class PPOTrainer:
    """Runs RL post-training for ``config`` (a :class:`polyrl.config.schema.PolyrlConfig`).

    One loop for every model kind: a plugin trainer (chosen by ``trainer.name``, registered with
    ``register_trainers``) subclasses this class and overrides only what differs — :attr:`worker_cls`,
    :meth:`build_tokenizer`, :meth:`build_datasets`, :meth:`build_reward_fn`, :meth:`batch_metrics`,
    :meth:`balance_lengths`, :meth:`throughput_metrics`, :meth:`validate`, :meth:`next_rows`, and calls
    :meth:`sampling_params`, :meth:`generate_batch`, :meth:`pad_rows` (docs/plugins/trainers.md).
    """

    #: The worker class the role groups run (a subclass of :class:`polyrl.trainer.role_worker.Worker`).
    worker_cls: type | None = None
    #: Batch fields this trainer adds before the advantage estimator runs (in :meth:`before_advantage`),
    #: beyond the core's; checked against the estimator's ``needs_fields`` before any worker starts
    #: (e.g. ``reward_baselines`` from ReMax's greedy rollouts).
    provides_fields: frozenset[str] = frozenset()

    def __init__(self, config: Any, *, manifest: Manifest | None = None, plugins: Any = None) -> None:
        from polyrl.plugins import get_plugin_manager
        from polyrl.trainer.executor import resolve_executor

        self.config = config
        self.manifest = manifest
        self.pm = plugins or get_plugin_manager()
        cfg = config
        resolve_executor(cfg)  # auto -> local or ray; a run that needs Ray without it stops here
        self.run_dir = Path(cfg.trainer.run_dir).expanduser().resolve()  # created (and locked) by fit()
        self._check_config()
        # before the tokenizer and the data sets are built: a run that cannot score its data stops in seconds
        self.check_rewards()
        self.tokenizer = self.build_tokenizer()

        from polyrl.data import RLDataLoader

        data = cfg.data
        self.train_set, self.val_set = self.build_datasets()
        self.loader = RLDataLoader(self.train_set, batch_size=data.train_batch_size, shuffle=data.shuffle,
                                   seed=data.seed, drop_last=True)
        if len(self.loader) == 0:
            raise ConfigError(
                f"data.train_batch_size={data.train_batch_size} is larger than the training set "
                f"({len(self.train_set)} prompts after filtering): lower it or add data"
            )
        steps_per_epoch = len(self.loader)
        self.total_steps = cfg.trainer.total_steps or steps_per_epoch * cfg.trainer.total_epochs
        from polyrl.profiling import check_profile_steps

        self.profile_steps = check_profile_steps(cfg.trainer.profile.steps, self.total_steps)
        updates = max(1, data.train_batch_size // cfg.actor.ppo_mini_batch_size) * cfg.actor.ppo_epochs
        cfg.actor.optim.total_steps = self.total_steps * updates
        cfg.critic.optim.total_steps = self.total_steps * max(
            1, data.train_batch_size // cfg.critic.ppo_mini_batch_size) * cfg.critic.ppo_epochs

        from polyrl.algorithms import get_adv_estimator_fn, get_kl_controller

        self.adv_fn = get_adv_estimator_fn(cfg.algorithm.adv_estimator)
        self.kl_ctrl = get_kl_controller(cfg.algorithm.kl_ctrl) if cfg.algorithm.use_kl_in_reward else None
        self._check_optional_dependencies()
        self.reward_fn = self.build_reward_fn()
        entry = self.pm.entry("advantage_estimator", cfg.algorithm.adv_estimator)
        needs_values = bool(entry.metadata.get("needs_values")) or cfg.algorithm.adv_estimator in _NEEDS_CRITIC
        critic_enable = str(cfg.critic.enable).lower()
        if critic_enable not in ("auto", "true", "false"):
            raise ConfigError(f"critic.enable={cfg.critic.enable!r}: choose auto, true or false")
        if needs_values and critic_enable == "false":
            raise ConfigError(f"algorithm.adv_estimator={cfg.algorithm.adv_estimator} needs a critic's values but "
                              "critic.enable=false: set critic.enable=auto, or choose an estimator without a critic "
                              "(grpo, rloo, ...)")
        self.use_critic = needs_values or critic_enable == "true"
        if self.use_critic and cfg.critic.model.path != cfg.actor.model.path:
            check_model_paths(cfg.critic.model, "critic.model")
        kl_used = cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward
        enable = str(cfg.ref.enable).lower()
        self.use_ref = enable == "true" or (enable == "auto" and kl_used)
        if kl_used and not self.use_ref:
            raise ConfigError("a KL term is configured (actor.use_kl_loss / algorithm.use_kl_in_reward) but ref.enable=false")
        # every role's pool (trainer.placement), checked before any process starts
        self.role_specs = list(self.extra_roles())
        self.placement = plan_placement(cfg, use_ref=self.use_ref, use_critic=self.use_critic,
                                        extra_roles=self.role_specs)
        if self.use_critic:  # the critic engine's layout errors (critic.megatron...) before any worker starts
            self.data_parallel_size("critic")
        if self.use_ref and cfg.ref.plugin_config is not None:  # its own layout (ref.fsdp...) before workers start
            self.data_parallel_size("ref")
        mode = cfg.actor.recompute_old_log_prob
        if mode not in ("auto", "always"):
            raise ConfigError(f"actor.recompute_old_log_prob={mode!r}: choose 'auto' or 'always'")
        # on-policy: the one update pass sees the policy that generated the batch (verl's dp_actor does the same)
        on_policy = single_update_pass(cfg.actor.ppo_epochs, cfg.actor.ppo_mini_batch_size, cfg.data.train_batch_size)
        self.skip_old_log_prob = mode == "auto" and on_policy and not cfg.algorithm.use_kl_in_reward
        estimator_inputs = inspect.signature(self.adv_fn).parameters
        #: Forward products the actor's old-log-prob pass computes for the estimator (``sum_pi_squared``).
        self.old_log_prob_products = self._estimator_products(entry)
        if "old_log_probs" in estimator_inputs or self.old_log_prob_products:  # estimators that read the old policy
            self.skip_old_log_prob = False
        from polyrl.trainer.sample_sources import configure_async_mode, make_rollout_source

        configure_async_mode(self)  # trainer.async_mode: placement checked, TIS on the policy gap (docs/async.md)
        self.rollout_corr = self._configure_rollout_correction()
        self.ckpt = CheckpointManager(self.run_dir, keep=cfg.trainer.max_checkpoints)
        self.global_step = 0
        self.groups: RoleGroups | None = None
        self.rollout_source = make_rollout_source(self)  # where each step's samples come from

    def _estimator_products(self, entry: Any) -> ForwardProducts | None:
        """What the estimator needs beyond rewards and groups (its registration's ``needs_fields``), checked before
        any worker starts: ``sum_pi_squared`` from the actor's log-prob pass (the actor's engine must list it in
        its ``forward_products``), and fields only a plugin trainer produces (:attr:`provides_fields`)."""
        cfg = self.config
        name = cfg.algorithm.adv_estimator
        needs = set(entry.metadata.get("needs_fields") or ())
        products = ForwardProducts(sum_pi_squared="sum_pi_squared" in needs)
        if products:
            self.check_forward_products(products, engine=cfg.actor.engine, key="actor",
                                        needed_by=f"algorithm.adv_estimator={name}")
        made_here = {"old_log_probs", "sum_pi_squared", "values"}
        for field_name in sorted(needs - made_here - set(self.provides_fields)):
            providers = [e.name for e in self.pm.registry("trainer").entries()
                         if field_name in (e.metadata.get("provides_fields") or ())]
            if providers:
                fix = f"use trainer.name={providers[0]}, which does"
            elif field_name in _FIELD_PROVIDERS:
                trainer, dist = _FIELD_PROVIDERS[field_name]
                fix = f"trainer.name={trainer} from {dist} does (pip install {dist})"
            else:
                fix = "no loaded trainer does"
            raise ConfigError(
                f"algorithm.adv_estimator={name} needs the batch field '{field_name}', which trainer.name="
                f"{cfg.trainer.name} does not produce: {fix} (docs/recipes.md)")
        return products or None

    def check_forward_products(self, products: ForwardProducts, *, engine: str, key: str, needed_by: str) -> None:
        """Raise :class:`ConfigError` (naming ``<key>.engine`` and ``needed_by``) unless the engine registered as
        ``engine`` lists every product of ``products`` in its ``forward_products``. Called before workers start
        (:class:`~polyrl.protocols.ForwardProducts`); a plugin trainer checks its own roles' needs with it
        (``key="trainer.distill.teacher"``)."""
        try:
            factory = self.pm.get("engine", engine)
        except LookupError:  # reported with the key by the command's name check
            return
        supported = set(getattr(factory, "forward_products", ()) or ())
        missing = [p for p in products.requested() if p not in supported]
        if missing:
            raise ConfigError(
                f"{needed_by} needs {', '.join(missing)} from the forward pass of {key}.engine={engine}, which does "
                f"not compute it (it lists {sorted(supported) or 'no forward products'}); use an engine that does "
                "(fsdp, megatron; docs/plugins/forward_products.md)")

    def _check_optional_dependencies(self) -> None:
        """What the run uses from polyrl's extras is installed (before any worker starts): the reward functions
        of its data sources (``polyrl[math]``), the agent tools' schema checker (``polyrl[tools]``)."""
        from polyrl.rewards.scoring import check_reward_requirements, reward_function_spec

        sets = [s for s in (self.train_set, self.val_set) if s is not None]
        sources = {row.get("data_source", "") for rows in sets for row in getattr(rows, "rows", ())}
        check_reward_requirements(reward_function_spec(self.config.reward), sources, self.pm)
        if list(self.config.agent.tools):
            from polyrl.tools.function import require_jsonschema

            require_jsonschema()

    def _configure_rollout_correction(self) -> dict[str, Any] | None:
        """verl's ``algorithm.rollout_correction`` (and the old ``tis_imp_ratio_cap``): the settings, copied to
        ``actor.policy_loss.rollout_correction`` for the workers' loss; bypass mode selects the ``bypass_mode`` loss
        and the rollout's log-probs as the old ones. See docs/algorithms.md, "Rollout correction"."""
        from polyrl.algorithms.rollout_correction import needs_whole_batch, rollout_correction_settings

        cfg = self.config
        try:
            settings = rollout_correction_settings(cfg.algorithm.rollout_correction,
                                                   cfg.actor.policy_loss.tis_imp_ratio_cap)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        cfg.actor.policy_loss.rollout_correction = dict(settings or {})
        if settings is None:
            return None
        if settings["bypass_mode"]:
            if cfg.actor.policy_loss.loss_mode not in ("vanilla", "bypass_mode"):
                log.warning("algorithm.rollout_correction.bypass_mode replaces actor.policy_loss.loss_mode=%s by "
                            "bypass_mode (loss_type=%s)", cfg.actor.policy_loss.loss_mode, settings["loss_type"])
            cfg.actor.policy_loss.loss_mode = "bypass_mode"
            self.skip_old_log_prob = True
        elif needs_whole_batch(settings):
            self.skip_old_log_prob = False
        return settings

    # ------------------------------------------------------------------ what a plugin trainer may replace
    def build_tokenizer(self) -> Any:
        """The text tokenizer of the actor model (datasets and reward managers use it); may be ``None``."""
        from transformers import AutoTokenizer

        cfg = self.config
        check_model_paths(cfg.actor.model, "actor.model")  # before transformers retries an unreachable Hub
        return AutoTokenizer.from_pretrained(cfg.actor.model.tokenizer_path or cfg.actor.model.path)

    def build_datasets(self) -> tuple[Any, Any]:
        """``(train_set, val_set or None)``: sequences of verl-format rows, each with a ``uid``."""
        from polyrl.data import RLDataset

        data = self.config.data
        processor = self.build_processor()

        from polyrl.data.dataset import RowColumns

        def load(files: Any) -> Any:
            return RLDataset(list(files), self.tokenizer, max_prompt_length=data.max_prompt_length,
                             truncation=data.truncation, chat_template=data.apply_chat_template,
                             columns=RowColumns.from_config(data),
                             chat_template_kwargs=dict(data.apply_chat_template_kwargs), processor=processor,
                             image_key=data.image_key, on_bad_row=data.on_bad_row)

        return load(data.train_files), (load(data.val_files) if data.val_files else None)

    def build_processor(self) -> Any:
        """The actor model's multimodal processor (images into the prompt; :mod:`polyrl.data.multimodal`), or
        ``None`` for a text-only model."""
        from polyrl.data.multimodal import load_processor

        model = self.config.actor.model
        try:
            return load_processor(model.tokenizer_path or model.path, trust_remote_code=model.trust_remote_code)
        except ValueError as exc:
            raise ConfigError(f"actor.model.path={model.path}: {exc}") from None

    def build_reward_fn(self) -> Any:
        """The reward manager: ``batch -> RewardOutput`` (``reward.manager`` with ``reward.function``); with a
        reward model (``reward_model.enable``) or a ``reward.combine`` set, the components combined
        (:class:`polyrl.rewards.combine.RewardComposer`, docs/reward_models.md)."""
        from polyrl.rewards import load_compute_score

        cfg = self.config
        compute_score = load_compute_score(cfg.reward)  # reward.function or verl's custom_reward_function
        self._configure_code_rewards()
        manager = self.pm.get("reward_manager", cfg.reward.manager)
        rule = manager(tokenizer=self.tokenizer, compute_score=compute_score, config=cfg.reward)
        combine = cfg.reward.combine
        if not cfg.reward_model.enable and not (combine.weights or combine.per_data_source or combine.mode != "sum"):
            return rule
        from polyrl.reward_models.scorer import RewardModelScorer, check_reward_model
        from polyrl.rewards.combine import RewardComposer
        from polyrl.rewards.scoring import has_reward_function

        models = []
        if cfg.reward_model.enable:
            rm_tokenizer = check_reward_model(cfg, self.pm, self.tokenizer)
            models.append(RewardModelScorer(cfg, policy_tokenizer=self.tokenizer, rm_tokenizer=rm_tokenizer,
                                            plugins=self.pm, group=lambda: self.groups and self.groups.reward_model))
        return RewardComposer(rule=rule, models=models, combine=combine, fallback_score=cfg.reward.fallback_score,
                              has_rule_for=lambda source: has_reward_function(cfg.reward, source))

    def _configure_code_rewards(self) -> None:
        """The ``code`` reward runs in ``reward.sandbox``; its sandbox is checked now (one line, before any worker
        starts) when the run scores code or names a SandboxFusion server."""
        from polyrl.rewards.code import configure_code_rewards, uses_code_rewards

        reward = self.config.reward
        sources = {row.get("data_source", "") for data in (self.train_set, self.val_set) if data is not None
                   for row in data}
        configure_code_rewards(reward, self.pm, check=bool(reward.sandbox_fusion.url)
                               or uses_code_rewards(reward, sources))

    def extra_roles(self) -> list[RoleSpec]:
        """Roles beyond actor / rollout / ref / critic that this run starts: ``reward_model`` when
        ``reward_model.enable`` (docs/reward_models.md). A plugin trainer adds its own (``teacher``) to what this
        returns (docs/plugins/roles.md)."""
        if not self.config.reward_model.enable:
            return []
        from polyrl.reward_models.scorer import reward_model_spec

        return [reward_model_spec(self.config)]

    def before_advantage(self, batch: TensorDict, metrics: dict[str, float]) -> TensorDict:
        """Called each step after the rewards (``token_level_rewards``, KL-in-reward applied), old / reference
        log-probs and values are in ``batch``, just before the advantage estimator runs; returns the batch the
        estimator gets. Add fields the estimator reads (it gets every tensor field its signature names: ReMax's
        ``reward_baselines``), change the rewards (PRIME's implicit process rewards), or train a model on the
        batch. Record metrics in ``metrics``. The default returns ``batch`` unchanged."""
        return batch

    def after_advantage(self, batch: TensorDict, metrics: dict[str, float]) -> TensorDict:
        """Called each step once ``advantages`` and ``returns`` are in ``batch``, before the critic and actor
        updates; returns the batch they train on: filter or re-weight rows (PF-PPO resamples them by reward; keep
        the row count a multiple of the data-parallel size), add fields a loss reads. The default returns
        ``batch`` unchanged."""
        return batch

    def check_rewards(self) -> None:
        """Refuse (one ConfigError) a data file none of whose first rows can reach a reward function: no function
        for its data source, or no ground truth where the function reads one (:mod:`polyrl.rewards.reachability`).
        Runs first in ``__init__``, before the tokenizer loads. A plugin trainer whose rewards are not verl reward
        functions replaces it."""
        from polyrl.data.dataset import RowColumns, head_rows
        from polyrl.rewards.reachability import SAMPLE_ROWS, check_rewards_reachable

        cfg = self.config
        if cfg.reward_model.enable and not _combines_rule(cfg.reward.combine):
            return  # the reward model scores every sample; the reward function only adds acc where it can
        columns = RowColumns.from_config(cfg.data)
        for key in ("val_files", "train_files"):
            for file in getattr(cfg.data, key):  # each file on its own: one data source each, usually
                rows = [columns.normalize(r, str(file), i) for i, r in enumerate(head_rows(file, SAMPLE_ROWS, self.pm))]
                check_rewards_reachable(rows, cfg.reward, cfg.data, source=f"data.{key} ({file})", plugins=self.pm)

    def check_placement(self) -> None:
        """The start-up checks :meth:`fit` makes before workers start, without starting them (``--dry-run``): the
        platform ``trainer.device`` names exists, the placement and the rollout's tensor-parallel replicas fit the
        workers, and a local run's accelerators suffice for the workers."""
        from polyrl.controller.cluster import cluster_address
        from polyrl.platforms import select_platform

        cfg = self.config
        trainer = cfg.trainer
        # the pools and the rollout's replicas were resolved and checked in __init__ (plan_placement)
        placement = self.placement
        local = trainer.executor == "local"
        choice = select_platform(trainer.device, self.pm)  # logs the choice: after the checks that cannot log
        if not local and not placement.shares("actor", "rollout"):
            from polyrl.trainer.weight_sync import resolve_weight_transfer

            resolve_weight_transfer(cfg, choice.platform)
        platform = choice.platform
        if local or cluster_address(cfg) or not platform.ray_resource:
            return
        needed = placement.total_workers
        have = int(platform.device_count())
        if needed > have:
            raise ConfigError(f"trainer.placement: the pools ({placement.describe()}) need {needed} {choice.name} "
                              f"devices; this machine has {have}. Lower the pool sizes (trainer.n_workers, "
                              "trainer.rollout_workers, trainer.pools; verl: trainer.n_gpus_per_node), or join a "
                              "cluster (trainer.ray_address)")

    def batch_metrics(self, batch: TensorDict) -> dict[str, float]:
        """Scores, advantages, lengths and KL of a trained batch (``critic/*``, ``response_length/*``...)."""
        return _batch_metrics(batch)

    def balance_lengths(self, batch: TensorDict) -> list[int] | None:
        """The per-row cost that ``trainer.balance_batch`` evens out over data-parallel ranks (tokens);
        ``None`` disables balancing."""
        if "attention_mask" not in batch.keys():
            return None
        return batch["attention_mask"].sum(-1).tolist()

    def throughput_metrics(self, batch: TensorDict, timing: dict[str, float]) -> dict[str, float]:
        """``throughput/*``: tokens per second of the whole step and of generation."""
        tokens = float(batch["attention_mask"].sum())
        return {
            "throughput/tokens_per_s": tokens / max(timing["step"], 1e-9),
            "throughput/gen_tokens_per_s": float(batch["response_mask"].sum()) / max(timing["gen"], 1e-9),
        }

    def data_parallel_size(self, section: str = "actor") -> int:
        """The data-parallel size of a role's group: its pool's size (``trainer.n_workers`` for the actor)
        unless the role's engine factory says otherwise (``data_parallel_size(role_config, world_size)``: tensor / pipeline parallel engines)."""
        cfg = self.config
        world = cfg.trainer.n_workers if cfg.trainer.executor == "ray" else 1
        placement = getattr(self, "placement", None)
        if placement is not None and section != "actor":  # the role's own pool (trainer.placement)
            world = placement.size_of(section)
        if section == "ref":  # the actor's config with the ref's own options (what the workers build it from)
            from polyrl.trainer.role_worker import ref_role_config

            role = ref_role_config(cfg)
        else:
            role = getattr(cfg, section)
        try:
            factory = self.pm.get("engine", role.engine)
        except LookupError:  # reported with the key by the command's name check
            return world
        size_of = getattr(factory, "data_parallel_size", None)
        if size_of is None:
            return world
        try:  # a factory taking ``role=`` names the role's own keys (critic.megatron...) in its errors
            named = "role" in inspect.signature(size_of).parameters
        except (TypeError, ValueError):
            named = False
        return int(size_of(role, world, role=section) if named else size_of(role, world))

    # ------------------------------------------------------------------ set-up
    def _check_config(self) -> None:
        from polyrl.tracking import check_loggers

        cfg = self.config
        check_loggers(cfg.trainer.logger)  # every logger's package, before the run opens them at its first step
        if cfg.data.train_batch_size % cfg.actor.ppo_mini_batch_size:
            raise ConfigError(
                f"data.train_batch_size={cfg.data.train_batch_size} must be a multiple of "
                f"actor.ppo_mini_batch_size={cfg.actor.ppo_mini_batch_size}"
            )
        dp = self.data_parallel_size("actor")
        self.dp_size = dp
        rows = cfg.actor.ppo_mini_batch_size * cfg.rollout.n
        if rows % dp:
            world = cfg.trainer.n_workers if cfg.trainer.executor == "ray" else 1
            raise ConfigError(
                f"actor.ppo_mini_batch_size * rollout.n = {rows} rows must divide over the actor's {dp} data-parallel "
                f"ranks (trainer.n_workers={world} divided by the engine's model-parallel size)"
            )
        if cfg.rollout.response_length != cfg.data.max_response_length:
            cfg.rollout.response_length = cfg.data.max_response_length
        cfg.rollout.prompt_length = cfg.data.max_prompt_length

    def _select_platform(self) -> Any:
        """Choose the platform every worker binds (``trainer.device`` resolved); nothing is written yet."""
        from polyrl.platforms import select_platform

        choice = select_platform(self.config.trainer.device, self.pm)  # logged; raises if a named one is absent
        self.config.trainer.device = choice.name  # every worker binds the platform chosen (and recorded) here
        return choice

    def _write_run_files(self, platform_choice: Any) -> None:
        """The resolved config, a manifest pinning every loaded plugin distribution (for reruns) and the
        platform record. Written only once a resume was accepted, so a refused one leaves the run's files as
        they were."""
        (self.run_dir / "config.yaml").write_text(to_yaml(self.config))
        loaded = sorted({(p["distribution"], p["version"]) for p in self.pm.describe()
                         if p["distribution"] and p["distribution"] != "polyrl"})
        lock = Manifest(
            require=tuple(f"{d}=={v}" for d, v in loaded),
            modules=self.manifest.modules if self.manifest else (),
            block=self.manifest.block if self.manifest else (),
        )
        (self.run_dir / "manifest.lock.toml").write_text(lock.to_toml())
        platform_choice.write(self.run_dir)  # platform.json: the platform, why, and what each probe answered

    def sampling_params(self, validate: bool = False) -> SamplingParams:
        """How the rollout samples this step (``rollout.*``; one seed per step) or, with ``validate``, for
        validation (``rollout.val_*``, one sample per prompt)."""
        r = self.config.rollout
        if validate:
            return SamplingParams(temperature=r.val_temperature, top_p=r.val_top_p, top_k=-1,
                                  max_new_tokens=r.response_length, n=1, stop_token_ids=list(r.stop_token_ids),
                                  seed=self.config.trainer.seed)
        return SamplingParams(
            temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, max_new_tokens=r.response_length, n=1,
            stop_token_ids=list(r.stop_token_ids),
            # One seed per step: a resumed run samples exactly what an uninterrupted run would.
            seed=self.config.trainer.seed * 1_000_003 + self.global_step,
        )

    # ------------------------------------------------------------------ the loop
    def phase(self, name: str, kind: str = "worker_call", *, role: str = "") -> Any:
        """A context manager running its body as phase ``name`` of a step, under the deadline of ``kind``
        (``trainer.phase_timeouts.<kind>``, else ``trainer.phase_timeout_s``; :mod:`polyrl.controller.deadlines`).
        A plugin trainer wraps its own phases in it (``with self.phase("images", "generation", role="rollout")``)."""
        from polyrl.controller.deadlines import phase, phase_seconds

        return phase(name, phase_seconds(self.config.trainer, kind), kind=kind, role=role)

    def fit(self) -> dict[str, float]:
        """Train for ``total_steps``; returns the last validation metrics (or the last step's).

        Ctrl-C stops after the step in progress (a checkpoint of it is saved when the run saves checkpoints), a
        second Ctrl-C aborts (:mod:`polyrl.trainer.interrupt`); a run that already reached ``total_steps`` says
        so and returns at once. Either way the run ends with a summary (:mod:`polyrl.trainer.summary`).
        """
        from polyrl.tracking import Tracker
        from polyrl.trainer.interrupt import StopAtStepBoundary

        cfg = self.config
        started = time.perf_counter()
        # one run per directory: the lock is held until fit() returns, and dropped by the kernel if we die
        self._lock = RunDirLock(prepare_run_dir(cfg.trainer.run_dir)).acquire()
        try:
            setup_run_logging(self.run_dir)  # RUN_DIR/train.log, appended on resume
            resume_from = self._resume_point()
            if resume_from is not None and read_state(resume_from)["global_step"] >= self.total_steps:
                return self._already_finished(resume_from)  # nothing to train: no worker, no Ray
        except BaseException:
            self._lock.release()
            raise
        last_val: dict[str, float] = {}
        metrics: dict[str, float] = {}
        history: list[dict[str, float]] = []
        with StopAtStepBoundary("the set-up") as stop:
            try:
                platform_choice = self._select_platform()
                self.groups = build_role_groups(cfg, manifest=self.manifest, use_ref=self.use_ref,
                                                worker_cls=self.worker_cls, use_critic=self.use_critic,
                                                run_dir=self.run_dir, extra_roles=self.role_specs)
                if resume_from is not None:
                    # the engines check the checkpoint (engine, model, world size) before any run file changes
                    self._load(resume_from)
                    self._drop_later_metrics(resume_from)
                self._write_run_files(platform_choice)
                tracker = Tracker(cfg.trainer.logger, self.run_dir, project=cfg.trainer.project_name,
                                  experiment=cfg.trainer.experiment_name, config=record_dict(cfg),
                                  resume=resume_from is not None)
            except BaseException:
                if self.groups is not None:
                    self.groups.shutdown()
                self._lock.release()
                raise
            try:
                if resume_from is None:
                    with self.phase("weight_sync", "weight_sync", role="actor -> rollout"):
                        self.groups.sync_weights()
                if self.val_set is not None and cfg.trainer.val_before_train and resume_from is None:
                    last_val = self._run_validation()
                    tracker.log(last_val, self.global_step)
                    history.append({"step": self.global_step, **last_val})
                    self._keep_validation(tracker)
                    self._write_report(live=True)
                failed_steps = 0
                bar = _progress(cfg.trainer.progress_bar, self.total_steps, self.global_step)
                profiler = self._step_profiler()
                self.rollout_source.start()
                while self.global_step < self.total_steps and not stop.requested:
                    stop.what = f"step {self.global_step + 1}"
                    metrics = self._profiled_step(profiler)  # self.step(), recorded when trainer.profile asks
                    self.global_step += 1
                    is_last = self.global_step >= self.total_steps
                    if self.val_set is not None and cfg.trainer.test_freq and (
                        self.global_step % cfg.trainer.test_freq == 0 or is_last
                    ):
                        t_val = time.perf_counter()
                        last_val = self._run_validation()
                        metrics.update(last_val)
                        metrics["timing/validate"] = time.perf_counter() - t_val  # not in timing/step
                    # metrics first: a checkpoint at step N implies N's metrics line exists (resume re-runs the rest)
                    tracker.log(metrics, self.global_step)
                    history.append({"step": self.global_step, **metrics})
                    self._keep_validation(tracker)
                    fault_point("metrics", self.global_step)
                    self._refresh_report(metrics, is_last)
                    failed_steps = failed_steps + 1 if metrics.get("reward/all_failed", 0.0) >= 1.0 else 0
                    self._check_failed_rewards(failed_steps)
                    due = self.global_step % cfg.trainer.save_freq == 0 or is_last if cfg.trainer.save_freq > 0 else False
                    if due or (stop.requested and cfg.trainer.save_freq > 0):  # Ctrl-C: keep the step just trained
                        self.save()
                    if bar is not None:
                        bar.update(1)
                        bar.set_postfix({k: f"{metrics[k]:.3f}" for k in ("critic/score/mean",) if k in metrics})
                if bar is not None:
                    bar.close()
            finally:
                try:
                    self.rollout_source.stop()
                    tracker.close()
                    self._write_report(live=False)
                    self.groups.shutdown()
                finally:
                    self._lock.release()
        stopped = stop.requested and self.global_step < self.total_steps
        if stopped:
            from polyrl.trainer.interrupt import record_stop

            record_stop()
        self._log_summary("stopped" if stopped else "finished", time.perf_counter() - started, history)
        return {**metrics, **last_val}

    def _already_finished(self, checkpoint: Path) -> dict[str, float]:
        """A run started again after it reached ``total_steps``: say so, summarise, train nothing."""
        from polyrl.trainer.summary import log_run_end, metrics_rows

        self.global_step = int(read_state(checkpoint)["global_step"])
        try:
            rows = metrics_rows(self.run_dir, list(self.config.trainer.logger), [])
            log_run_end(verb="train", state="already finished", step=self.global_step, total=self.total_steps,
                        seconds=None, run_dir=self.run_dir, checkpoint=checkpoint, rows=rows)
        finally:
            self._lock.release()
        last = dict(rows[-1]) if rows else {}
        last.pop("time", None)
        last.pop("step", None)
        return last

    def _log_summary(self, state: str, seconds: float | None, history: list[dict[str, float]]) -> None:
        from polyrl.trainer.summary import log_run_end, metrics_rows

        try:
            checkpoint = self.ckpt.latest(verify=False)  # the newest one, just written by this run
        except Exception:  # the summary never hides how the run ended
            checkpoint = None
        log_run_end(verb="train", state=state, step=self.global_step, total=self.total_steps, seconds=seconds,
                    run_dir=self.run_dir, checkpoint=checkpoint,
                    rows=metrics_rows(self.run_dir, list(self.config.trainer.logger), history))

    # ------------------------------------------------------------------ generations and reward failures
    def _dump_dir(self, kind: str) -> Path | None:
        """Where ``kind`` (``train`` / ``validation``) generations go (``trainer.rollout_data_dir`` /
        ``trainer.validation_data_dir``); None when off."""
        from polyrl.trainer.generations import resolve_dir

        trainer = self.config.trainer
        if kind == "train":
            return resolve_dir(trainer.rollout_data_dir, self.run_dir, "generations/train")
        return resolve_dir(trainer.validation_data_dir, self.run_dir, "generations/validation")

    def generation_rows(self, batch: TensorDict, *, step: int, kind: str, keep: list[bool] | None = None) -> list[dict]:
        """The JSON rows of what ``batch`` holds (:func:`polyrl.trainer.generations.generation_rows`); a plugin trainer
        whose samples are not text (images) replaces it."""
        from polyrl.trainer.generations import generation_rows

        return generation_rows(batch, self.tokenizer, step=step, kind=kind, keep=keep)

    def record_validation(self, batch: TensorDict, keep: list[bool] | None = None) -> None:
        """Called by :meth:`validate` with each scored validation batch (``keep``: False for padding rows); the rows
        are written and shown in the trackers once the validation ends."""
        if self._dump_dir("validation") is None and not self.config.trainer.log_val_generations:
            return
        self._val_rows = getattr(self, "_val_rows", [])
        self._val_rows += self.generation_rows(batch, step=self.global_step, kind="validation", keep=keep)

    def write_validation_media(self, rows: list[dict], directory: Path, step: int) -> None:
        """Files beside a validation's JSONL (none for text; polyrl-diffusion writes a PNG grid of the images)."""

    def _run_validation(self) -> dict[str, float]:
        """:meth:`validate`, its generations collected afresh (see :meth:`record_validation`)."""
        self._val_rows = []
        with self.phase("validation", "validation", role="rollout"):
            return self.validate()

    def _keep_validation(self, tracker: Any) -> None:
        """Write the last validation's generations (JSONL, media) and log the first ``log_val_generations`` rows as a
        table to the trackers."""
        rows, self._val_rows = getattr(self, "_val_rows", []), []
        if not rows:
            return
        directory = self._dump_dir("validation")
        if directory is not None:
            write_jsonl(directory / f"{self.global_step}.jsonl", rows)
            self.write_validation_media(rows, directory, self.global_step)
        if self.config.trainer.log_val_generations:
            tracker.log_generations(rows[: self.config.trainer.log_val_generations], self.global_step)

    def _check_failed_rewards(self, failed_steps: int) -> None:
        """Stop the run when ``reward/all_failed`` held for ``reward.max_failed_steps`` steps in a row."""
        limit = self.config.reward.max_failed_steps
        if not limit or failed_steps < limit:
            return
        from polyrl.errors import RewardError

        last = self.ckpt.latest()
        kept = f"the last checkpoint ({last}) is kept as it was" if last else "no checkpoint was written"
        raise RewardError(
            f"every sample's reward call failed for {failed_steps} steps in a row (steps "
            f"{self.global_step - failed_steps + 1}-{self.global_step}, reward/all_failed): stopping "
            f"(reward.max_failed_steps={limit}); {kept}. Fix the reward function (its error is in the warnings above "
            f"and in {self.run_dir / 'train.log'}), then run again to resume")

    def _step_profiler(self) -> Any:
        """The driver's side of ``trainer.profile`` (None when no step is to be recorded)."""
        from polyrl.profiling import StepProfiler

        prof = self.config.trainer.profile
        steps = [s for s in self.profile_steps if s > self.global_step]  # a resumed run records what is left
        if not steps:
            return None
        return StepProfiler(self.groups.distinct(), self.run_dir, steps, memory=prof.memory,
                            with_stack=prof.with_stack)

    def _profiled_step(self, profiler: Any) -> dict[str, float]:
        """:meth:`step`, with every worker process recording it when it is one of ``trainer.profile.steps``."""
        step = self.global_step + 1
        if profiler is None or not profiler.wants(step):
            return self.step()
        profiler.start(step)
        try:
            return self.step()
        finally:
            written = profiler.stop()
            log.info("step %d profiled: %d trace files in %s", step, len(written), self.run_dir / "profile" / f"step_{step}")

    def _refresh_report(self, metrics: dict[str, float], is_last: bool) -> None:
        """Rewrite the live report after a validation and every ``trainer.report_freq`` steps (the final one is
        written when the run ends)."""
        freq = self.config.trainer.report_freq
        validated = any(k.startswith("val/") for k in metrics)
        if freq and not is_last and (validated or self.global_step % freq == 0):
            self._write_report(live=True)

    def _write_report(self, *, live: bool) -> None:
        """``RUN_DIR/report.html`` (``polyrl view``), unless ``trainer.report_freq=0``; a failure to write it
        is one warning, after which the run goes on without it (polyrl.report.ReportWriter)."""
        if not self.config.trainer.report_freq or "jsonl" not in self.config.trainer.logger:
            return
        if getattr(self, "_report", None) is None:
            from polyrl.report import ReportWriter

            self._report = ReportWriter(self.run_dir)  # reads only the new metrics lines at each rewrite
        self._report.write(live=live)

    def _resume_point(self) -> Path | None:
        """The checkpoint to continue from: intact (files verified) and trained with this config."""
        resume_from = resolve_resume(self.config.trainer.resume, self.ckpt)
        if resume_from is None:
            return None
        state = read_state(resume_from)
        self._check_resume_config(state, resume_from)
        return resume_from

    def _drop_later_metrics(self, resume_from: Path) -> None:
        step = read_state(resume_from)["global_step"]
        dropped = truncate_metrics(self.run_dir, step)
        if dropped:
            log.info("dropped %d metrics lines logged after step %d by the interrupted run; those steps run again",
                     dropped, step)

    def _check_resume_config(self, state: dict[str, Any], path: Path) -> None:
        """Refuse to resume with a config that differs from the checkpoint's, except in keys the user allowed
        (``trainer.resume_override``); those new values apply from the resumed step on."""
        saved = state.get("config")
        if saved is None:  # a checkpoint from before configs were stored
            log.warning("checkpoint %s stores no config; resuming without checking that the config is unchanged", path)
            return
        allowed = list(self.config.trainer.resume_override)
        # one rank either way: a run saved under `ray` (the default before `auto`) resumes under `local`
        implicit = ["trainer.executor"] if self.config.trainer.n_workers == 1 else []
        # a key read from the environment is recorded as its ${oc.env:...} text (checkpoints of older polyrl
        # versions hold the value): it differs only when it differs both ways
        resolved = {k for k, _, _ in config_differences(saved, to_dict(self.config), allowed + implicit)}
        diffs = [d for d in config_differences(saved, record_dict(self.config), allowed + implicit) if d[0] in resolved]
        if diffs:
            shown = "; ".join(f"{k}: {old!r} -> {new!r}" for k, old, new in diffs[:10])
            more = f" (and {len(diffs) - 10} more)" if len(diffs) > 10 else ""
            keys = ",".join(k for k, _, _ in diffs)
            raise ConfigError(
                f"trainer.resume: the config differs from the one checkpoint {path} was trained with: {shown}{more}. "
                f"Resume with the same values, allow the change with trainer.resume_override=[{keys}], or start a new "
                "run (another trainer.run_dir, or trainer.resume=disable)."
            )
        changed = [k for k, _, _ in config_differences(saved, record_dict(self.config), implicit)]
        if changed:
            log.warning("resuming with changed config keys (allowed by trainer.resume_override): %s", ", ".join(changed))

    def next_rows(self) -> list[dict]:
        """The next ``data.train_batch_size`` prompt rows from the data loader (a new epoch starts when one ends).
        A plugin trainer may override it to annotate the rows (calling ``super().next_rows()``)."""
        try:
            return next(self._iter)
        except (AttributeError, StopIteration):
            self._iter = iter(self.loader)
            return next(self._iter)

    def step(self) -> dict[str, float]:
        """One PPO/GRPO step; returns its metrics."""
        cfg = self.config
        groups = self.groups
        timing: dict[str, float] = {}
        t_step = time.perf_counter()
        n = cfg.rollout.n

        # prompts -> agent loops -> rollout.generate -> reward manager (with DAPO's group filter)
        kept: list[TensorDict] = []
        kept_groups = 0
        gen_rounds = 0
        filter_cfg = cfg.algorithm.filter_groups
        reward_metrics: dict[str, list[float]] = defaultdict(list)
        while True:
            gen_rounds += 1
            with _timer(timing, "gen"), self.phase("generation", "generation", role="rollout"):  # async: the wait
                # sync: self.generate_batch(self.next_rows(), n, ...); fully_async takes only the groups still missing
                batch = self.rollout_source.next_batch(cfg.data.train_batch_size - kept_groups)
            with _timer(timing, "reward"), self.phase("reward", "reward", role="reward"):
                out = self.reward_fn(batch)
            batch["token_level_scores"] = out.token_level_scores.float()
            if self._dump_dir("train") is not None:  # the reward's extra columns ride along for the dump
                batch_ops.set_non_tensor(batch, "reward_extra", reward_extras(out.extra, batch.batch_size[0]))
            fold_tool_rewards(batch, cfg.agent)  # tools' ToolResult.reward, as agent.tool_reward says
            for k, v in out.metrics.items():
                reward_metrics[k].append(float(v))
            for key in ("acc", "score", *cfg.algorithm.gdpo_reward_keys):  # GDPO reads its reward components
                if key in out.extra:
                    batch[f"_{key}"] = torch.tensor([float(x) if x is not None else 0.0 for x in out.extra[key]])
            if not filter_cfg.enable:
                kept = [batch]
                kept_groups = batch.batch_size[0] // n
                break
            if "episode_end" in batch.keys():
                raise ConfigError("algorithm.filter_groups needs n rows per prompt; a step-wise agent loop gives an "
                                  "episode one row per step: set algorithm.filter_groups.enable=false")
            batch, groups_left = _filter_groups(batch, filter_cfg.metric, n)
            if groups_left:
                kept.append(batch)
                kept_groups += groups_left
            if kept_groups >= cfg.data.train_batch_size or (
                filter_cfg.max_num_gen_batches and gen_rounds >= filter_cfg.max_num_gen_batches
            ):
                break
        fault_point("gen", self.global_step + 1)
        batch = batch_ops.concat(kept) if len(kept) > 1 else kept[0]
        if filter_cfg.enable:
            batch = _fit_to_groups(batch, cfg.data.train_batch_size, n, groups.actor.dp_size("update_actor"),
                                   cfg.actor.ppo_mini_batch_size)
        metrics: dict[str, float] = {"train/gen_rounds": float(gen_rounds)}
        metrics.update({k: float(np.mean(v)) for k, v in reward_metrics.items()})
        world = groups.actor.dp_size("update_actor")
        lengths = self.balance_lengths(batch) if cfg.trainer.balance_batch and world > 1 else None
        if lengths is not None:  # every data-parallel rank about the same tokens, groups kept whole
            order, imbalance = batch_ops.balanced_order(lengths, batch_ops.non_tensor(batch, "uid"), world)
            batch = batch[torch.tensor(order)]
            metrics["batch/rank_tokens_max_over_mean"] = imbalance

        # old log-probs (actor) -> ref log-probs -> values (critic)
        if self.rollout_corr is not None and self.rollout_corr["bypass_mode"]:
            batch_ops.require_fields(batch, ["rollout_log_probs"], "algorithm.rollout_correction.bypass_mode")
            batch["old_log_probs"] = batch["rollout_log_probs"]  # bypass: the rollout's log-probs are the old ones
        # more rows than prompts x n (a step-wise loop's step rows) make more than one mini-batch: off-policy
        if not self.skip_old_log_prob or batch.batch_size[0] > cfg.data.train_batch_size * n:
            with _timer(timing, "old_log_prob"), self.phase("old_log_prob", role="actor"):
                products = {"products": self.old_log_prob_products} if self.old_log_prob_products else {}
                old = groups.actor.dispatch("compute_log_prob", batch_ops.engine_fields(batch), **products)
            batch["old_log_probs"] = old["log_probs"]
            for key in self.old_log_prob_products.output_keys() if self.old_log_prob_products else ():
                batch[key] = old[key]
            mask = batch["response_mask"].float()
            metrics["actor/entropy_rollout"] = float(masked_mean(old["entropy"], mask))
            if "rollout_log_probs" in batch.keys():
                diff = (batch["rollout_log_probs"] - batch["old_log_probs"]).abs()
                metrics["rollout/logprob_diff_mean"] = float(masked_mean(diff, mask))
        if self.use_ref:
            with _timer(timing, "ref"), self.phase("ref_log_prob", role="ref"):
                batch["ref_log_prob"] = groups.ref.dispatch("compute_ref_log_prob", batch_ops.engine_fields(batch))[
                    "log_probs"]
        if self.use_critic:
            with _timer(timing, "values"), self.phase("values", role="critic"):
                batch["values"] = groups.critic.dispatch("compute_values", batch_ops.engine_fields(batch))["values"]

        # rewards (KL in reward) -> advantage estimator
        with _timer(timing, "adv"):
            if self.kl_ctrl is not None:
                from polyrl.algorithms import apply_kl_penalty

                rewards, kl_metrics = apply_kl_penalty(
                    batch["token_level_scores"], batch["old_log_probs"], batch["ref_log_prob"], batch["response_mask"],
                    self.kl_ctrl, cfg.algorithm.kl_penalty,
                )
                batch["token_level_rewards"] = rewards
                metrics.update(kl_metrics)
            else:
                batch["token_level_rewards"] = batch["token_level_scores"]
            if self.rollout_corr is not None and not self.rollout_corr["bypass_mode"] and "old_log_probs" in batch.keys():
                from polyrl.algorithms.rollout_correction import apply_rollout_correction

                metrics.update(apply_rollout_correction(batch, self.rollout_corr))  # weights; RS narrows the mask
            batch = self.before_advantage(batch, metrics)
            from polyrl.algorithms.advantages import estimator_batch_kwargs

            extra = {**estimator_batch_kwargs(self.adv_fn, batch, cfg.algorithm.gdpo_reward_keys),
                     **dict(cfg.algorithm.extra)}
            if self.use_critic:
                extra["values"] = batch["values"]
            advantages, returns = self.adv_fn(
                token_level_rewards=batch["token_level_rewards"], response_mask=batch["response_mask"],
                index=np.array(batch_ops.non_tensor(batch, "uid"), dtype=object), config=cfg.algorithm, **extra,
            )
            batch["advantages"], batch["returns"] = advantages, returns
            batch = self.after_advantage(batch, metrics)

        # critic update -> actor update
        tensors = batch_ops.engine_fields(batch)
        if self.use_critic:
            with _timer(timing, "update_critic"), self.phase("update_critic", role="critic"):
                metrics.update(_mean_of(groups.critic.dispatch("update_critic", tensors)))
        if not self.use_critic or self.global_step >= cfg.critic.warmup_steps:
            with _timer(timing, "update_actor"), self.phase("update_actor", role="actor"):
                metrics.update(_mean_of(groups.actor.dispatch("update_actor", tensors)))

        fault_point("update", self.global_step + 1)
        # weights_for_rollout -> rollout.update_weights
        with _timer(timing, "weight_sync"), self.phase("weight_sync", "weight_sync", role="actor -> rollout"):
            self.rollout_source.push_weights()  # sync: groups.sync_weights()

        metrics.update(self.rollout_source.end_step(self.global_step + 1, batch))  # async: staleness, sample ids
        directory = self._dump_dir("train")
        if directory is not None:  # what was trained, token for token (trainer.rollout_data_dir)
            write_jsonl(directory / f"{self.global_step + 1}.jsonl",
                        self.generation_rows(batch, step=self.global_step + 1, kind="train"))
        with self.phase("memory_stats"):
            metrics.update(groups.memory_metrics())  # perf/<group>/...: each worker group's Platform.memory_stats
        metrics.update(self.batch_metrics(batch))
        metrics.update(agent_metrics(batch))
        timing["step"] = time.perf_counter() - t_step
        metrics.update({f"timing/{k}": v for k, v in timing.items()})
        metrics.update(self.throughput_metrics(batch, timing))
        if self.kl_ctrl is not None:
            self.kl_ctrl.update(metrics.get("actor/reward_kl_penalty", 0.0), n_steps=batch.batch_size[0])
        return metrics

    def generate_batch(self, rows: list[dict], n: int, *, validate: bool,
                       sampling: SamplingParams | None = None) -> TensorDict:
        """``n`` samples of each of ``rows`` from the rollout group (:meth:`sampling_params`, or ``sampling``), with
        the row fields the reward manager reads (``uid``, ``data_source``, ``ground_truth``, ``extra_info``).

        Called with ``sampling`` during a step it is an *extra generation request* on the current weights (ReMax's
        greedy baselines: ``sampling=self.sampling_params().replace(temperature=0.0)``); the rollout frees its
        memory after it, as after the step's own generation."""
        samples = [row for row in rows for _ in range(n)]
        batch = self.groups.generate(samples, sampling if sampling is not None else self.sampling_params(validate))
        # a step-wise agent loop gives a sample several rows (polyrl.trainer.step_rows)
        samples, ids = expand_to_rows(batch, samples, sample_ids(rows, n))
        batch_ops.set_non_tensor(batch, "uid", [s["uid"] for s in samples])
        batch_ops.set_non_tensor(batch, "data_source", [s.get("data_source", "") for s in samples])
        batch_ops.set_non_tensor(batch, "ground_truth", [(s.get("reward_model") or {}).get("ground_truth") for s in samples])
        batch_ops.set_non_tensor(batch, "extra_info", [s.get("extra_info") or {} for s in samples])
        batch_ops.set_non_tensor(batch, "raw_prompt", [json.dumps(s.get("prompt")) for s in samples])  # a reward model re-templates it
        if "sample_id" not in batch.keys():
            batch_ops.set_non_tensor(batch, "sample_id", ids)
        return batch if validate else pad_step_rows(batch, step_row_divisor(self.config, self.use_critic))

    def pad_rows(self, rows: list[dict]) -> list[dict]:
        """``rows`` followed by copies of the last one, marked ``_pad: True``, up to a multiple of the rollout
        ranks, so that every rank generates an equal share (validation batches of any size); leave out the
        results of the marked rows."""
        extra = (-len(rows)) % self.groups.rollout.world_size
        return rows + [dict(rows[-1], _pad=True) for _ in range(extra)]

    # ------------------------------------------------------------------ validation
    def validate(self) -> dict[str, float]:
        """mean@1 (and pass@k with ``rollout.val_n > 1``) per data source on the validation set: of the reward
        function's ``acc`` when it returns one, else of the score, tools' and agent programs' rewards included as
        ``agent.tool_reward`` folds them into training's (verl's ``val-core`` metric; docs/running.md)."""
        from polyrl.data import RLDataLoader

        cfg = self.config
        k = max(1, cfg.rollout.val_n)
        size = len(self.val_set) if not cfg.data.val_max_samples else min(len(self.val_set), cfg.data.val_max_samples)
        batch_size = cfg.data.val_batch_size or size
        loader = RLDataLoader(self.val_set, batch_size=batch_size, shuffle=False, seed=0, drop_last=False)
        per_source: dict[str, list[list[float]]] = defaultdict(list)
        tool_use: list[float] = []  # samples that called a tool (agent loops with tools)
        episodes: dict[str, list[float]] = defaultdict(list)  # step-wise loops: each episode's success
        seen = 0
        for rows in loader:
            rows = rows[: size - seen]
            seen += len(rows)
            rows = self.pad_rows(rows)
            batch = self.generate_batch(rows, k, validate=True)
            out = self.reward_fn(batch)
            batch["token_level_scores"] = out.token_level_scores.float()
            fold_tool_rewards(batch, cfg.agent)  # the score training sees: tools' and agent programs' rewards too
            batch_ops.set_non_tensor(batch, "reward_extra", reward_extras(out.extra, batch.batch_size[0]))
            sources = batch_ops.non_tensor(batch, "data_source")
            owner = sample_of_rows(batch, len(rows) * k)
            if owner is not None:  # step rows (a step-wise agent loop): one result per episode, on its last row
                self.record_validation(batch, keep=[not rows[o // k].get("_pad") for o in owner])
                ends, won = batch["episode_end"].tolist(), batch["episode_success"].tolist()
                for i, o in enumerate(owner):
                    if ends[i] and not rows[o // k].get("_pad"):
                        episodes[sources[i]].append(won[i])
                if seen >= size:
                    break
                continue
            self.record_validation(batch, keep=[not rows[j // k].get("_pad") for j in range(batch.batch_size[0])])
            # verl's val-core variable: the reward function's ``acc`` when it returns one, else the score itself
            # (with the tools' or the agent program's reward folded in, as verl reads an agent loop's own score)
            acc = out.extra.get("acc")
            correct = ([float(a) if a is not None else 0.0 for a in acc] if acc
                       else batch["token_level_scores"].sum(-1).tolist())
            if "tool_calls" in batch.keys():
                tool_use += [float(c > 0) for j, c in enumerate(batch["tool_calls"].tolist()) if not rows[j // k].get("_pad")]
            for i in range(0, len(correct), k):
                if rows[i // k].get("_pad"):
                    continue
                per_source[sources[i]].append([float(c) for c in correct[i : i + k]])
            if seen >= size:
                break
        metrics: dict[str, float] = {}
        for source, groups in per_source.items():
            arr = np.array(groups)
            metrics[f"val/{source}/mean@1"] = float(arr[:, 0].mean())
            if k > 1:
                metrics[f"val/{source}/pass@{k}"] = float((arr > 0).any(axis=1).mean())
                metrics[f"val/{source}/mean@{k}"] = float(arr.mean())
        for source, won in episodes.items():
            metrics[f"val/{source}/success_rate"] = float(np.mean(won))
        if tool_use and cfg.agent.tools:
            metrics["val/agent/tool_use_rate"] = float(np.mean(tool_use))
        return metrics

    # ------------------------------------------------------------------ checkpoints
    def save(self) -> Path:
        """Checkpoint every engine and the trainer state (step, data position, RNG, KL controller)."""
        snapshot = self.rollout_source.snapshot()  # data position and (async) the sample queue, taken at once
        state = {
            "global_step": self.global_step,
            "loader": snapshot.loader,
            "rollout_source": snapshot.state,
            "python_rng": _encode_rng(random.getstate()),
            "numpy_rng": _encode_rng(np.random.get_state()),
            "torch_rng": self._torch_rng(),
            "kl_coef": getattr(self.kl_ctrl, "value", None),
            "config": record_dict(self.config),  # a resume with another config is refused unless allowed
        }

        def save_all(path: str) -> None:
            self.groups.save_checkpoint(path)
            snapshot.write(path)

        with self.phase("checkpoint", "checkpoint"):
            return self.ckpt.save(self.global_step, save_all, state)

    def _torch_rng(self) -> list[int]:
        # The driver computes on the CPU only; each engine saves its device's RNG through its platform.
        return torch.get_rng_state().tolist()

    def _load(self, path: Path) -> None:
        state = read_state(path)
        with self.phase("load_checkpoint", "checkpoint"):
            self.groups.load_checkpoint(str(path))
        self.global_step = state["global_step"]
        self.loader.load_state_dict(state["loader"])
        self._iter = iter(self.loader)
        self.rollout_source.restore(path, state.get("rollout_source"))
        random.setstate(_decode_rng(state["python_rng"]))
        np.random.set_state(_decode_rng(state["numpy_rng"]))
        torch.set_rng_state(torch.tensor(state["torch_rng"], dtype=torch.uint8))
        if self.kl_ctrl is not None and state.get("kl_coef") is not None:
            self.kl_ctrl.value = state["kl_coef"]
        with self.phase("weight_sync", "weight_sync", role="actor -> rollout"):
            self.groups.sync_weights()
        log.info("resumed from %s at step %d", path, self.global_step)


# ---------------------------------------------------------------------- helpers


class _timer:
    def __init__(self, out: dict[str, float], name: str) -> None:
        self.out, self.name = out, name

    def __enter__(self) -> None:
        self.start = time.perf_counter()

    def __exit__(self, *exc: Any) -> None:
        self.out[self.name] = self.out.get(self.name, 0.0) + time.perf_counter() - self.start


def _progress(enabled: bool, total: int, initial: int):
    """The step bar on stderr; log records (the console step lines) are written above it by
    :class:`polyrl.logs.TqdmConsoleHandler`, never onto it."""
    return progress_bar(enabled, total, initial, desc="polyrl train")


def _mean_of(results: dict[str, float] | list[dict[str, float]]) -> dict[str, float]:
    if isinstance(results, dict):
        return dict(results)
    keys = set().union(*results) if results else set()
    return {k: float(np.mean([r[k] for r in results if k in r])) for k in keys}


def _combines_rule(combine: Any) -> bool:
    """Whether ``reward.combine`` uses the reward function's score (``rule``) for some data source."""
    blocks = [combine, *[b for b in dict(combine.per_data_source or {}).values() if isinstance(b, dict)]]
    for block in blocks:
        get = block.get if isinstance(block, dict) else lambda k, d=None, b=block: getattr(b, k, d)
        if get("mode", "sum") in ("gate", "function") or "rule" in dict(get("weights", None) or {}):
            return True
    return False


def _batch_metrics(batch: TensorDict) -> dict[str, float]:
    mask = batch["response_mask"].float()
    lengths = mask.sum(-1)
    scores = batch["token_level_scores"].sum(-1)
    rewards = batch["token_level_rewards"].sum(-1)
    adv = batch["advantages"][mask.bool()]
    out = {
        "critic/score/mean": float(scores.mean()),
        "critic/score/max": float(scores.max()),
        "critic/score/min": float(scores.min()),
        "critic/rewards/mean": float(rewards.mean()),
        "critic/advantages/mean": float(adv.mean()) if adv.numel() else 0.0,
        "critic/advantages/max": float(adv.max()) if adv.numel() else 0.0,
        "critic/advantages/min": float(adv.min()) if adv.numel() else 0.0,
        "response_length/mean": float(lengths.mean()),
        "response_length/max": float(lengths.max()),
        "response_length/clip_ratio": float((lengths >= batch["responses"].shape[1]).float().mean()),
        "prompt_length/mean": float(batch["attention_mask"][:, : batch["prompts"].shape[1]].sum(-1).float().mean()),
    }
    if "_acc" in batch.keys():
        out["acc/mean"] = float(batch["_acc"].mean())
    # the policy's log-probs: recomputed old ones, else (on-policy update) the rollout's own
    policy = next((batch[k] for k in ("old_log_probs", "rollout_log_probs") if k in batch.keys()), None)
    if "ref_log_prob" in batch.keys() and policy is not None:
        out["actor/kl_ref"] = float(masked_mean(policy - batch["ref_log_prob"], mask))
    return out


def _filter_groups(batch: TensorDict, metric: str, n: int) -> tuple[TensorDict, int]:
    """DAPO dynamic sampling: keep groups whose ``metric`` varies across their ``n`` samples."""
    key = f"_{metric}" if f"_{metric}" in batch.keys() else None
    values = batch[key] if key else batch["token_level_scores"].sum(-1)
    groups = values.view(-1, n)
    keep = groups.std(dim=1) > 0 if n > 1 else torch.ones(groups.shape[0], dtype=torch.bool)
    rows = keep.repeat_interleave(n)
    return batch[rows], int(keep.sum())


def _fit_to_groups(batch: TensorDict, groups: int, n: int, n_workers: int, mini: int) -> TensorDict:
    """Trim a filtered batch to whole groups that split evenly over workers and mini-batches."""
    have = batch.batch_size[0] // n
    take = min(have, groups)
    unit = max(1, mini)  # whole mini-batches when there are enough groups
    take = take - take % unit if take >= unit else take
    while take > 0 and (take * n) % n_workers:
        take -= 1
    if take == 0:
        raise RuntimeError(
            "dynamic sampling (algorithm.filter_groups) kept no usable group this step: every group got identical "
            "rewards. Raise algorithm.filter_groups.max_num_gen_batches or check the reward function."
        )
    return batch[: take * n]


def _encode_rng(state: Any) -> Any:
    if isinstance(state, tuple):
        return [_encode_rng(s) for s in state]
    if isinstance(state, np.ndarray):
        return {"__ndarray__": state.tolist(), "dtype": str(state.dtype)}
    return state


def _decode_rng(state: Any) -> Any:
    if isinstance(state, dict) and "__ndarray__" in state:
        return np.array(state["__ndarray__"], dtype=state["dtype"])
    if isinstance(state, list):
        return tuple(_decode_rng(s) for s in state)
    return state
