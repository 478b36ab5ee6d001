"""Worker groups: ``n`` SPMD copies of a worker class, driven from the controller.

Blocking calls (:meth:`WorkerGroup.call_all`, :meth:`~WorkerGroup.call_each`, :meth:`~WorkerGroup.dispatch`)
return the ranks' results. Non-blocking ones (:meth:`~WorkerGroup.call_all_async`,
:meth:`~WorkerGroup.call_rank_async`) return a :class:`CallHandle` at once: the driver goes on (generation
overlapping training, a weight load queued behind a generation) and later asks :meth:`CallHandle.done`,
waits with :meth:`CallHandle.result` or :func:`wait_any`, or drops it with :meth:`CallHandle.cancel`. Calls on
one rank run in the order they were made, blocking or not.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import CancelledError
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

from tensordict import TensorDict

from polyrl import batch as batch_ops
from polyrl.controller import deadlines
from polyrl.distributed import PORT_ATTEMPTS, port_in_use_error
from polyrl.errors import PolyrlError
from polyrl.platforms.devices import node_local_ranks


class CallHandle(Protocol):
    """A call in flight on one rank or on several (what the ``*_async`` calls of a :class:`WorkerGroup` return)."""

    def done(self) -> bool:
        """Whether the call finished (successfully or not): :meth:`result` would not block."""
        ...

    def result(self, timeout: float | None = None) -> Any:
        """The call's return value (a list in rank order for a call on several ranks), waiting up to ``timeout``
        seconds (``None``: as long as it takes). Raises ``TimeoutError`` when it is still running then, and the
        call's own error when it failed."""
        ...

    def cancel(self) -> None:
        """Stop waiting for the call: from now on it counts as done and :meth:`result` raises
        :class:`concurrent.futures.CancelledError`. A call already handed to its ranks still runs there (a rank
        runs its calls in order, and Ray cannot safely take back a call queued on an actor); a call that
        finished keeps its result."""
        ...


class CompletedCall:
    """A handle whose call already ran (the ``local`` executor runs it when it is made)."""

    def __init__(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        self._value: Any = None
        self._error: BaseException | None = None
        try:
            self._value = fn(*args, **kwargs)
        except Exception as exc:  # raised by result(), as a remote call's error would be
            self._error = exc

    def done(self) -> bool:
        return True

    def result(self, timeout: float | None = None) -> Any:
        if self._error is not None:
            raise self._error
        return self._value

    def cancel(self) -> None:
        pass  # it finished when it was made: it keeps its result


class RayCall:
    """A handle over the Ray object refs of one call: one ref (one rank) or a list (several ranks)."""

    def __init__(self, refs: list[Any], *, single: bool, owners: Sequence[tuple[Any, int]] = ()) -> None:
        self.refs = refs
        self.single = single
        self.cancelled = False
        #: The ``(group, rank)`` each ref runs on (named when a deadline passes or a rank is lost).
        self.owners = list(owners)

    def done(self) -> bool:
        import ray

        if self.cancelled:
            return True
        ready, _ = ray.wait(self.refs, num_returns=len(self.refs), timeout=0)
        return len(ready) == len(self.refs)

    def result(self, timeout: float | None = None) -> Any:
        import ray

        if self.cancelled:
            raise CancelledError("this worker call was cancelled")
        if timeout is None and self.owners and deadlines.current() is not None:  # bounded by the phase's deadline
            values = deadlines.wait_refs(self.refs, self.owners)
            return values[0] if self.single else values
        try:
            values = ray.get(self.refs, timeout=timeout)
        except ray.exceptions.GetTimeoutError as exc:
            raise TimeoutError(f"a worker call is still running after {timeout} s") from exc
        return values[0] if self.single else values

    def cancel(self) -> None:
        # not ray.cancel: on Ray 2.60 a queued actor call runs anyway, and one cancelled before it reached its
        # actor stalled the calls made after it
        if not self.done():
            self.cancelled = True


def wait_any(handles: Sequence[CallHandle], timeout: float | None = None) -> list[CallHandle]:
    """The handles among ``handles`` that are done, waiting up to ``timeout`` seconds (``None``: without limit)
    for at least one; ``[]`` when none finished in time."""
    done = [h for h in handles if h.done()]
    if done or not handles or timeout == 0:
        return done
    rays = [h for h in handles if isinstance(h, RayCall)]
    if len(rays) == len(handles):  # one wait on every ref: returns as soon as any call may be complete
        import ray

        ray.wait([r for h in rays for r in h.refs], num_returns=1, timeout=timeout)
        return [h for h in handles if h.done()]
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:  # handles of other kinds: poll
        done = [h for h in handles if h.done()]
        if done or (deadline is not None and time.monotonic() >= deadline):
            return done
        time.sleep(0.01)

logger = logging.getLogger("polyrl")

#: Seconds a worker group waits for Ray to place its workers, unless a restart or a phase has less time left.
PLACEMENT_WAIT_S = 600.0
#: The least a placement is given, even when a restart's wait is nearly used up.
PLACEMENT_MIN_S = 10.0
#: ``(monotonic deadline, what set it)`` of the waits in progress (:func:`placement_deadline`).
_placement_limits: list[tuple[float, str]] = []


class PlacementError(PolyrlError, RuntimeError):
    """Ray could not place a worker group's workers within the time it had."""


@contextmanager
def placement_deadline(seconds: float, what: str) -> Iterator[None]:
    """Inside, a worker group waits for its placement no longer than ``seconds`` from now (at least
    ``PLACEMENT_MIN_S``); ``what`` names the limit in the error (``what was left of trainer.restart_wait_s``)."""
    _placement_limits.append((time.monotonic() + max(float(seconds), PLACEMENT_MIN_S), what))
    try:
        yield
    finally:
        _placement_limits.pop()


def _placement_wait() -> tuple[float, str]:
    """How long a placement may wait now, and what sets that limit."""
    wait, what = PLACEMENT_WAIT_S, "the placement wait"
    for end, name in _placement_limits:
        if end - time.monotonic() < wait:
            wait, what = end - time.monotonic(), name
    p = deadlines.current()
    if p is not None and p.remaining() < wait:
        wait, what = p.remaining(), f"the deadline of phase '{p.name}'"
    return max(wait, 0.0), what


class WorkerGroup(Protocol):
    """``world_size`` ranks of one worker class.

    Every call names a method of the worker class; calls on one rank run in the order they were made.
    """

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

    def call_all_async(self, method: str, *args: Any, **kwargs: Any) -> CallHandle:
        """:meth:`call_all` without waiting: the handle's result is the list of every rank's return value."""
        ...

    def call_rank_async(self, rank: int, method: str, *args: Any, **kwargs: Any) -> CallHandle:
        """Call ``method`` on rank ``rank`` alone without waiting; the handle's result is its return value."""
        ...

    def share(self, value: Any) -> Any:
        """``value`` in a form that every rank receives as an argument without one copy per call (Ray: one
        object in the object store); pass the result where ``value`` would go."""
        ...

    def dp_size(self, method: str) -> int:
        """How many data-parallel shards :meth:`dispatch` splits the batches of ``method`` into."""
        ...

    def shutdown(self) -> None:
        """Stop the workers."""
        ...


@dataclass(frozen=True)
class DPLayout:
    """Where each rank sits for one dispatched method: ranks of one data-parallel group get the same shard,
    and the group's collector returns the result (verl: dispatch by DP, collect from TP rank 0 on the last
    pipeline stage)."""

    dp_rank: tuple[int, ...]
    dp_size: int
    collects: tuple[bool, ...]

    @classmethod
    def of(cls, reports: Sequence[tuple[int, int, bool]], method: str) -> DPLayout:
        """Check the ranks' ``(dp_rank, dp_size, collects_output)`` reports and build the layout."""
        sizes = {int(r[1]) for r in reports}
        if len(sizes) != 1:
            raise RuntimeError(f"{method}: the ranks disagree on the data-parallel size ({sorted(sizes)})")
        size = sizes.pop()
        ranks = tuple(int(r[0]) for r in reports)
        collects = tuple(bool(r[2]) for r in reports)
        if size < 1 or any(not 0 <= d < size for d in ranks):
            raise RuntimeError(f"{method}: data-parallel ranks {ranks} do not fit a data-parallel size of {size}")
        per_group = [sum(c for d, c in zip(ranks, collects) if d == g) for g in range(size)]
        if per_group != [1] * size:
            raise RuntimeError(f"{method}: each data-parallel group needs exactly one rank that collects its output; "
                               f"collectors per group: {per_group} (ranks {ranks}, collects {collects})")
        return cls(ranks, size, collects)

    @classmethod
    def by_rank(cls, world_size: int) -> DPLayout:
        """Every rank is its own data-parallel group (pure data parallelism)."""
        return cls(tuple(range(world_size)), world_size, (True,) * world_size)

    def gather(self, results: Sequence[Any]) -> list[Any]:
        """The collectors' results, in data-parallel order."""
        out: list[Any] = [None] * self.dp_size
        for d, c, r in zip(self.dp_rank, self.collects, results):
            if c:
                out[d] = r
        return out


def _merge(results: list[Any]) -> Any:
    if isinstance(results[0], TensorDict):
        return batch_ops.concat(results)
    if isinstance(results[0], list):
        return [x for r in results for x in r]
    return results


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

    def call_all_async(self, method: str, *args: Any, **kwargs: Any) -> CallHandle:
        """Runs the call now; the handle is complete (its result a one-item list)."""
        return CompletedCall(lambda: [getattr(self.worker, method)(*args, **kwargs)])

    def call_rank_async(self, rank: int, method: str, *args: Any, **kwargs: Any) -> CallHandle:
        """Runs the call now; the handle is complete."""
        if rank != 0:
            raise IndexError(f"rank {rank}: the local executor has one rank (0)")
        return CompletedCall(getattr(self.worker, method), *args, **kwargs)

    def share(self, value: Any) -> Any:
        return value

    def dp_size(self, method: str) -> int:
        return 1

    def shutdown(self) -> None:
        close = getattr(self.worker, "close", None)
        if close is not None:
            close()


def _ray_actor_class(worker_cls: type) -> type:
    """``worker_cls`` as a Ray actor: its constructor takes ``actor_env`` (``LOCAL_RANK``... set before the
    worker's own constructor runs), the process ignores SIGINT (a Ctrl-C in a terminal reaches every process
    of the foreground group, and the driver decides when the run stops: polyrl.trainer.interrupt) and dumps its
    Python stacks on SIGUSR2 (:mod:`polyrl.controller.deadlines`)."""

    class RayActor(worker_cls):  # type: ignore[misc,valid-type]
        def __init__(self, *, actor_env: dict[str, str], **kwargs: Any) -> None:
            import signal
            import threading

            os.environ.update(actor_env)
            if threading.current_thread() is threading.main_thread():
                signal.signal(signal.SIGINT, signal.SIG_IGN)
            # the driver asks for this process's stacks when a phase passes its deadline (controller/deadlines.py)
            self._polyrl_stack_file = deadlines.install_stack_dump()
            super().__init__(**kwargs)

        def polyrl_process_info(self) -> dict[str, Any]:
            """pid, host, node address and stack-dump file of this worker (error lines and stack dumps)."""
            return deadlines.process_info(self._polyrl_stack_file)

    RayActor.__name__ = worker_cls.__name__  # what Ray shows in its logs and errors
    RayActor.__doc__ = worker_cls.__doc__
    return RayActor


def _bundle_nodes(placement_group: Any, count: int) -> list[str]:
    """The node id of each bundle of a ready placement group, in bundle order."""
    from ray.util.placement_group import placement_group_table

    table = placement_group_table(placement_group).get("bundles_to_node_id", {})
    return [str(table.get(i, "")) for i in range(count)]


def rank_order(bundle_nodes: Sequence[str], driver_node: str) -> list[int]:
    """The bundle each rank takes (``rank_order(...)[rank]``): the ranks of one node consecutive, the driver's node
    first, then the other nodes in the order Ray listed them. Ray numbers the bundles of a placement group that spans
    nodes in no fixed order, so without this the node of rank 0 (where the group meets, and the weights' sender)
    changes from run to run."""
    firsts: dict[str, int] = {}
    for i, node in enumerate(bundle_nodes):
        firsts.setdefault(node, i)
    return sorted(range(len(bundle_nodes)),
                  key=lambda i: (bundle_nodes[i] != driver_node, firsts[bundle_nodes[i]], i))


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
        strategy: str = "PACK",
        **init_kwargs: Any,
    ) -> None:
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.world_size = world_size
        bundle = dict(resources_per_worker or {"CPU": 1})
        # strategy (trainer.placement_strategy): PACK fills as few nodes as it can and spreads a group that does
        # not fit one node over several; the STRICT_ variants refuse instead
        self.placement_group = placement_group([bundle] * world_size, strategy=strategy, name=f"polyrl-{name}")
        wait, limit = _placement_wait()
        try:
            ray.get(self.placement_group.ready(), timeout=wait)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(self.placement_group)
            raise PlacementError(
                f"worker group '{name}': Ray could not place {world_size} worker(s) of {bundle} each with strategy "
                f"{strategy} within {wait:.0f} s ({limit}); the cluster's available resources: "
                f"{ray.available_resources()} of {ray.cluster_resources()}. Add nodes or resources, lower "
                "trainer.n_workers / trainer.rollout_workers, or relax trainer.placement_strategy") from None
        # Each worker learns its position on its node as LOCAL_RANK (torchrun's convention); the platform
        # binds the device from it and from the device ids Ray assigned (polyrl.platforms.devices).
        bundle_nodes = _bundle_nodes(self.placement_group, world_size)
        bundles = rank_order(bundle_nodes, ray.get_runtime_context().get_node_id())
        nodes = [bundle_nodes[b] for b in bundles]
        #: The Ray node id of each rank (rollout replicas must not span nodes: polyrl.rollout.replicas).
        self.node_ids = nodes
        self.local_ranks = node_local_ranks(nodes)
        own_rendezvous = "master_port" in init_kwargs and "master_addr" not in init_kwargs
        remote_cls: Any = ray.remote(_ray_actor_class(worker_cls))
        options: dict[str, Any] = {"num_cpus": bundle.get("CPU", 1)}
        extra = {k: v for k, v in bundle.items() if k not in ("CPU", "GPU")}
        if bundle.get("GPU"):
            options["num_gpus"] = bundle["GPU"]
        if extra:
            options["resources"] = extra
        if env:  # variables a process must have from its start (Ray reads some before the constructor runs)
            options["runtime_env"] = {"env_vars": dict(env)}
        # No runtime_env otherwise: an actor with one waits for a new worker process of its own, while one
        # without takes a worker Ray started ahead (seconds faster to a ready group; docs/benchmarks.md)
        for attempt in range(PORT_ATTEMPTS):
            if own_rendezvous:
                # torch.distributed meets at rank 0's node (loopback when every rank is on the driver's node)
                from polyrl.controller.cluster import rendezvous_address

                init_kwargs["master_addr"], init_kwargs["master_port"] = rendezvous_address(nodes)
            self.workers = [
                remote_cls.options(
                    name=None,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(self.placement_group,
                                                                         placement_group_bundle_index=bundles[i]),
                    **options,
                ).remote(rank=i, world_size=world_size, actor_env={
                    "LOCAL_RANK": str(self.local_ranks[i]), "LOCAL_WORLD_SIZE": str(nodes.count(nodes[i])),
                    "TOKENIZERS_PARALLELISM": os.environ.get("TOKENIZERS_PARALLELISM", "false")}, **init_kwargs)
                for i in range(world_size)
            ]
            try:
                # Constructors run concurrently (they meet in init_process_group); the first failure ends the wait
                deadlines.wait_refs([w.ready.remote() for w in self.workers])  # no owners: not a lost worker
                break
            except Exception as exc:
                for w in self.workers:
                    ray.kill(w)
                if not (own_rendezvous and port_in_use_error(exc)) or attempt == PORT_ATTEMPTS - 1:
                    remove_placement_group(self.placement_group)
                    raise
                logger.info("worker group '%s': rendezvous port %s was taken before rank 0 used it; starting the "
                            "group again on another port", name, init_kwargs["master_port"])
        #: pid, host, address and stack file of each rank (:mod:`polyrl.controller.deadlines`).
        self.processes: list[dict[str, Any]] = ray.get([w.polyrl_process_info.remote() for w in self.workers],
                                                       timeout=120)
        #: Set when a deadline passed or a rank was lost: :meth:`shutdown` kills the workers without asking them.
        self.wedged = False
        self.name = name
        for rank, info in enumerate(self.processes):
            logger.debug("worker group '%s': rank %d is pid %s on host %s (%s)", name, rank, info["pid"], info["host"],
                         info["ip"])
        deadlines.register_group(self)
        self._worker_cls = worker_cls
        self._layouts: dict[str, DPLayout] = {}

    def layout(self, method: str) -> DPLayout:
        """The data-parallel layout of ``method``'s batches, asked of every rank once (``dp_layout``);
        worker classes without ``dp_layout`` split by rank."""
        if method not in self._layouts:
            if hasattr(self._worker_cls, "dp_layout"):
                self._layouts[method] = DPLayout.of(self.call_all("dp_layout", method), method)
            else:
                self._layouts[method] = DPLayout.by_rank(self.world_size)
        return self._layouts[method]

    def dp_size(self, method: str) -> int:
        return self.layout(method).dp_size

    def call_all(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Within the current phase's deadline (:mod:`polyrl.controller.deadlines`); a lost rank ends the wait."""
        refs = [getattr(w, method).remote(*args, **kwargs) for w in self.workers]
        return deadlines.wait_refs(refs, [(self, r) for r in range(self.world_size)])

    def call_each(self, method: str, per_rank_args: Sequence[tuple], **kwargs: Any) -> list[Any]:
        refs = [getattr(w, method).remote(*a, **kwargs) for w, a in zip(self.workers, per_rank_args)]
        return deadlines.wait_refs(refs, [(self, r) for r in range(len(refs))])

    def call_all_async(self, method: str, *args: Any, **kwargs: Any) -> CallHandle:
        return RayCall([getattr(w, method).remote(*args, **kwargs) for w in self.workers], single=False,
                       owners=[(self, r) for r in range(self.world_size)])

    def call_rank_async(self, rank: int, method: str, *args: Any, **kwargs: Any) -> CallHandle:
        if not 0 <= rank < self.world_size:
            raise IndexError(f"rank {rank}: this group has ranks 0 to {self.world_size - 1}")
        return RayCall([getattr(self.workers[rank], method).remote(*args, **kwargs)], single=True,
                       owners=[(self, rank)])

    def share(self, value: Any) -> Any:
        import ray

        return ray.put(value)

    def dispatch(self, method: str, batch: Any, **kwargs: Any) -> Any:
        """Split ``batch`` into the method's data-parallel shards; every rank of a data-parallel group gets
        its group's shard (put in the object store once), and only the groups' collectors' results return."""
        import ray

        layout = self.layout(method)
        shards = _split_rows(batch, layout.dp_size)
        if layout.dp_size < self.world_size:  # shared by several ranks: serialise each shard once
            shards = [ray.put(s) for s in shards]
        results = self.call_each(method, [(shards[d],) for d in layout.dp_rank], **kwargs)
        return _merge(layout.gather(results))

    def shutdown(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        if not self.wedged:  # a wedged rank would not answer: kill at once
            closes = []
            for w in self.workers:
                try:
                    closes.append(w.close.remote())
                except Exception:  # the worker may already be gone; killing it is what matters
                    pass
            if closes:
                ray.wait(closes, num_returns=len(closes), timeout=60)
        for w in self.workers:
            try:
                ray.kill(w)
            except Exception:
                pass
        remove_placement_group(self.placement_group)
