"""Placement: which worker groups hold which roles, and the calls that span groups.

``colocated`` (default): one group whose every rank holds the actor, the rollout
and, when used, the reference and the critic (the hybrid engine; weights move
in-process). ``split``: the rollout gets its own pool of
``trainer.rollout_workers`` processes and weights travel from actor rank 0
through Ray's object store. The ``local`` executor puts one rank of everything in
the driver process.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tensordict import TensorDict

from polyrl import batch as batch_ops
from polyrl.controller.distributed import free_port
from polyrl.controller.worker import Worker
from polyrl.controller.worker_group import LocalWorkerGroup, RayWorkerGroup, WorkerGroup
from polyrl.manifest import Manifest
from polyrl.protocols import SamplingParams
from polyrl.rollout.replicas import Replica, plan_replicas, replica_call_args, replica_of


@dataclass
class RoleGroups:
    """The worker group serving each role (several roles may share one group)."""

    actor: WorkerGroup
    rollout: WorkerGroup
    ref: WorkerGroup | None
    critic: WorkerGroup | None
    colocated: bool
    owns_ray: bool = False
    #: Tensor-parallel rollout replicas over the rollout group's ranks (``None``: tp=1, one per rank).
    replicas: list[Replica] | None = None

    def generate(self, samples: list[dict], sampling: SamplingParams) -> TensorDict:
        """Generate for ``samples`` split over the rollout ranks (over the replicas' leaders when the
        rollout is tensor-parallel), then free the rollout's memory."""
        if self.replicas is None:
            batch = self.rollout.dispatch("generate", samples, sampling=sampling)
        else:
            args = replica_call_args(samples, self.replicas, self.rollout.world_size)
            results = self.rollout.call_each("generate", args, sampling=sampling)
            batch = batch_ops.concat([results[r.leader] for r in self.replicas])
        self.rollout.call_all("sleep_rollout")
        return batch

    def sync_weights(self) -> None:
        """Actor weights -> rollout (in-process when colocated, via the object store when split)."""
        if self.colocated:
            self.actor.call_all("sync_rollout_weights")
        else:
            buckets = next(b for b in self.actor.call_all("gather_weights") if b is not None)
            self.rollout.call_all("load_rollout_weights", buckets)
            self.rollout.call_all("sleep_rollout")

    def save_checkpoint(self, path: str) -> None:
        """Every group that trains something saves into ``path``."""
        self.actor.call_all("save_checkpoint", path)
        if self.critic is not None and self.critic is not self.actor:
            self.critic.call_all("save_checkpoint", path)

    def load_checkpoint(self, path: str) -> None:
        """Restore every training group from ``path``."""
        self.actor.call_all("load_checkpoint", path)
        if self.critic is not None and self.critic is not self.actor:
            self.critic.call_all("load_checkpoint", path)

    def shutdown(self) -> None:
        """Stop every group once."""
        seen: set[int] = set()
        for group in (self.actor, self.rollout, self.ref, self.critic):
            if group is not None and id(group) not in seen:
                seen.add(id(group))
                group.shutdown()
        if self.owns_ray:
            import ray

            ray.shutdown()


def build_role_groups(config: Any, *, manifest: Manifest | None, use_ref: bool, use_critic: bool,
                      run_dir: Path) -> RoleGroups:
    """Start the worker groups the run's placement asks for."""
    trainer = config.trainer
    lora = config.actor.model.lora.rank > 0
    train_roles = ["actor"] + (["ref"] if use_ref and not lora else []) + (["critic"] if use_critic else [])
    tp = config.rollout.tensor_parallel_size
    # before any process starts: tp must divide the rollout devices (one per rollout worker)
    rollout_devices = 1 if trainer.executor == "local" else (
        trainer.n_workers if trainer.placement == "colocated" else trainer.rollout_workers)
    plan_replicas(rollout_devices, tp)
    if trainer.executor == "local":
        group = LocalWorkerGroup(Worker, config=config, roles=train_roles + ["rollout"], manifest=manifest,
                                 master_port=free_port())
        return RoleGroups(group, group, group if use_ref else None, group if use_critic else None, True)
    owns_ray = start_ray(config, run_dir)
    resources = _resources(config)
    if trainer.placement == "colocated":
        group = RayWorkerGroup(Worker, trainer.n_workers, resources_per_worker=resources, config=config,
                               roles=train_roles + ["rollout"], manifest=manifest, master_port=free_port(),
                               name="colocated")
        groups = RoleGroups(group, group, group if use_ref else None, group if use_critic else None, True, owns_ray)
        return _place_replicas(groups, tp)
    if trainer.placement != "split":
        from polyrl.errors import ConfigError

        raise ConfigError(f"trainer.placement={trainer.placement!r}: choose 'colocated' or 'split'")
    actor = RayWorkerGroup(Worker, trainer.n_workers, resources_per_worker=resources, config=config,
                           roles=train_roles, manifest=manifest, master_port=free_port(), name="actor")
    rollout = RayWorkerGroup(Worker, trainer.rollout_workers, resources_per_worker=resources, config=config,
                             roles=["rollout"], manifest=manifest, master_port=free_port(), name="rollout")
    groups = RoleGroups(actor, rollout, actor if use_ref else None, actor if use_critic else None, False, owns_ray)
    return _place_replicas(groups, tp)


def _place_replicas(groups: RoleGroups, tp: int) -> RoleGroups:
    """With ``tp > 1``: plan replicas over the rollout group's ranks (one node each) and have every
    replica's leader build its engine over the replica's devices. The groups are stopped on error."""
    if tp == 1:
        return groups
    try:
        group = groups.rollout
        replicas = plan_replicas(group.world_size, tp, group.node_ids)
        device_ids = group.call_all("rollout_device_ids")
        args = []
        for rank in range(group.world_size):
            replica = replica_of(rank, replicas)
            ids = [i for r in replica.ranks for i in device_ids[r]]
            args.append((rank == replica.leader, ids))
        group.call_each("build_rollout_replica", args)
    except BaseException:
        groups.shutdown()
        raise
    groups.replicas = replicas
    return groups


def _resources(config: Any) -> dict[str, float]:
    from polyrl.platforms import detect_platform, get_platform

    device = config.trainer.device
    platform = detect_platform() if device == "auto" else get_platform(device)
    bundle: dict[str, float] = {"CPU": 1}
    if platform.ray_resource:
        bundle[platform.ray_resource] = 1
    return bundle


#: What Ray appends to its temp dir for its longest socket path: ``/session_<date>_<time>_<us>_<pid>/sockets/plasma_store``.
_RAY_SOCKET_SUFFIX = len("/session_2026-01-01_00-00-00_000000_4194304/sockets/plasma_store")
_UNIX_SOCKET_MAX = 107


def ray_temp_dir(run_dir: Path) -> Path:
    """``run_dir/ray``, or a short folder in the system temp dir when Ray's socket paths under it would
    not fit the 107 bytes a unix socket path may have (a deeply nested run directory)."""
    temp_dir = run_dir / "ray"
    if len(str(temp_dir.resolve()).encode()) + _RAY_SOCKET_SUFFIX > _UNIX_SOCKET_MAX:
        import tempfile

        temp_dir = Path(tempfile.mkdtemp(prefix="polyrl-ray-"))
    temp_dir.mkdir(parents=True, exist_ok=True)
    return temp_dir


def start_ray(config: Any, run_dir: Path) -> bool:
    """Start Ray for this run; False if Ray is already initialized in this process.

    With ``trainer.ray_address`` the driver joins that cluster (its auth settings apply). Otherwise a local
    Ray starts with temporary files under the run directory, its node address on loopback and no
    dashboard. Ray's token authentication is left as configured (on by default in recent Ray); tests opt
    out with ``RAY_AUTH_MODE=disabled`` in their environment. See docs/security.md.
    """
    import ray

    if ray.is_initialized():
        return False
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    env_vars = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "TOKENIZERS_PARALLELISM": "false"}
    if "RAY_AUTH_MODE" in os.environ:  # the workers follow the driver's choice, whatever it is
        env_vars["RAY_AUTH_MODE"] = os.environ["RAY_AUTH_MODE"]
    address = getattr(config.trainer, "ray_address", "") or ""
    if address:
        ray.init(address=address, log_to_driver=True, runtime_env={"env_vars": env_vars})
        return True
    temp_dir = ray_temp_dir(run_dir)
    num_cpus = config.trainer.ray_num_cpus or max(os.cpu_count() or 1, config.trainer.n_workers + config.trainer.rollout_workers)
    ray.init(
        num_cpus=num_cpus,
        _temp_dir=str(temp_dir),
        _node_ip_address="127.0.0.1",
        include_dashboard=False,
        log_to_driver=True,
        runtime_env={"env_vars": env_vars},
    )
    return True
