"""Role groups: the worker group serving each role, started from the run's placement, and the calls that
span groups.

``trainer.placement`` (:mod:`polyrl.trainer.placement`) puts each role in a pool; each pool becomes one worker
group whose every rank holds the pool's roles. ``colocated`` (default): one group holding actor, rollout and,
when used, reference, critic and reward model (the hybrid engine; weights move in-process). ``split``: the
rollout in its own pool of ``trainer.rollout_workers`` processes. A mapping places any role in any named pool.
Weights travel from actor rank 0 to a rollout in another pool through a process group or Ray's object store
(``trainer.weight_transfer``; :mod:`polyrl.trainer.weight_sync` holds every weight path), and a frozen role
that shares its pool frees its device memory between calls (its :class:`~polyrl.trainer.roles.RoleSpec`).
The ``local`` executor puts one rank of everything in the driver process.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tensordict import TensorDict

from polyrl import batch as batch_ops
from polyrl.controller.worker_group import LocalWorkerGroup, RayWorkerGroup, WorkerGroup
from polyrl.distributed import free_port
from polyrl.manifest import Manifest
from polyrl.protocols import SamplingParams
from polyrl.rollout.replicas import Replica, plan_replicas, replica_call_args, replica_of
from polyrl.trainer.placement import Placement, check_pools_fit, resolve_placement
from polyrl.trainer.role_worker import Worker
from polyrl.trainer.roles import RoleSpec, role_specs_by_name
from polyrl.trainer.weight_sync import WeightSync, make_weight_sync

#: ``Platform.memory_stats`` keys (GiB) -> the metric names the trainer logs them under (verl's ``perf/*_gb``).
MEMORY_METRICS = {"max_allocated_gib": "max_memory_allocated_gb", "reserved_gib": "memory_reserved_gb",
                  "allocated_gib": "memory_allocated_gb", "max_rss_gib": "max_rss_gb"}

log = logging.getLogger("polyrl")


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
    #: How actor weights reach the rollout (:mod:`polyrl.trainer.weight_sync`); ``None``: in-process when
    #: colocated, through the object store when split.
    weight_sync: WeightSync | None = None
    #: The group of every role the run uses, roles beyond the built-in four included (``reward_model``...).
    roles: dict[str, WorkerGroup] = field(default_factory=dict)
    #: The roles that train (their groups save and load checkpoints).
    trained_roles: tuple[str, ...] = ("actor", "critic")
    #: The resolved placement (``None`` when the groups were put together by hand).
    placement: Placement | None = None

    def __post_init__(self) -> None:
        for name, group in (("actor", self.actor), ("rollout", self.rollout), ("ref", self.ref),
                            ("critic", self.critic)):
            if group is not None:
                self.roles.setdefault(name, group)
        if self.weight_sync is None:
            self.weight_sync = make_weight_sync(self.actor, self.rollout, colocated=self.colocated)

    def group_of(self, role: str) -> WorkerGroup | None:
        """The group serving ``role`` (``None`` when the run does not use it)."""
        return self.roles.get(role)

    @property
    def reward_model(self) -> WorkerGroup | None:
        """The group serving the ``reward_model`` role, if the run has one."""
        return self.roles.get("reward_model")

    def _distinct(self, groups: Sequence[WorkerGroup | None]) -> list[WorkerGroup]:
        seen: dict[int, WorkerGroup] = {}
        for group in groups:
            if group is not None:
                seen.setdefault(id(group), group)
        return list(seen.values())

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

    def sync_weights(self) -> dict[str, float]:
        """Actor weights -> rollout, blocking (in-process when colocated; when split, through a process group or
        the object store, ``trainer.weight_transfer``); a split rollout then frees its memory until it generates."""
        assert self.weight_sync is not None
        metrics = self.weight_sync.sync()
        if not self.colocated:
            self.rollout.call_all("sleep_rollout")
        return metrics

    def memory_metrics(self) -> dict[str, float]:
        """Each group's memory (``Platform.memory_stats`` of every rank, the largest): ``perf/<group>/<stat>``,
        ``<group>`` being ``colocated`` (one group for every role) or ``actor`` and ``rollout`` (split)."""
        named = [("colocated", self.actor)] if self.rollout is self.actor else [("actor", self.actor),
                                                                               ("rollout", self.rollout)]
        out: dict[str, float] = {}
        for label, group in named:
            for stats in group.call_all("memory_stats"):
                for key, value in stats.items():
                    name = f"perf/{label}/{MEMORY_METRICS.get(key, key)}"
                    out[name] = max(out.get(name, float("-inf")), float(value))
        return out

    def _trained_groups(self) -> list[WorkerGroup]:
        return self._distinct([self.roles.get(r) for r in self.trained_roles])

    def save_checkpoint(self, path: str) -> None:
        """Every group that trains something saves into ``path`` (each rank its trained engines)."""
        for group in self._trained_groups():
            group.call_all("save_checkpoint", path)

    def load_checkpoint(self, path: str) -> None:
        """Restore every training group from ``path``."""
        for group in self._trained_groups():
            group.call_all("load_checkpoint", path)

    def distinct(self) -> list[WorkerGroup]:
        """Each group once (roles may share a group), in role order: actor, rollout, ref, critic, then the
        roles beyond those (``reward_model``...)."""
        return self._distinct([self.actor, self.rollout, self.ref, self.critic, *self.roles.values()])

    def shutdown(self) -> None:
        """Stop every group once."""
        for group in self.distinct():
            group.shutdown()
        if self.owns_ray:
            import ray

            ray.shutdown()


@dataclass
class StartedGroup:
    """A worker group and whether starting it started Ray (then :meth:`shutdown` stops Ray too)."""

    group: WorkerGroup
    owns_ray: bool = False

    def shutdown(self) -> None:
        self.group.shutdown()
        if self.owns_ray:
            import ray

            ray.shutdown()


def start_role_group(config: Any, *, roles: list[str], manifest: Manifest | None, name: str, run_dir: Path,
                     role_kind: str = "rl", world_size: int | None = None,
                     worker_cls: type | None = None, role_specs: Sequence[RoleSpec] = ()) -> WorkerGroup:
    """Start the worker group of ``roles`` (``polyrl train``, ``sft`` and ``export`` all come here).

    ``trainer.executor=local`` runs one rank in this process; ``ray`` starts ``world_size`` (default
    ``trainer.n_workers``) actors, each with one CPU and one of the platform's accelerators
    (``trainer.device``), in a placement group named ``polyrl-<name>``. With the ``ray`` executor Ray must
    already run in this process (:func:`start_ray`, or :func:`open_role_group` which starts it).
    ``role_specs`` describe the roles beyond actor / rollout / ref / critic among ``roles``.
    """
    cls = worker_cls or Worker
    kwargs: dict[str, Any] = dict(config=config, roles=roles, manifest=manifest, master_port=free_port(),
                                  role_kind=role_kind)
    specs = [s for s in role_specs if s.name in roles]
    if specs:  # only then: a worker class written before roles were declarable still starts
        kwargs["role_specs"] = specs
    if config.trainer.executor == "local":
        return LocalWorkerGroup(cls, **kwargs)
    size = world_size if world_size is not None else config.trainer.n_workers
    from polyrl.controller.cluster import prepare_cluster  # strategy checked; every node's plugins on a cluster

    strategy = prepare_cluster(config, manifest)
    return RayWorkerGroup(cls, size, resources_per_worker=_resources(config), name=name, strategy=strategy, **kwargs)


def open_role_group(config: Any, *, roles: list[str], manifest: Manifest | None, name: str, run_dir: Path,
                    role_kind: str = "rl", worker_cls: type | None = None) -> StartedGroup:
    """Start Ray when the executor needs it and this process has none, then :func:`start_role_group`;
    the result's ``shutdown()`` stops both."""
    owns_ray = config.trainer.executor != "local" and start_ray(config, run_dir)
    try:
        group = start_role_group(config, roles=roles, manifest=manifest, name=name, run_dir=run_dir,
                                 role_kind=role_kind, worker_cls=worker_cls)
    except BaseException:
        if owns_ray:
            import ray

            ray.shutdown()
        raise
    return StartedGroup(group, owns_ray)


def run_roles(config: Any, *, use_ref: bool, use_critic: bool, extra_roles: Sequence[RoleSpec] = ()) -> list[str]:
    """The roles a run starts: actor and rollout, the reference (a separate engine unless the actor has LoRA:
    then the actor serves it), the critic, and ``extra_roles``."""
    lora = config.actor.model.lora.rank > 0
    return (["actor", "rollout"] + (["ref"] if use_ref and not lora else []) + (["critic"] if use_critic else [])
            + [s.name for s in extra_roles])


def plan_placement(config: Any, *, use_ref: bool, use_critic: bool,
                   extra_roles: Sequence[RoleSpec] = ()) -> Placement:
    """Resolve ``trainer.placement`` for this run's roles and run every check that needs no process: the
    placement itself, a LoRA actor's reference (the actor serves it, so it cannot have a pool of its own),
    that ``rollout.tensor_parallel_size`` divides the rollout's pool, and, for a local Ray of
    ``trainer.ray_num_cpus`` CPUs, that the pools' workers fit them."""
    roles = run_roles(config, use_ref=use_ref, use_critic=use_critic, extra_roles=extra_roles)
    known = ["actor", "rollout", "ref", "critic", "reward_model", *(s.name for s in extra_roles)]
    placement = resolve_placement(config, roles, known_roles=known)
    lora = config.actor.model.lora.rank > 0
    mapping = config.trainer.placement
    if lora and use_ref and hasattr(mapping, "get") and mapping.get("ref") not in (None, mapping.get("actor")):
        from polyrl.errors import ConfigError

        raise ConfigError(f"trainer.placement.ref={mapping.get('ref')}: with a LoRA actor the reference is the actor "
                          "with its adapter disabled, so it lives in the actor's pool; drop ref from "
                          "trainer.placement")
    plan_replicas(placement.size_of("rollout"), config.rollout.tensor_parallel_size)
    t = config.trainer
    if t.executor == "ray" and t.ray_num_cpus:
        from polyrl.controller.cluster import cluster_address

        if not cluster_address(config):  # the local Ray this run starts will have exactly ray_num_cpus CPUs
            check_pools_fit(placement, {"CPU": float(t.ray_num_cpus)}, None)
    return placement


def build_role_groups(config: Any, *, manifest: Manifest | None, use_ref: bool, use_critic: bool,
                      run_dir: Path, worker_cls: type | None = None,
                      extra_roles: Sequence[RoleSpec] = ()) -> RoleGroups:
    """Start the worker groups the run's placement asks for (``worker_cls``: the trainer's worker class;
    ``extra_roles``: roles beyond actor / rollout / ref / critic, e.g. ``reward_model``)."""
    trainer = config.trainer
    specs = role_specs_by_name(extra_roles)
    placement = plan_placement(config, use_ref=use_ref, use_critic=use_critic, extra_roles=list(specs.values()))
    tp = config.rollout.tensor_parallel_size
    trained = ("actor", "critic", *(s.name for s in specs.values() if s.trains))
    start = dict(manifest=manifest, run_dir=run_dir, worker_cls=worker_cls, role_specs=list(specs.values()))
    if trainer.executor == "local":
        (pool,) = placement.pools
        group = start_role_group(config, roles=list(pool.roles), name="local", **start)
        return RoleGroups(group, group, group if use_ref else None, group if use_critic else None, True,
                          roles={r: group for r in pool.roles}, trained_roles=trained, placement=placement)
    from polyrl.trainer.weight_sync import resolve_weight_transfer

    colocated = placement.shares("actor", "rollout")
    transfer = None if colocated else resolve_weight_transfer(config, run_platform(config))
    owns_ray = start_ray(config, run_dir, workers=placement.total_workers)
    started: list[WorkerGroup] = []
    try:
        _check_cluster(config, placement)
        log.info("placement (%s): %s", placement.spelling, placement.describe())
        by_pool: dict[str, WorkerGroup] = {}
        for pool in placement.pools:
            started.append(start_role_group(config, roles=list(pool.roles), name=pool.name, world_size=pool.size,
                                            **start))
            by_pool[pool.name] = started[-1]
        roles = {role: by_pool[pool.name] for pool in placement.pools for role in pool.roles}
        actor, rollout = roles["actor"], roles["rollout"]
        # with a LoRA actor the actor serves the reference (its adapter disabled)
        ref = roles.get("ref", actor) if use_ref else None
        if ref is not None:
            roles["ref"] = ref
        groups = RoleGroups(actor, rollout, ref, roles.get("critic"), colocated, owns_ray, roles=roles,
                            trained_roles=trained, placement=placement)
        groups = _place_replicas(groups, tp)
        if not colocated:
            leaders = [r.leader for r in groups.replicas] if groups.replicas else list(range(rollout.world_size))
            groups.weight_sync = make_weight_sync(actor, rollout, colocated=False, transfer=transfer, leaders=leaders)
        return groups
    except BaseException:  # a group that failed to start (or a node check) must not leave Ray or workers behind
        for group in started:
            try:
                group.shutdown()
            except Exception:  # already stopped (_place_replicas stops the groups it fails on)
                pass
        if owns_ray:
            import ray

            ray.shutdown()
        raise


def _check_cluster(config: Any, placement: Placement) -> None:
    """The pools must fit the Ray cluster this process joined or started (one CPU and one accelerator each)."""
    import ray

    check_pools_fit(placement, ray.cluster_resources(), run_platform(config).ray_resource)


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


def run_platform(config: Any) -> Any:
    """The platform ``trainer.device`` names (``auto``: the detected one), as the driver places pools for it."""
    from polyrl.platforms import detect_platform, get_platform

    device = config.trainer.device
    return detect_platform() if device == "auto" else get_platform(device)


def _resources(config: Any) -> dict[str, float]:
    platform = run_platform(config)
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


def start_ray(config: Any, run_dir: Path, *, workers: int | None = None) -> bool:
    """Start Ray for this run; False if Ray is already initialized in this process.

    With ``trainer.ray_address`` (or, when that is empty, the ``RAY_ADDRESS`` environment variable) the
    driver joins that cluster (its auth settings apply; no resource counts are passed: the cluster's nodes
    declared theirs in ``ray start``). Otherwise a local Ray starts with temporary files under the run
    directory, its node address on loopback and no dashboard. Ray's token authentication is left as configured (on by default in recent Ray); tests opt
    out with ``RAY_AUTH_MODE=disabled`` in their environment. See docs/security.md.

    A local Ray's workers inherit the driver's environment (``OMP_NUM_THREADS``, ``RAY_AUTH_MODE``...), so no
    runtime environment is set: Ray then hands the actors worker processes it started ahead. Ray's log records go
    to ``RUN_DIR/train.log`` (its errors to the console too) and what its workers print reaches the console above
    the progress bar (:mod:`polyrl.logs`).
    """
    from polyrl.trainer.executor import RAY_INSTALL, ray_installed

    if not ray_installed():
        from polyrl.errors import ConfigError

        raise ConfigError(f"trainer.executor=ray needs Ray, which is not installed: {RAY_INSTALL} "
                          "(or trainer.executor=local)")
    import ray

    if ray.is_initialized():
        return False
    import logging

    from polyrl.logs import route_ray_logger, route_ray_worker_output

    route_ray_logger()
    from polyrl.controller.cluster import cluster_address

    address = cluster_address(config)
    if address:
        from polyrl.controller.cluster import check_reachable

        check_reachable(address)  # ray.init would retry an address nobody answers for minutes
        env_vars = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "TOKENIZERS_PARALLELISM": "false"}
        if "RAY_AUTH_MODE" in os.environ:  # the workers follow the driver's choice, whatever it is
            env_vars["RAY_AUTH_MODE"] = os.environ["RAY_AUTH_MODE"]
        ray.init(address=address, log_to_driver=True, runtime_env={"env_vars": env_vars},
                 logging_level=logging.INFO)
        route_ray_worker_output()
        return True
    temp_dir = ray_temp_dir(run_dir)
    t = config.trainer
    # enough CPUs for every worker (``workers``: the pools' total), unless the user set a number
    workers = workers if workers is not None else t.n_workers + t.rollout_workers
    num_cpus = t.ray_num_cpus or max(os.cpu_count() or 1, workers)
    # Ray starts num_cpus worker processes ahead and the actors take them. When that is about the number of
    # workers the run starts, those processes import torch, the worker, the engine and the rollout while Ray
    # finishes starting (an actor then only builds its models); on a machine with many more cores than workers
    # the spare processes would import them for nothing.
    preload = {"preload_python_modules": worker_modules(config)} if num_cpus <= workers + 1 else {}
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # what Ray gives an actor of one CPU; set before a preload
    ray.init(
        num_cpus=num_cpus,
        _temp_dir=str(temp_dir),
        _node_ip_address="127.0.0.1",
        include_dashboard=False,
        log_to_driver=True,
        logging_level=logging.INFO,
        _system_config=preload,
    )
    route_ray_worker_output()
    return True


def worker_modules(config: Any) -> list[str]:
    """What a worker process imports before it becomes an actor (Ray's ``preload_python_modules``): torch,
    transformers, tensordict, the worker and the modules of the engines and the rollout the config names."""
    modules = ["torch", "tensordict", "transformers", "polyrl.trainer.role_worker"]
    try:
        from polyrl.plugins import get_plugin_manager

        pm = get_plugin_manager()
        targets = [pm.entry("engine", config.actor.engine).target_name, pm.entry("rollout", config.rollout.name).target_name]
    except Exception:  # a name no plugin registers is reported with its key elsewhere; preloading is only a head start
        targets = []
    for target in targets:
        module = str(target).split(":", 1)[0]
        if module and module not in modules and "<" not in module:
            modules.append(module)
    return modules
