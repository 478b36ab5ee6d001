"""Weight sync: how the actor's weights reach the rollout after an update. This module owns every path.

Driver side, one class per path (:func:`make_weight_sync` picks it from the placement and
``trainer.weight_transfer``); :class:`~polyrl.trainer.role_groups.RoleGroups` holds the run's:

- :class:`ColocatedWeightSync` (``trainer.placement=colocated`` and the ``local`` executor): each rank streams
  its actor's weights into its own rollout, bucket by bucket, in-process (:func:`stream_into_rollout`).
- :class:`ObjectStoreWeightSync` (split, ``trainer.weight_transfer=object_store``): actor rank 0 returns its
  buckets to the driver (:func:`gather_buckets`), which shares them once (``WorkerGroup.share``: Ray's object
  store) and has every rollout rank load them (:func:`load_buckets`): device -> host -> shared memory -> host
  -> device.
- :class:`CollectiveWeightSync` (split, ``collective``, what ``auto`` picks): actor rank 0 and the rollout
  replicas' leaders form a process group of their own (a c10d backend over a ``TCPStore`` on actor rank 0's
  node; ``platform.weight_sync_backend``: NCCL on CUDA, HCCL on Ascend, gloo on CPU), and each bucket travels
  as one flat byte buffer (:func:`polyrl.rollout.weights.pack_bucket`) in three broadcasts: a header, the
  bucket's JSON layout and the bytes (:func:`send_weights`, :func:`receive_weights`). On accelerators the bytes
  never leave device memory. It measured 3-4x faster than the object store even on CPU (gloo over loopback;
  docs/placement.md). Every actor rank takes part in the gather (``Engine.weights_for_rollout`` is collective
  within the actor group); only rank 0 sends.

Each split path also pushes without waiting (``trainer.async_mode=fully_async``: :meth:`stage` then
:meth:`push`): the rollout ranks' loads are queued behind the generation each runs, and the driver goes on.
With ``collective`` the actor must not wait either: :class:`BackgroundSender` keeps a packed copy on actor
rank 0 and broadcasts it from a thread, while each leader's receive waits behind its generation in flight
(docs/async.md).

Worker side, the functions above run inside the role worker's methods of the same names
(:class:`polyrl.trainer.role_worker.Worker`), which the driver calls through the worker groups.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from polyrl.controller.worker_group import CallHandle, WorkerGroup
from polyrl.rollout.weights import PackedEntry, pack_bucket, unpack_bucket

logger = logging.getLogger(__name__)

#: ``trainer.weight_transfer`` values.
WEIGHT_TRANSFER_MODES = ("auto", "collective", "object_store")
#: Prefix of the weight group's keys in its store (kept apart from anything else using the port).
_STORE_PREFIX = "polyrl-weight-transfer"


def resolve_weight_transfer(config: Any, platform: Any) -> str:
    """``trainer.weight_transfer`` with ``auto`` resolved for ``platform``: ``collective`` (faster than the
    object store on every platform measured, CPU included: docs/placement.md)."""
    from polyrl.errors import ConfigError

    mode = str(getattr(config.trainer, "weight_transfer", "auto") or "auto")
    if mode not in WEIGHT_TRANSFER_MODES:
        raise ConfigError(f"config key 'trainer.weight_transfer': {mode!r}; choose one of "
                          f"{', '.join(WEIGHT_TRANSFER_MODES)}")
    if mode == "auto":
        return "collective"
    return mode


def new_backend_group(backend: str, store: Any, rank: int, size: int, timeout: timedelta) -> Any:
    """A c10d process group of ``size`` ranks over ``store``, outside the default group this process
    may already be in (the actor's or the rollout's own): ``gloo``, ``nccl``, or a backend a platform
    plugin registered with ``torch.distributed.Backend.register_backend`` (``hccl`` from torch-npu)."""
    import torch.distributed as dist

    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, options)
    plugin = dist.Backend._plugins.get(backend.upper())  # third-party backends (torch-npu's hccl)
    if plugin is None or plugin.extended_api:
        raise RuntimeError(f"weight transfer: no way to open a '{backend}' process group outside the default one; "
                           "set trainer.weight_transfer=object_store")
    return plugin.creator_fn(store, rank, size, timeout)


@dataclass
class WeightGroup:
    """One process's place in the weight-transfer group (rank 0: actor rank 0, which sends)."""

    group: Any
    store: Any
    rank: int
    size: int
    device: torch.device

    def broadcast(self, tensor: torch.Tensor) -> None:
        """Broadcast ``tensor`` from rank 0, in place."""
        self.group.broadcast(tensor, 0).wait()

    def close(self) -> None:
        """Leave the group (NCCL needs an explicit shutdown before the process exits)."""
        shutdown = getattr(self.group, "shutdown", None)
        if shutdown is not None:
            try:
                shutdown()
            except Exception:  # the peers may be gone already; nothing left to release
                logger.debug("weight group shutdown failed", exc_info=True)
        self.group = self.store = None


def join_weight_group(platform: Any, address: str, port: int, rank: int, size: int, *,
                      timeout_s: float = 1800.0) -> WeightGroup:
    """Join the weight-transfer group; rank 0 hosts its store on ``address:port`` (its own node)."""
    import torch.distributed as dist

    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(address, port, size, is_master=rank == 0, timeout=timeout, wait_for_workers=False)
    backend = getattr(platform, "weight_sync_backend", None) or platform.dist_backend
    group = new_backend_group(backend, dist.PrefixStore(_STORE_PREFIX, store), rank, size, timeout)
    logger.info("weight group: rank %d of %d over %s at %s:%d", rank, size, backend, address, port)
    return WeightGroup(group, store, rank, size, platform.current_device())


def _pack(bucket: Sequence[tuple[str, torch.Tensor]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """A bucket as ``(layout bytes, packed buffer, tensor count)`` on ``device``; the buffer is a copy."""
    buffer, entries = pack_bucket([(n, t.detach().to(device)) for n, t in bucket])
    layout = json.dumps([[e.name, e.dtype, list(e.shape), e.offset, e.nbytes] for e in entries]).encode()
    return torch.frombuffer(bytearray(layout), dtype=torch.uint8).to(device), buffer.to(device), len(entries)


def _send_bucket(group: WeightGroup, layout: torch.Tensor, buffer: torch.Tensor) -> None:
    """One packed bucket as three broadcasts: a header (layout and buffer sizes), the layout, the bytes."""
    group.broadcast(torch.tensor([layout.numel(), buffer.numel()], dtype=torch.int64, device=group.device))
    group.broadcast(layout)
    group.broadcast(buffer)


def _send_end(group: WeightGroup) -> None:
    """The empty header that ends a sync."""
    group.broadcast(torch.zeros(2, dtype=torch.int64, device=group.device))


def send_weights(engine: Any, group: WeightGroup | None, bucket_bytes: int) -> dict[str, float]:
    """Actor side. Every actor rank iterates ``engine.weights_for_rollout`` (a collective gather); the one
    holding ``group`` (rank 0) broadcasts each bucket to the rollout leaders, then an empty header."""
    start = time.perf_counter()
    tensors = nbytes = 0
    for bucket in engine.weights_for_rollout(bucket_bytes):
        if group is None:
            continue
        layout, buffer, count = _pack(bucket, group.device)
        _send_bucket(group, layout, buffer)
        tensors += count
        nbytes += buffer.numel()
    if group is not None:
        _send_end(group)
    return {"timing/weight_send": time.perf_counter() - start, "weight_sync/tensors": float(tensors),
            "weight_sync/bytes": float(nbytes)}


class BackgroundSender:
    """Actor side of a transfer that must not hold the actor up (``trainer.async_mode=fully_async``).

    :meth:`submit` gathers the weights (every actor rank: the gather is collective) into packed copies on
    rank 0 and returns; a thread of rank 0 then broadcasts them while the actor goes on training. The
    rollout leaders receive when they reach the ``receive_weights`` call queued behind the generation they
    run, so the broadcast waits for that generation, not the actor. One snapshot at a time: the next
    :meth:`submit` first waits for the previous send (and raises its error, if it failed).
    """

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._metrics: dict[str, float] = {}

    def submit(self, engine: Any, group: WeightGroup | None, bucket_bytes: int) -> dict[str, float]:
        """Snapshot the weights and start sending them; returns the gather's metrics."""
        self.wait()
        start = time.perf_counter()
        packed = []
        for bucket in engine.weights_for_rollout(bucket_bytes):
            if group is not None:
                packed.append(_pack(bucket, group.device))
        gathered = time.perf_counter() - start
        if group is None:
            return {"timing/weight_gather": gathered}
        nbytes = sum(buffer.numel() for _, buffer, _ in packed)
        self._metrics = {"weight_sync/tensors": float(sum(n for _, _, n in packed)), "weight_sync/bytes": float(nbytes)}

        def run() -> None:
            try:
                for layout, buffer, _ in packed:
                    _send_bucket(group, layout, buffer)
                _send_end(group)
            except BaseException as exc:  # raised by the next submit() or wait()
                logger.exception("background weight send failed")
                self._error = exc

        self._thread = threading.Thread(target=run, name="polyrl-weight-send", daemon=True)
        self._thread.start()
        return {"timing/weight_gather": gathered, **self._metrics}

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the send in progress (if any); False if it is still running after ``timeout`` seconds.
        Raises the error of a send that failed."""
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                return False
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"weight transfer: the background send to the rollout failed: {error!r}") from error
        return True


def receive_weights(group: WeightGroup, rollout: Any) -> dict[str, float]:
    """Rollout side (a replica's leader): receive buckets until the empty header, loading each into
    ``rollout`` (``update_weights``) as it arrives."""
    start = time.perf_counter()
    tensors = 0
    while True:
        header = torch.empty(2, dtype=torch.int64, device=group.device)
        group.broadcast(header)
        layout_len, buffer_len = (int(v) for v in header.tolist())
        if layout_len == 0:
            break
        layout = torch.empty(layout_len, dtype=torch.uint8, device=group.device)
        group.broadcast(layout)
        entries = [PackedEntry(name, dtype, tuple(shape), offset, size)
                   for name, dtype, shape, offset, size in json.loads(layout.cpu().numpy().tobytes())]
        buffer = torch.empty(buffer_len, dtype=torch.uint8, device=group.device)
        group.broadcast(buffer)
        bucket = list(unpack_bucket(buffer, entries))
        if rollout is not None:
            rollout.update_weights(bucket)
        tensors += len(bucket)
    return {"timing/weight_receive": time.perf_counter() - start, "weight_sync/tensors": float(tensors)}


# ---------------------------------------------------------------------- worker side: in-process and object store


def stream_into_rollout(engine: Any, rollout: Any, bucket_bytes: int) -> dict[str, float]:
    """Colocated: stream ``engine``'s weights into ``rollout`` (this process's), bucket by bucket.

    Every actor rank iterates (the gather is collective); a rank without a rollout (one lending its device to a
    tensor-parallel replica: its leader forwards the weights to every TP rank) only takes part in the gather.
    """
    start = time.perf_counter()
    if rollout is not None:
        rollout.wake_up()
    count = 0
    for bucket in engine.weights_for_rollout(bucket_bytes):
        if rollout is not None:
            rollout.update_weights(bucket)
        count += len(bucket)
    return {"timing/weight_sync": time.perf_counter() - start, "weight_sync/tensors": float(count)}


def gather_buckets(engine: Any, bucket_bytes: int, *, keep: bool) -> list[list[tuple[str, torch.Tensor]]] | None:
    """Object store, actor side: every rank iterates ``engine.weights_for_rollout`` (collective); the rank with
    ``keep`` returns the buckets as host tensors, the others ``None``."""
    buckets = [[(n, t.detach().cpu()) for n, t in bucket] for bucket in engine.weights_for_rollout(bucket_bytes)]
    return buckets if keep else None


def load_buckets(rollout: Any, buckets: Sequence[Sequence[tuple[str, torch.Tensor]]]) -> None:
    """Object store, rollout side: wake ``rollout`` and load ``buckets`` into it (``None``: a rank without one)."""
    if rollout is None:
        return
    rollout.wake_up()
    for bucket in buckets:
        rollout.update_weights(bucket)


# ---------------------------------------------------------------------- driver side


class ColocatedWeightSync:
    """Actor and rollout in the same processes (``colocated`` placement, the ``local`` executor): every rank
    streams its actor's weights into its own rollout (``Worker.sync_rollout_weights``)."""

    def __init__(self, group: WorkerGroup) -> None:
        self.group = group

    def sync(self) -> dict[str, float]:
        """Actor weights -> rollout on every rank; rank 0's metrics."""
        return dict(self.group.call_all("sync_rollout_weights")[0])

    def stage(self) -> dict[str, float]:
        """Not available: a colocated rollout cannot load while its actor trains (async modes need split)."""
        raise RuntimeError("weights cannot be pushed in the background with colocated placement: the asynchronous "
                           "modes need trainer.placement=split")

    def push(self) -> None:
        """See :meth:`stage`."""
        self.stage()

    def wait(self, timeout: float | None = None) -> bool:
        """Nothing is ever in flight: True."""
        return True


class _SplitWeightSync:
    """What the split paths share: the actor and rollout groups and the loads in flight (:meth:`push`)."""

    def __init__(self, actor: WorkerGroup, rollout: WorkerGroup) -> None:
        self.actor, self.rollout = actor, rollout
        self._pending: list[CallHandle] = []

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the loads of the last :meth:`push`; False if one still runs after ``timeout`` seconds (each
        call waits up to it). Raises the error of a load that failed."""
        while self._pending:
            try:
                self._pending[0].result(timeout)
            except TimeoutError:
                return False
            self._pending.pop(0)
        return True


class ObjectStoreWeightSync(_SplitWeightSync):
    """Split placement through the driver and Ray's object store (``trainer.weight_transfer=object_store``)."""

    def __init__(self, actor: WorkerGroup, rollout: WorkerGroup) -> None:
        super().__init__(actor, rollout)
        self._staged: Any = None

    def _gather(self) -> Any:
        """Actor rank 0's buckets (every actor rank gathers), shared once for every rollout rank."""
        buckets = next(b for b in self.actor.call_all("gather_weights") if b is not None)
        return self.rollout.share(buckets)

    def sync(self) -> dict[str, float]:
        """Gather, share, load on every rollout rank; returns when every rank holds the new weights."""
        start = time.perf_counter()
        self.rollout.call_all("load_rollout_weights", self._gather())
        return {"timing/weight_sync": time.perf_counter() - start}

    def stage(self) -> dict[str, float]:
        """Gather the new weights for :meth:`push` (the actor waits for its gather only), then wait for the
        previous push's loads: its buckets are dropped once these are staged."""
        start = time.perf_counter()
        self._staged = self._gather()
        self.wait()
        return {"timing/weight_gather": time.perf_counter() - start}

    def push(self) -> None:
        """Queue the staged weights' load on every rollout rank behind what it runs now; returns at once."""
        if self._staged is None:
            raise RuntimeError("ObjectStoreWeightSync.push() without stage()")
        self._pending = [self.rollout.call_all_async("load_rollout_weights", self._staged)]
        self._staged = None


class CollectiveWeightSync(_SplitWeightSync):
    """Split placement over a process group of actor rank 0 and the rollout leaders (``collective``); sets the
    group up on first use.

    ``leaders`` are the rollout ranks that hold an engine (every rank with ``tensor_parallel_size=1``; a
    replica's leader forwards to its other ranks).
    """

    def __init__(self, actor: WorkerGroup, rollout: WorkerGroup, leaders: Sequence[int]) -> None:
        super().__init__(actor, rollout)
        self.leaders = list(leaders)
        self.joined = False

    def join(self) -> None:
        """Set the group up (on first use; later calls return at once)."""
        if self.joined:
            return

        from polyrl.controller.cluster import rendezvous_address

        size = 1 + len(self.leaders)
        nodes = [self.actor.node_ids[0]] + [self.rollout.node_ids[i] for i in self.leaders]
        address, port = rendezvous_address(nodes)  # the store lives on actor rank 0's node
        calls = [self.actor.call_rank_async(0, "join_weight_group", address, port, 0, size)]
        calls += [self.rollout.call_rank_async(r, "join_weight_group", address, port, i + 1, size)
                  for i, r in enumerate(self.leaders)]
        for call in calls:  # the members meet in the backend's constructor: all submitted before any wait
            call.result()
        self.joined = True

    def sync(self) -> dict[str, float]:
        """Actor weights -> every rollout leader; the actor's metrics of this sync."""
        self.join()
        sends = self.actor.call_all_async("send_weights")
        receives = [self.rollout.call_rank_async(r, "receive_weights") for r in self.leaders]
        metrics = sends.result()[0]
        for call in receives:
            call.result()
        return dict(metrics)

    def stage(self) -> dict[str, float]:
        """Wait for the previous push to be received, then have every actor rank gather the weights into a packed
        copy that rank 0 starts broadcasting from a background thread (``Worker.start_weight_send``)."""
        self.wait()  # one snapshot at a time: the previous broadcast must be through
        self.join()
        return dict(self.actor.call_all("start_weight_send")[0])

    def push(self) -> None:
        """Queue each leader's receive of the staged broadcast behind its generation in flight; returns at once."""
        self._pending = [self.rollout.call_rank_async(r, "receive_weights") for r in self.leaders]


#: What a run's weight sync is: one of the three classes above.
WeightSync = ColocatedWeightSync | ObjectStoreWeightSync | CollectiveWeightSync


def make_weight_sync(actor: WorkerGroup, rollout: WorkerGroup, *, colocated: bool, transfer: str | None = None,
                     leaders: Sequence[int] | None = None) -> WeightSync:
    """The weight sync of a placement: colocated (``actor is rollout``), or split with ``transfer`` (the resolved
    ``trainer.weight_transfer``; ``leaders``: the rollout ranks holding an engine, default every rank)."""
    if colocated:
        return ColocatedWeightSync(actor)
    if transfer == "collective":
        return CollectiveWeightSync(actor, rollout, leaders if leaders is not None else range(rollout.world_size))
    return ObjectStoreWeightSync(actor, rollout)


__all__ = [
    "WEIGHT_TRANSFER_MODES",
    "BackgroundSender",
    "ColocatedWeightSync",
    "CollectiveWeightSync",
    "ObjectStoreWeightSync",
    "WeightGroup",
    "WeightSync",
    "gather_buckets",
    "join_weight_group",
    "load_buckets",
    "make_weight_sync",
    "new_backend_group",
    "receive_weights",
    "resolve_weight_transfer",
    "send_weights",
    "stream_into_rollout",
]
