"""The worker process of a role group: hosts engines and rollouts and runs what the driver asks.

One class serves every placement: with ``colocated`` placement each worker holds
the actor, rollout, reference, critic and reward model (the hybrid engine: they time-share the
device, with ``offload``/``sleep`` around generation); with ``split`` placement
the rollout lives in its own group, and a mapping (``trainer.placement``) puts any role in any pool.
Roles beyond the built-in four come with a :class:`~polyrl.trainer.roles.RoleSpec` saying what to build.
The worker rebuilds the plugin manager from the run's manifest (registrations are never pickled) and joins
a torch.distributed group with its platform's backend.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
from collections.abc import Iterator, Sequence
from typing import Any

from tensordict import TensorDict

from polyrl.manifest import Manifest
from polyrl.profiling import profiled_call
from polyrl.protocols import SamplingParams
from polyrl.trainer.faults import hang_point

logger = logging.getLogger(__name__)


class Worker:
    """One rank. ``roles`` is a subset of ``{"actor", "ref", "critic", "rollout"}`` plus the names of
    ``role_specs`` (roles beyond those four, such as ``reward_model``).

    A plugin trainer (``trainer.name``) may run a subclass: :attr:`model_types` picks the engines' model
    type per role, :meth:`load_tokenizer` what text tokenizer (if any) the rollout and agent loops get,
    and :meth:`collate_outputs` how trajectories become a batch. A subclass serving a role of its own adds
    methods for it and names them in the role's ``RoleSpec.methods``; :meth:`role_engine`,
    :meth:`role_rollout` and :meth:`using_role` give them the role's engine or rollout (docs/plugins/roles.md).
    """

    #: The ``model_type`` each role's engine is built with (``Engine`` factories receive it).
    model_types: dict[str, str] = {"actor": "causal_lm", "ref": "causal_lm", "critic": "value"}

    #: Which engine's data-parallel layout splits the batch of each dispatched method (see :meth:`dp_layout`).
    dispatch_roles: dict[str, str] = {
        "compute_log_prob": "actor", "update_actor": "actor", "compute_ref_log_prob": "ref",
        "compute_values": "critic", "update_critic": "critic", "sft_step": "actor",
    }

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        config: Any,
        roles: Sequence[str],
        manifest: Manifest | None,
        master_addr: str = "127.0.0.1",
        master_port: int = 0,
        role_kind: str = "rl",
        role_specs: Sequence[Any] | None = None,
    ) -> None:
        import torch

        from polyrl import plugins
        from polyrl.distributed import init_distributed
        from polyrl.logs import setup_run_logging
        from polyrl.platforms import setup_worker_device

        if getattr(config.trainer, "run_dir", None):  # this process's records join RUN_DIR/train.log
            setup_run_logging(config.trainer.run_dir, tag=f"worker rank {rank}", console_level=logging.WARNING)
        self.rank, self.world_size, self.config, self.roles = rank, world_size, config, set(roles)
        self.pm = plugins.activate(manifest) if manifest is not None else plugins.get_plugin_manager()
        # LOCAL_RANK: this worker's position on its node, set by the worker group (equals rank on one node).
        self.local_rank = int(os.environ.get("LOCAL_RANK", rank))
        self.platform, self.device_index = setup_worker_device(config.trainer.device, self.pm,
                                                               local_rank=self.local_rank)
        logger.debug("worker rank %d of %d (pid %d): roles %s, platform %s, device index %s", rank, world_size,
                     os.getpid(), sorted(self.roles), self.platform.name, self.device_index)
        if world_size > 1 or "actor" in self.roles or "critic" in self.roles:
            init_distributed(self.platform.dist_backend, rank, world_size, master_addr, master_port)
        seed = config.trainer.seed + rank
        random.seed(seed)
        torch.manual_seed(seed)

        self.tokenizer = self.load_tokenizer()
        self.processor = self.load_processor()
        self.actor = self.ref = self.critic = self.rollout = None
        #: Roles beyond the built-in four: their specs, and the engine or rollout (and tokenizer) built for each.
        self.role_specs: dict[str, Any] = {s.name: s for s in role_specs or ()}
        self.role_engines: dict[str, Any] = {}
        self.role_rollouts: dict[str, Any] = {}
        self.role_tokenizers: dict[str, Any] = {}
        self._dispatch_roles = dict(self.dispatch_roles)
        for spec in self.role_specs.values():
            self._dispatch_roles.update({m: spec.name for m in spec.methods})
        types = self.model_types
        if role_kind == "sft":
            self.actor = self._build_engine("actor", config.actor, types["actor"])
            return
        if "actor" in self.roles:
            self.actor = self._build_engine("actor", config.actor, types["actor"])
        if "ref" in self.roles:
            self.ref = self._build_engine("ref", self._ref_role_config(), types["ref"])
        if "critic" in self.roles:
            self.critic = self._build_engine("critic", config.critic, types["critic"])
        for name in sorted(self.roles & set(self.role_specs)):
            self._build_role(self.role_specs[name])
        self.replica_leader = True  # tp=1: every rank is its own replica
        if "rollout" in self.roles and self.config.rollout.tensor_parallel_size == 1:
            self._build_rollout()  # tp > 1: the driver calls build_rollout_replica once it planned replicas

    # ------------------------------------------------------------------ construction
    def __repr__(self) -> str:  # Ray puts this in errors raised here, so the driver can name the rank
        return f"Worker(rank={self.rank}, world_size={self.world_size})"

    def ready(self) -> bool:
        """Returns once the constructor finished (the driver waits on it)."""
        return True

    def load_tokenizer(self) -> Any:
        """The text tokenizer the rollout and the agent loops get (the actor model's); ``None`` where
        nothing needs one. Subclasses override it (a diffusion model's text encoder brings its own)."""
        from transformers import AutoTokenizer

        from polyrl.models.paths import check_model_paths

        model_cfg = self.config.actor.model
        check_model_paths(model_cfg, "actor.model")  # a clear error, not transformers' retries on an unreachable Hub
        return AutoTokenizer.from_pretrained(model_cfg.tokenizer_path or model_cfg.path)

    def load_processor(self) -> Any:
        """The actor model's multimodal processor when it is a vision-language model (rows' images are processed
        here, once per image per step: :class:`polyrl.data.multimodal.ImageInputs`), else ``None``. Subclasses
        whose model takes no images return ``None``."""
        if self.model_types.get("actor") != "causal_lm":  # a plugin's model (diffusion) takes no images here
            return None
        from polyrl.data.multimodal import load_processor

        model_cfg = self.config.actor.model
        return load_processor(model_cfg.tokenizer_path or model_cfg.path, trust_remote_code=model_cfg.trust_remote_code)

    def dp_layout(self, method: str) -> tuple[int, int, bool]:
        """``(dp_rank, dp_size, collects_output)`` of this rank for the batches of ``method``.

        The worker group splits a batch into ``dp_size`` shards, hands shard ``dp_rank`` to this rank and
        keeps this rank's result only when ``collects_output`` (one rank per data-parallel group). Methods
        no engine serves (``generate``) split by rank.
        """
        role = self._dispatch_roles.get(method)
        engine = {"actor": self.actor, "ref": self.ref or self.actor, "critic": self.critic}.get(role or "")
        if engine is None:
            engine = self.role_engines.get(role or "")
        if engine is None:
            return self.rank, self.world_size, True
        return int(engine.dp_rank), int(engine.dp_size), bool(getattr(engine, "collects_output", True))

    def _build_engine(self, role: str, role_config: Any, model_type: str) -> Any:
        factory = self.pm.get("engine", role_config.engine)
        return factory(role_config, role=role, model_type=model_type, platform=self.platform)

    # ------------------------------------------------------------------ roles beyond the built-in four
    def _build_role(self, spec: Any) -> None:
        """Build what ``spec`` asks for: an engine from its block, or a rollout on the block's own model; a
        role sharing this worker with others starts offloaded (it takes the device when called)."""
        from transformers import AutoTokenizer

        from polyrl.models.paths import check_model_paths

        block = spec.block(self.config)
        check_model_paths(block.model, f"{spec.section}.model")
        self.role_tokenizers[spec.name] = AutoTokenizer.from_pretrained(block.model.tokenizer_path or block.model.path)
        if spec.builds == "engine":
            self.role_engines[spec.name] = self._build_engine(spec.name, block, spec.model_type)
        else:
            factory = self.pm.get("rollout", block.rollout.name)
            self.role_rollouts[spec.name] = factory(block.rollout, model_path=block.model.path,
                                                    tokenizer=self.role_tokenizers[spec.name], platform=self.platform)
        if self._offloads(spec.name):
            self._release_role(spec.name)

    def _offloads(self, name: str) -> bool:
        spec = self.role_specs[name]
        return bool(spec.offload_when_shared) and len(self.roles) > 1

    def _release_role(self, name: str) -> None:
        if name in self.role_engines:
            self.role_engines[name].offload()
        rollout = self.role_rollouts.get(name)
        if rollout is not None and rollout.capabilities.sleep:
            rollout.sleep(1)

    def _take_role(self, name: str) -> None:
        if name in self.role_engines:
            self.role_engines[name].onload()
        rollout = self.role_rollouts.get(name)
        if rollout is not None and rollout.capabilities.sleep:
            rollout.wake_up()

    def role_engine(self, name: str) -> Any:
        """The engine built for role ``name`` (a ``RoleSpec`` with ``builds="engine"``)."""
        if name not in self.role_engines:
            raise RuntimeError(f"{self!r} holds no engine for role '{name}' (its roles: {sorted(self.roles)})")
        return self.role_engines[name]

    def role_rollout(self, name: str) -> Any:
        """The rollout built for role ``name`` (a ``RoleSpec`` with ``builds="rollout"``)."""
        if name not in self.role_rollouts:
            raise RuntimeError(f"{self!r} holds no rollout for role '{name}' (its roles: {sorted(self.roles)})")
        return self.role_rollouts[name]

    @contextlib.contextmanager
    def using_role(self, name: str) -> Iterator[None]:
        """Around a call that uses role ``name``: when the role shares this worker with other roles (and its
        spec says so), its engine is onloaded / its rollout woken first and released again after."""
        release = self._offloads(name)
        if release:
            self._take_role(name)
        try:
            yield
        finally:
            if release:
                self._release_role(name)

    def _ref_role_config(self) -> Any:
        return ref_role_config(self.config)

    def _build_rollout(self) -> None:
        from polyrl.agent_loops import BatchingClient

        rcfg = self.config.rollout
        factory = self.pm.get("rollout", rcfg.name)
        model_path = self.config.actor.model.path
        self.rollout = factory(rcfg, model_path=model_path, tokenizer=self.tokenizer, platform=self.platform)
        from polyrl.config.schema import AgentConfig
        from polyrl.tools import build_tools

        # every loop gets the run's `agent` block and the tools it lists; a row's agent_name picks the loop
        self.agent_config = getattr(self.config, "agent", None) or AgentConfig()
        tools = build_tools(self.agent_config.tools, self.pm)
        loops = {}
        for entry in self.pm.registry("agent_loop").entries():
            factory = entry.load()
            kwargs = {"tokenizer": self.tokenizer, "config": self.agent_config, "tools": tools}
            if _takes_keyword(factory, "max_prompt_length"):  # optional: loops that re-render the prompt check it
                kwargs["max_prompt_length"] = self.config.data.max_prompt_length
            loops[entry.name] = factory(**kwargs)
        self.agent_loops = loops
        self.client = (
            self.rollout if self.rollout.capabilities.async_generate
            else BatchingClient(self.rollout, max_batch_size=rcfg.max_batch_size)
        )

    def rollout_device_ids(self) -> list[str]:
        """The accelerator ids Ray assigned to this worker (``[]`` on CPU or outside Ray)."""
        from polyrl.platforms.devices import ray_accelerator_ids

        return ray_accelerator_ids(self.platform.ray_resource)

    def build_rollout_replica(self, leader: bool, device_ids: Sequence[str]) -> None:
        """Tensor-parallel rollout (``rollout.tensor_parallel_size > 1``): the replica's leader builds the
        engine over ``device_ids`` (every device of its replica, made visible to the processes the engine
        starts); the other ranks of the replica lend their device and hold no rollout."""
        self.replica_leader = leader
        if not leader:
            return
        var = self.platform.visible_devices_env
        if var and device_ids:
            os.environ[var] = ",".join(device_ids)
            # aliases a platform keeps in step with its variable (ROCm: CUDA_VISIBLE_DEVICES = HIP_VISIBLE_DEVICES)
            for key, value in self.platform.worker_env().items():
                if key.endswith("VISIBLE_DEVICES"):
                    os.environ[key] = value
        self._build_rollout()
        if not self.rollout.capabilities.tensor_parallel:
            from polyrl.errors import ConfigError

            name = self.config.rollout.name
            self.close()
            raise ConfigError(f"rollout.tensor_parallel_size={self.config.rollout.tensor_parallel_size}: rollout "
                              f"'{name}' does not shard a model over devices. Set rollout.tensor_parallel_size=1, or "
                              "use a rollout that does (rollout.name=vllm or sglang)")

    # ------------------------------------------------------------------ generation
    @profiled_call("rollout")
    def generate(self, samples: list[dict], sampling: SamplingParams, *, validate: bool = False) -> TensorDict | None:
        """Run the agent loops on ``samples`` (already repeated ``n`` times) and collate a batch.

        A rank that lends its device to another rank's tensor-parallel replica frees its training memory
        and waits (a barrier) until every replica has generated; it returns ``None``.
        """
        from polyrl.agent_loops import run_agent_loops

        hang_point("generate", self.rank)  # POLYRL_HANG_AT: the deadline tests' wedged rollout
        if not self.replica_leader:
            self._lend_device_during_generation(validate)
            return None
        try:
            if not validate:
                for engine in self._trained_engines():
                    engine.offload()
            if self.processor is not None:  # each row's images, processed once for this call
                samples = self._with_image_inputs(samples)
            outputs = run_agent_loops(samples, sampling, self.client, self.agent_loops,
                                      default=self.agent_config.default_loop)
        finally:
            if not validate:
                for engine in self._trained_engines():
                    engine.onload()
            if self.config.rollout.tensor_parallel_size > 1:
                _barrier()  # the ranks that lent their device may take it back (also when generation failed)
        batch = self.collate_outputs(outputs)
        if self.processor is not None:
            self._add_image_fields(batch, samples)
        return batch

    def _with_image_inputs(self, samples: list[dict]) -> list[Any]:
        """``samples`` with ``multi_modal_data`` (the processed images of rows that have any)."""
        from polyrl.data.multimodal import ImageInputs, attach_image_inputs

        image_inputs = ImageInputs(self.processor)
        out = attach_image_inputs(samples, image_inputs, self.config.data.image_key)
        logger.debug("rank %d: %d images processed for %d samples", self.rank, image_inputs.processed, len(samples))
        return out

    def _add_image_fields(self, batch: TensorDict, samples: list[Any]) -> None:
        """The images' model inputs and M-RoPE positions of each row (:func:`polyrl.data.multimodal.add_multimodal_fields`)."""
        from polyrl.data.multimodal import add_multimodal_fields, processor_token_ids

        add_multimodal_fields(batch, [s.get("multi_modal_data") for s in samples], **processor_token_ids(self.processor))

    def _trained_engines(self) -> list[Any]:
        """The engines of this worker that hold training state (offloaded while a colocated rollout generates)."""
        return [e for e in (self.actor, self.critic) if e is not None]

    def collate_outputs(self, outputs: list[Any]) -> TensorDict:
        """The batch of finished trajectories (:func:`polyrl.agent_loops.collate`: token fields plus the
        loops' ``extra`` outputs)."""
        from polyrl.agent_loops import collate

        data = self.config.data
        pad = getattr(self.tokenizer, "pad_token_id", None)
        return collate(
            outputs,
            pad_token_id=pad if pad is not None else 0,
            max_prompt_length=data.max_prompt_length,
            max_response_length=data.max_response_length,
        )

    # ------------------------------------------------------------------ weight sync (polyrl.trainer.weight_sync)
    @property
    def _bucket_bytes(self) -> int:
        return int(self.config.trainer.weight_bucket_mb) << 20

    @profiled_call("weight_sync")
    def sync_rollout_weights(self) -> dict[str, float]:
        """Colocated: stream the actor's weights into this process's rollout, bucket by bucket."""
        from polyrl.trainer.weight_sync import stream_into_rollout

        return stream_into_rollout(self.actor, self.rollout, self._bucket_bytes)

    @profiled_call("weight_sync")
    def gather_weights(self) -> list[list[tuple[str, Any]]] | None:
        """Split placement: every actor rank iterates (collective); rank 0 returns the buckets."""
        from polyrl.trainer.weight_sync import gather_buckets

        return gather_buckets(self.actor, self._bucket_bytes, keep=self.rank == 0)

    @profiled_call("weight_sync")
    def load_rollout_weights(self, buckets: list[list[tuple[str, Any]]]) -> None:
        """Split placement: load buckets gathered from the actor group (on a replica's leader)."""
        from polyrl.trainer.weight_sync import load_buckets

        load_buckets(self.rollout, buckets)

    def join_weight_group(self, address: str, port: int, rank: int, size: int) -> None:
        """Split placement, ``trainer.weight_transfer=collective``: join the group of actor rank 0 and the
        rollout replicas' leaders (:mod:`polyrl.trainer.weight_sync`)."""
        from polyrl.trainer.weight_sync import join_weight_group

        self.weight_group = join_weight_group(self.platform, address, port, rank, size)

    @profiled_call("weight_sync")
    def send_weights(self) -> dict[str, float]:
        """Collective transfer, actor side: every rank gathers, rank 0 broadcasts the buckets."""
        from polyrl.trainer.weight_sync import send_weights

        sender = getattr(self, "_weight_sender", None)
        if sender is not None:  # a background send on the same group must be through first
            sender.wait()
        return send_weights(self.actor, getattr(self, "weight_group", None), self._bucket_bytes)

    def start_weight_send(self) -> dict[str, float]:
        """Collective transfer that does not hold the actor up (``fully_async``): every rank gathers, rank 0
        keeps a packed copy and broadcasts it from a thread of its own
        (:class:`~polyrl.trainer.weight_sync.BackgroundSender`); waits first for its previous send."""
        from polyrl.trainer.weight_sync import BackgroundSender

        sender = getattr(self, "_weight_sender", None)
        if sender is None:
            sender = self._weight_sender = BackgroundSender()
        return sender.submit(self.actor, getattr(self, "weight_group", None), self._bucket_bytes)

    @profiled_call("weight_sync")
    def receive_weights(self) -> dict[str, float]:
        """Collective transfer, rollout side (a replica's leader): load the buckets as they arrive."""
        from polyrl.trainer.weight_sync import receive_weights

        if self.rollout is not None:
            self.rollout.wake_up()
        return receive_weights(self.weight_group, self.rollout)

    def memory_stats(self) -> dict[str, float]:
        """This process's memory in GiB, as its platform reports it (``Platform.memory_stats``)."""
        return dict(self.platform.memory_stats())

    def sleep_rollout(self) -> None:
        """Release the rollout's accelerator memory before training (colocated)."""
        if self.rollout is None:
            return
        if self.config.rollout.free_cache_engine and self.rollout.capabilities.sleep:
            self.rollout.sleep(1)

    # ------------------------------------------------------------------ inference
    @profiled_call("actor")
    def compute_log_prob(self, batch: TensorDict, products: Any = None) -> TensorDict:
        """Old log-probs and entropy under the current actor, and the forward ``products`` asked for
        (:class:`~polyrl.protocols.ForwardProducts`: ``sum_pi_squared`` for the optimal-token-baseline estimators)."""
        kw = {"products": products} if products else {}
        out = self.actor.infer_batch(batch, temperature=self.config.rollout.temperature, compute_entropy=True, **kw)
        return out.select("log_probs", "entropy", *(products.output_keys() if products else ()))

    @profiled_call("ref")
    def compute_ref_log_prob(self, batch: TensorDict) -> TensorDict:
        """Reference log-probs: a separate engine, or the LoRA actor with its adapter disabled."""
        temperature = self.config.rollout.temperature
        if self.ref is not None:
            return self.ref.infer_batch(batch, temperature=temperature).select("log_probs")
        return self.actor.infer_batch(batch, temperature=temperature, disable_adapter=True).select("log_probs")

    @profiled_call("critic")
    def compute_values(self, batch: TensorDict) -> TensorDict:
        """Critic values for each response token."""
        return self.critic.infer_batch(batch).select("values")

    # ------------------------------------------------------------------ the reward_model role
    def compute_rm_score(self, batch: TensorDict) -> TensorDict:
        """Discriminative reward model: each row's score (``rm_scores``, ``[B]``) from the role's value-head
        engine, read at the row's last token (the batch is :func:`polyrl.reward_models.inputs.sequences_batch`'s)."""
        from tensordict import TensorDict as TD

        with self.using_role("reward_model"):
            values = self.role_engine("reward_model").infer_batch(batch)["values"]
        return TD({"rm_scores": values[:, 0].float()}, batch_size=batch.batch_size)

    def judge_generate(self, prompts: list[list[int]]) -> list[str]:
        """Generative reward model: the judge's verdict for each prompt (token ids of the judge's tokenizer),
        generated by the role's rollout with ``reward_model.rollout``'s sampling and decoded."""
        from polyrl.protocols import GenerationRequest

        cfg = self.config.reward_model.rollout
        sampling = SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                                  max_new_tokens=cfg.response_length, n=1, stop_token_ids=list(cfg.stop_token_ids),
                                  logprobs=False, seed=cfg.seed)
        with self.using_role("reward_model"):
            results = self.role_rollout("reward_model").generate(
                [GenerationRequest(list(p), sampling) for p in prompts])
        tokenizer = self.role_tokenizers["reward_model"]
        return [tokenizer.decode(r.response_ids, skip_special_tokens=True) for r in results]

    # ------------------------------------------------------------------ updates
    @profiled_call("actor")
    def update_actor(self, batch: TensorDict) -> dict[str, float]:
        """PPO epochs over mini-batches of this rank's shard; metrics averaged over steps."""
        from polyrl.trainer.losses import make_actor_loss

        hang_point("update_actor", self.rank)  # POLYRL_HANG_AT: a rank that never reaches the update's collectives
        cfg = self.config.actor
        loss = make_actor_loss(cfg, on_policy=self.update_is_on_policy(batch))
        return self.run_update_epochs(self.actor, batch, loss, cfg, shuffle=cfg.shuffle,
                                      temperature=self.config.rollout.temperature)

    @profiled_call("critic")
    def update_critic(self, batch: TensorDict) -> dict[str, float]:
        """Value-loss epochs over mini-batches of this rank's shard."""
        from polyrl.trainer.losses import make_critic_loss

        cfg = self.config.critic
        return self.run_update_epochs(self.critic, batch, make_critic_loss(cfg), cfg, shuffle=False)

    # -- the update epochs (polyrl.trainer.updates), for subclasses that bring their own loss
    def mini_batch_rows(self, engine: Any, role_config: Any) -> int:
        """Rows of one mini-batch on this rank: ``role_config.ppo_mini_batch_size`` prompts x ``rollout.n``
        samples over ``engine``'s data-parallel ranks."""
        from polyrl.trainer.updates import mini_batch_rows

        return mini_batch_rows(role_config.ppo_mini_batch_size, self.config.rollout.n, engine.dp_size)

    def update_is_on_policy(self, batch: TensorDict) -> bool:
        """Whether the actor update of ``batch`` is on-policy: the trainer sent no ``old_log_probs`` because the
        update is one pass over one mini-batch (:func:`polyrl.trainer.updates.single_update_pass`), so the
        current log-probs, detached, are the old ones. Raises if the batch lacks them but the update would make
        more than one pass."""
        from polyrl.trainer.updates import single_update_pass

        if "old_log_probs" in batch.keys():
            return False
        cfg = self.config.actor
        rows = self.mini_batch_rows(self.actor, cfg)
        if not single_update_pass(cfg.ppo_epochs, rows, batch.batch_size[0]):
            raise RuntimeError(
                "update_actor got no old_log_probs but runs more than one pass over the batch "
                f"(actor.ppo_epochs={cfg.ppo_epochs}, {batch.batch_size[0] // max(1, rows)} mini-batches): "
                "compute them first (compute_log_prob)")
        return True

    def run_update_epochs(self, engine: Any, batch: TensorDict, loss_fn: Any, role_config: Any, *,
                          shuffle: bool = False, temperature: float = 1.0, products: Any = None) -> dict[str, float]:
        """``role_config.ppo_epochs`` passes over ``batch`` (this rank's shard) in mini-batches of
        :meth:`mini_batch_rows`, one ``engine.train_batch(mini_batch, loss_fn, temperature=...)`` each;
        ``shuffle`` reorders the rows every pass (seeded by the engine's ``dp_rank`` and the epoch); ``products``
        (:class:`~polyrl.protocols.ForwardProducts`) reach the loss's ``model_output``. Returns the metrics
        averaged over the optimizer steps (:func:`polyrl.trainer.updates.run_update_epochs`)."""
        from polyrl.trainer.updates import run_update_epochs

        return run_update_epochs(engine, batch, self.mini_batch_rows(engine, role_config), role_config.ppo_epochs,
                                 loss_fn, shuffle=shuffle, seed=engine.dp_rank, temperature=temperature,
                                 products=products)

    @profiled_call("actor")
    def sft_step(self, batch: TensorDict) -> dict[str, float]:
        """One supervised optimizer step (``polyrl sft``)."""
        from polyrl.trainer.losses import sft_loss

        return self.actor.train_batch(batch, sft_loss)

    # ------------------------------------------------------------------ profiling
    def profile_name(self) -> str:
        """This process's name in trace files: its roles and rank (``actor-ref-rollout_rank0``)."""
        order = ["actor", "ref", "critic", "rollout"]
        roles = sorted(self.roles, key=lambda r: order.index(r) if r in order else len(order))
        return f"{'-'.join(roles)}_rank{self.rank}"

    def start_profile(self, step: int, out_dir: str, *, memory: bool = False, with_stack: bool = False) -> None:
        """Record this process with torch.profiler until :meth:`stop_profile` (``trainer.profile``)."""
        from polyrl.profiling import ProfileRecorder

        recorder = ProfileRecorder(self.platform, self.profile_name(), memory=memory, with_stack=with_stack)
        recorder.start(step, out_dir)
        self._profile_recorder = recorder

    def stop_profile(self) -> list[str]:
        """Stop recording and write the trace; returns the files written (none when not recording)."""
        recorder, self._profile_recorder = getattr(self, "_profile_recorder", None), None
        return recorder.stop() if recorder is not None else []

    # ------------------------------------------------------------------ checkpoints
    def _checkpointed_engines(self) -> list[tuple[str, Any]]:
        trained = [(n, e) for n, e in self.role_engines.items() if getattr(self.role_specs[n], "trains", False)]
        return [(r, e) for r, e in (("actor", self.actor), ("critic", self.critic), *trained) if e is not None]

    def save_checkpoint(self, path: str) -> None:
        """Save every trained engine this worker holds under ``path/<role>``."""
        for role, engine in self._checkpointed_engines():
            engine.save_checkpoint(f"{path}/{role}")

    def load_checkpoint(self, path: str, model_only: bool = False) -> None:
        """Restore what :meth:`save_checkpoint` wrote. ``model_only`` (``polyrl export``): the weights alone, from a
        checkpoint of any world size, for engines whose ``load_checkpoint`` takes ``model_only`` (the others
        restore everything, which needs the world size the checkpoint was written with)."""
        for role, engine in self._checkpointed_engines():
            if model_only and _takes_keyword(engine.load_checkpoint, "model_only"):
                engine.load_checkpoint(f"{path}/{role}", model_only=True)
            else:
                engine.load_checkpoint(f"{path}/{role}")

    def export_hf(self, path: str) -> None:
        """Write the actor as an HF folder."""
        self.actor.export_hf(path)

    def _lend_device_during_generation(self, validate: bool) -> None:
        """A rank of a tensor-parallel replica that is not its leader: free the training memory on the
        device the replica's engine uses until every replica finished generating (the leaders' barrier)."""
        engines = [] if validate else self._trained_engines()
        for engine in engines:
            engine.offload()
        try:
            _barrier()
        finally:
            for engine in engines:
                engine.onload()

    def close(self) -> None:
        """Stop the rollout engine (``Rollout.shutdown``), then leave the process group."""
        import torch.distributed as dist

        rollout, self.rollout = getattr(self, "rollout", None), None
        role_rollouts = dict(getattr(self, "role_rollouts", {}))
        self.role_rollouts = {}
        for name, r in (("rollout", rollout), *role_rollouts.items()):
            shutdown = getattr(r, "shutdown", None)  # rollouts written before shutdown() joined the protocol
            if shutdown is not None:
                try:
                    shutdown()
                except Exception:  # teardown goes on: the process group must still be left
                    logger.exception("rank %d: %s shutdown failed", self.rank, name)
        sender = getattr(self, "_weight_sender", None)
        if sender is not None:  # a send still waiting for its receivers: give it a moment, then leave anyway
            try:
                sender.wait(timeout=30)
            except RuntimeError:
                logger.warning("rank %d: the last background weight send failed", self.rank, exc_info=True)
        weight_group, self.weight_group = getattr(self, "weight_group", None), None
        if weight_group is not None:
            weight_group.close()
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


def ref_role_config(config: Any) -> Any:
    """The reference policy's engine config: the actor's, with ``ref.engine``, ``ref.<engine>`` options and
    ``ref.micro_batch_size`` where set, and no LoRA."""
    import copy

    cfg = copy.deepcopy(config.actor)
    ref = config.ref
    if ref.engine:
        cfg.engine = ref.engine
    if ref.plugin_config is not None:
        cfg.plugin_config = ref.plugin_config
    cfg.micro_batch_size = ref.micro_batch_size
    cfg.model.lora.rank = 0
    return cfg


def _takes_keyword(factory: Any, name: str) -> bool:
    """Whether ``factory`` (a class or function) accepts the keyword argument ``name``."""
    import inspect

    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # no signature to read (some builtins): pass only the protocol's arguments
        return False
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
