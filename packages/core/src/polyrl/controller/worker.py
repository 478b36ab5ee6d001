"""The worker process of a role group: hosts engines and a rollout and runs what the driver asks.

One class serves every placement: with ``colocated`` placement each worker holds
the actor, rollout, reference and critic (the hybrid engine: they time-share the
device, with ``offload``/``sleep`` around generation); with ``split`` placement
the rollout lives in its own group. The worker rebuilds the plugin manager from
the run's manifest (registrations are never pickled) and joins a
torch.distributed group with its platform's backend.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from tensordict import TensorDict

from polyrl.manifest import Manifest
from polyrl.protocols import SamplingParams


class Worker:
    """One rank. ``roles`` is a subset of ``{"actor", "ref", "critic", "rollout"}``."""

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
    ) -> None:
        import torch

        from polyrl import plugins
        from polyrl.controller.distributed import init_distributed
        from polyrl.platforms import detect_platform, get_platform

        self.rank, self.world_size, self.config, self.roles = rank, world_size, config, set(roles)
        self.pm = plugins.activate(manifest) if manifest is not None else plugins.get_plugin_manager()
        device = config.trainer.device
        self.platform = detect_platform(self.pm) if device == "auto" else get_platform(device, self.pm)
        self.platform.apply_patches()
        self.platform.set_device(rank)
        if world_size > 1 or "actor" in self.roles or "critic" in self.roles:
            init_distributed(self.platform.dist_backend, rank, world_size, master_addr, master_port)
        seed = config.trainer.seed + rank
        random.seed(seed)
        torch.manual_seed(seed)

        from transformers import AutoTokenizer

        model_cfg = config.actor.model
        self.tokenizer = AutoTokenizer.from_pretrained(model_cfg.tokenizer_path or model_cfg.path)
        self.actor = self.ref = self.critic = self.rollout = None
        if role_kind == "sft":
            self.actor = self._build_engine("actor", config.actor, "causal_lm")
            return
        if "actor" in self.roles:
            self.actor = self._build_engine("actor", config.actor, "causal_lm")
        if "ref" in self.roles:
            self.ref = self._build_engine("ref", self._ref_role_config(), "causal_lm")
        if "critic" in self.roles:
            self.critic = self._build_engine("critic", config.critic, "value")
        if "rollout" in self.roles:
            self._build_rollout()

    # ------------------------------------------------------------------ construction
    def ready(self) -> bool:
        """Returns once the constructor finished (the driver waits on it)."""
        return True

    def _build_engine(self, role: str, role_config: Any, model_type: str) -> Any:
        factory = self.pm.get("engine", role_config.engine)
        return factory(role_config, role=role, model_type=model_type, platform=self.platform)

    def _ref_role_config(self) -> Any:
        import copy

        cfg = copy.deepcopy(self.config.actor)
        ref = self.config.ref
        if ref.engine:
            cfg.engine = ref.engine
        if ref.plugin_config is not None:
            cfg.plugin_config = ref.plugin_config
        cfg.micro_batch_size = ref.micro_batch_size
        cfg.model.lora.rank = 0
        return cfg

    def _build_rollout(self) -> None:
        from polyrl.agent_loops import BatchingClient

        rcfg = self.config.rollout
        factory = self.pm.get("rollout", rcfg.name)
        model_path = self.config.actor.model.path
        self.rollout = factory(rcfg, model_path=model_path, tokenizer=self.tokenizer, platform=self.platform)
        loops = {}
        for entry in self.pm.registry("agent_loop").entries():
            loops[entry.name] = entry.load()(tokenizer=self.tokenizer, config=rcfg, tools=None)
        self.agent_loops = loops
        self.client = (
            self.rollout if self.rollout.capabilities.async_generate
            else BatchingClient(self.rollout, max_batch_size=rcfg.max_batch_size)
        )

    # ------------------------------------------------------------------ generation
    def generate(self, samples: list[dict], sampling: SamplingParams, *, validate: bool = False) -> TensorDict:
        """Run the agent loops on ``samples`` (already repeated ``n`` times) and collate a batch."""
        from polyrl.agent_loops import collate, run_agent_loops

        if self.actor is not None and not validate:
            self.actor.offload()
        try:
            outputs = run_agent_loops(samples, sampling, self.client, self.agent_loops)
        finally:
            if self.actor is not None and not validate:
                self.actor.onload()
        data = self.config.data
        return collate(
            outputs,
            pad_token_id=self.tokenizer.pad_token_id,
            max_prompt_length=data.max_prompt_length,
            max_response_length=data.max_response_length,
        )

    def sync_rollout_weights(self) -> dict[str, float]:
        """Colocated: stream the actor's weights into this process's rollout, bucket by bucket."""
        import time

        start = time.perf_counter()
        self.rollout.wake_up()
        count = 0
        for bucket in self.actor.weights_for_rollout(self.config.trainer.weight_bucket_mb << 20):
            self.rollout.update_weights(bucket)
            count += len(bucket)
        return {"timing/weight_sync": time.perf_counter() - start, "weight_sync/tensors": float(count)}

    def gather_weights(self) -> list[list[tuple[str, Any]]] | None:
        """Split placement: every actor rank iterates (collective); rank 0 returns the buckets."""
        buckets = [
            [(n, t.detach().cpu()) for n, t in bucket]
            for bucket in self.actor.weights_for_rollout(self.config.trainer.weight_bucket_mb << 20)
        ]
        return buckets if self.rank == 0 else None

    def load_rollout_weights(self, buckets: list[list[tuple[str, Any]]]) -> None:
        """Split placement: load buckets gathered from the actor group."""
        self.rollout.wake_up()
        for bucket in buckets:
            self.rollout.update_weights(bucket)

    def sleep_rollout(self) -> None:
        """Release the rollout's accelerator memory before training (colocated)."""
        if self.config.rollout.free_cache_engine and self.rollout.capabilities.sleep:
            self.rollout.sleep(1)

    # ------------------------------------------------------------------ inference
    def compute_log_prob(self, batch: TensorDict) -> TensorDict:
        """Old log-probs and entropy under the current actor."""
        out = self.actor.infer_batch(batch, temperature=self.config.rollout.temperature, compute_entropy=True)
        return out.select("log_probs", "entropy")

    def compute_ref_log_prob(self, batch: TensorDict) -> TensorDict:
        """Reference log-probs: a separate engine, or the LoRA actor with its adapter disabled."""
        temperature = self.config.rollout.temperature
        if self.ref is not None:
            return self.ref.infer_batch(batch, temperature=temperature).select("log_probs")
        return self.actor.infer_batch(batch, temperature=temperature, disable_adapter=True).select("log_probs")

    def compute_values(self, batch: TensorDict) -> TensorDict:
        """Critic values for each response token."""
        return self.critic.infer_batch(batch).select("values")

    # ------------------------------------------------------------------ updates
    def update_actor(self, batch: TensorDict) -> dict[str, float]:
        """PPO epochs over mini-batches of this rank's shard; metrics averaged over steps."""
        from polyrl.trainer.losses import make_actor_loss

        self.actor.temperature = self.config.rollout.temperature
        cfg = self.config.actor
        rows = cfg.ppo_mini_batch_size * self.config.rollout.n // self.world_size
        on_policy = "old_log_probs" not in batch.keys()
        if on_policy and (cfg.ppo_epochs > 1 or rows < batch.batch_size[0]):
            raise RuntimeError(
                "update_actor got no old_log_probs but runs more than one pass over the batch "
                f"(actor.ppo_epochs={cfg.ppo_epochs}, {batch.batch_size[0] // max(1, rows)} mini-batches): "
                "compute them first (compute_log_prob)")
        loss = make_actor_loss(cfg, on_policy=on_policy)
        return _run_epochs(self.actor, batch, rows, cfg.ppo_epochs, loss, cfg.shuffle, self.rank)

    def update_critic(self, batch: TensorDict) -> dict[str, float]:
        """Value-loss epochs over mini-batches of this rank's shard."""
        from polyrl.trainer.losses import make_critic_loss

        cfg = self.config.critic
        rows = cfg.ppo_mini_batch_size * self.config.rollout.n // self.world_size
        return _run_epochs(self.critic, batch, rows, cfg.ppo_epochs, make_critic_loss(cfg), False, self.rank)

    def sft_step(self, batch: TensorDict) -> dict[str, float]:
        """One supervised optimizer step (``polyrl sft``)."""
        from polyrl.trainer.losses import sft_loss

        return self.actor.train_batch(batch, sft_loss)

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, path: str) -> None:
        """Save every engine this worker holds under ``path/<role>``."""
        for role, engine in (("actor", self.actor), ("critic", self.critic)):
            if engine is not None:
                engine.save_checkpoint(f"{path}/{role}")

    def load_checkpoint(self, path: str) -> None:
        """Restore what :meth:`save_checkpoint` wrote."""
        for role, engine in (("actor", self.actor), ("critic", self.critic)):
            if engine is not None:
                engine.load_checkpoint(f"{path}/{role}")

    def export_hf(self, path: str) -> None:
        """Write the actor as an HF folder."""
        self.actor.export_hf(path)

    def close(self) -> None:
        """Leave the process group."""
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


def _run_epochs(engine: Any, batch: TensorDict, rows: int, epochs: int, loss_fn: Any, shuffle: bool, seed: int) -> dict:
    import torch

    size = batch.batch_size[0]
    rows = max(1, min(rows, size))
    sums: dict[str, float] = {}
    steps = 0
    for epoch in range(epochs):
        order = torch.randperm(size, generator=torch.Generator().manual_seed(seed * 1000 + epoch)) if shuffle else None
        data = batch[order] if order is not None else batch
        for start in range(0, size - rows + 1, rows):
            metrics = engine.train_batch(data[start : start + rows], loss_fn)
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + float(v)
            steps += 1
    return {k: v / max(1, steps) for k, v in sums.items()}
