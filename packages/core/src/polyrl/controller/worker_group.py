"""Worker groups: ``n`` SPMD copies of a worker class, driven from the controller."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, Protocol

from tensordict import TensorDict

from polyrl import batch as batch_ops
from polyrl.platforms.placement import node_local_ranks


class WorkerGroup(Protocol):
    """``world_size`` ranks of one worker class."""

    world_size: int
    #: The node of each rank, in rank order.
    node_ids: list[str]

    def call_all(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Call ``method`` on every rank with the same arguments; results in rank order."""
        ...

    def call_each(self, method: str, per_rank_args: Sequence[tuple], **kwargs: Any) -> list[Any]:
        """Call ``method`` on rank ``i`` with ``per_rank_args[i]``."""
        ...

    def dispatch(self, method: str, batch: TensorDict, **kwargs: Any) -> TensorDict:
        """Split ``batch`` by data-parallel rank, call ``method`` on each shard, concatenate."""
        ...

    def shutdown(self) -> None:
        """Stop the workers."""
        ...


def _split_rows(rows: Any, parts: int) -> list[Any]:
    if isinstance(rows, TensorDict):
        return batch_ops.split(rows, parts)
    if len(rows) % parts:
        raise ValueError(f"{len(rows)} items do not split evenly over {parts} data-parallel ranks")
    step = len(rows) // parts
    return [rows[i * step : (i + 1) * step] for i in range(parts)]


class LocalWorkerGroup:
    """One rank in the driver's own process (``trainer.executor=local``): step through it in a debugger."""

    world_size = 1
    #: The node of each rank (one, this process's).
    node_ids: list[str] = [""]

    def __init__(self, worker_cls: type, **init_kwargs: Any) -> None:
        self.worker = worker_cls(rank=0, world_size=1, **init_kwargs)

    def call_all(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        return [getattr(self.worker, method)(*args, **kwargs)]

    def call_each(self, method: str, per_rank_args: Sequence[tuple], **kwargs: Any) -> list[Any]:
        return [getattr(self.worker, method)(*per_rank_args[0], **kwargs)]

    def dispatch(self, method: str, batch: Any, **kwargs: Any) -> Any:
        return getattr(self.worker, method)(batch, **kwargs)

    def shutdown(self) -> None:
        close = getattr(self.worker, "close", None)
        if close is not None:
            close()


def _bundle_nodes(placement_group: Any, count: int) -> list[str]:
    """The node id of each bundle of a ready placement group (bundle order = rank order)."""
    from ray.util.placement_group import placement_group_table

    table = placement_group_table(placement_group).get("bundles_to_node_id", {})
    return [str(table.get(i, "")) for i in range(count)]


class RayWorkerGroup:
    """``world_size`` Ray actors in one placement group (a resource pool), one bundle each."""

    def __init__(
        self,
        worker_cls: type,
        world_size: int,
        *,
        resources_per_worker: dict[str, float] | None = None,
        env: dict[str, str] | None = None,
        name: str = "workers",
        **init_kwargs: Any,
    ) -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.world_size = world_size
        bundle = dict(resources_per_worker or {"CPU": 1})
        self.placement_group = placement_group([bundle] * world_size, strategy="PACK", name=f"polyrl-{name}")
        ray.get(self.placement_group.ready(), timeout=600)
        env_vars = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **(env or {})}
        # Each worker learns its position on its node as LOCAL_RANK (torchrun's convention); the platform
        # binds the device from it and from the device ids Ray assigned (polyrl.platforms.placement).
        nodes = _bundle_nodes(self.placement_group, world_size)
        #: The Ray node id of each rank (rollout replicas must not span nodes: polyrl.rollout.replicas).
        self.node_ids = nodes
        self.local_ranks = node_local_ranks(nodes)
        remote_cls = ray.remote(worker_cls)
        options: dict[str, Any] = {"num_cpus": bundle.get("CPU", 1)}
        extra = {k: v for k, v in bundle.items() if k not in ("CPU", "GPU")}
        if bundle.get("GPU"):
            options["num_gpus"] = bundle["GPU"]
        if extra:
            options["resources"] = extra
        self.workers = [
            remote_cls.options(
                name=None,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.placement_group, placement_group_bundle_index=i),
                runtime_env={"env_vars": {**env_vars, "LOCAL_RANK": str(self.local_ranks[i]),
                                          "LOCAL_WORLD_SIZE": str(nodes.count(nodes[i]))}},
                **options,
            ).remote(rank=i, world_size=world_size, **init_kwargs)
            for i in range(world_size)
        ]
        # Constructors run concurrently (they meet in init_process_group); wait for all.
        ray.get([w.ready.remote() for w in self.workers])

    def call_all(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        import ray

        return ray.get([getattr(w, method).remote(*args, **kwargs) for w in self.workers])

    def call_each(self, method: str, per_rank_args: Sequence[tuple], **kwargs: Any) -> list[Any]:
        import ray

        return ray.get([getattr(w, method).remote(*a, **kwargs) for w, a in zip(self.workers, per_rank_args)])

    def dispatch(self, method: str, batch: Any, **kwargs: Any) -> Any:
        shards = _split_rows(batch, self.world_size)
        results = self.call_each(method, [(s,) for s in shards], **kwargs)
        if isinstance(results[0], TensorDict):
            return batch_ops.concat(results)
        if isinstance(results[0], list):
            return [x for r in results for x in r]
        return results

    def shutdown(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        for w in self.workers:
            try:
                ray.get(w.close.remote(), timeout=60)
            except Exception:  # the worker may already be gone; killing it is what matters
                pass
            ray.kill(w)
        remove_placement_group(self.placement_group)
