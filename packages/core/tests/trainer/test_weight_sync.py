"""Collective weight transfer (split placement): real gloo groups of a sender and two receivers."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

from polyrl.errors import ConfigError
from polyrl.platforms.base import CPUPlatform
from polyrl.trainer.weight_sync import (
    BackgroundSender,
    join_weight_group,
    receive_weights,
    resolve_weight_transfer,
    send_weights,
)


class _Engine:
    """Yields fixed buckets of mixed dtypes, like ``Engine.weights_for_rollout``."""

    def __init__(self, buckets):
        self.buckets = buckets
        self.sizes: list[int] = []

    def weights_for_rollout(self, bucket_bytes):
        self.sizes.append(bucket_bytes)
        yield from self.buckets


class _Rollout:
    def __init__(self):
        self.loaded: list[tuple[str, torch.Tensor]] = []

    def update_weights(self, bucket):
        self.loaded.extend((n, t.clone()) for n, t in bucket)


def _buckets():
    g = torch.Generator().manual_seed(0)
    return [
        [("model.embed_tokens.weight", torch.randn(7, 5, generator=g)),
         ("model.norm.weight", torch.randn(5, generator=g).to(torch.bfloat16))],
        [("lm_head.weight", torch.randn(3, 5, generator=g, dtype=torch.float64)),
         ("model.layers.0.mlp.gate", torch.randint(-9, 9, (2, 3, 1), generator=g)),
         ("model.scalar", torch.tensor(1.5, dtype=torch.float16))],
    ]


def _run(members):
    errors: list[BaseException] = []

    def target(fn):
        try:
            fn()
        except BaseException as exc:  # re-raised in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=target, args=(m,)) for m in members]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a member of the weight group hung"
    if errors:
        raise errors[0]


def _join_groups(size: int) -> dict[int, object]:
    """A gloo weight group of ``size`` ranks on loopback, joined from one thread per rank."""
    from polyrl.distributed import free_port

    port, platform = free_port(), CPUPlatform()
    groups: dict[int, object] = {}
    _run([lambda r=r: groups.__setitem__(r, join_weight_group(platform, "127.0.0.1", port, r, size, timeout_s=60))
          for r in range(size)])
    return groups


def test_broadcast_delivers_every_bucket_bit_for_bit_twice():
    groups = _join_groups(3)
    buckets = _buckets()
    engine, rollouts = _Engine(buckets), [_Rollout(), _Rollout()]
    results: dict[str, dict] = {}
    for _ in range(2):  # the group is reused sync after sync
        _run([lambda: results.__setitem__("send", send_weights(engine, groups[0], 1 << 20))]
             + [lambda i=i: results.__setitem__(f"recv{i}", receive_weights(groups[i + 1], rollouts[i]))
                for i in range(2)])
    sent = [(n, t) for b in buckets for n, t in b]
    for rollout in rollouts:
        assert [n for n, _ in rollout.loaded] == [n for n, _ in sent] * 2
        for (name, got), (_, want) in zip(rollout.loaded, sent * 2, strict=True):
            assert got.dtype == want.dtype and got.shape == want.shape, name
            assert torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)), name
    assert results["send"]["weight_sync/tensors"] == len(sent) and results["recv1"]["weight_sync/tensors"] == len(sent)
    assert engine.sizes == [1 << 20, 1 << 20]
    for group in groups.values():
        group.close()


@pytest.mark.timeout(120)  # a submit that blocked on its receiver would hang here (one thread)
def test_background_send_returns_at_once_and_delivers_the_snapshot_to_a_late_receiver():
    """fully_async: the actor snapshots and goes on (its weights change), the rollout joins the broadcast
    later (after its generation in flight) and gets the snapshot, sync after sync, in order."""
    groups = _join_groups(2)
    buckets = _buckets()
    engine, rollout, sender = _Engine(buckets), _Rollout(), BackgroundSender()
    snapshots = []
    for _ in range(2):
        snapshots.append([(n, t.clone()) for b in buckets for n, t in b])
        metrics = sender.submit(engine, groups[0], 1 << 20)  # no receiver in the broadcast yet: returns anyway
        assert metrics["weight_sync/tensors"] == len(snapshots[-1])
        with torch.no_grad():  # the actor trains on: its live tensors change after the snapshot
            for bucket in buckets:
                for _, tensor in bucket:
                    tensor.add_(1)
        receive_weights(groups[1], rollout)  # the rollout arrives late, in this thread
        assert sender.wait(timeout=60)
    sent = [entry for snapshot in snapshots for entry in snapshot]
    assert [n for n, _ in rollout.loaded] == [n for n, _ in sent]
    for (name, got), (_, want) in zip(rollout.loaded, sent, strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want), name
    assert sender.wait(timeout=0)  # nothing left in flight
    for group in groups.values():
        group.close()


def test_non_sending_actor_ranks_only_take_part_in_the_gather():
    engine = _Engine(_buckets())
    assert send_weights(engine, None, 64)["weight_sync/tensors"] == 0.0
    assert engine.sizes == [64]


@pytest.mark.parametrize(("mode", "device_type", "want"), [
    ("auto", "cpu", "collective"), ("auto", "cuda", "collective"), ("collective", "cpu", "collective"),
    ("object_store", "cuda", "object_store"),
])
def test_auto_resolves_by_platform(mode, device_type, want):
    config = SimpleNamespace(trainer=SimpleNamespace(weight_transfer=mode))
    assert resolve_weight_transfer(config, SimpleNamespace(device_type=device_type)) == want


def test_unknown_mode_names_the_key():
    config = SimpleNamespace(trainer=SimpleNamespace(weight_transfer="nccl"))
    with pytest.raises(ConfigError, match="trainer.weight_transfer.*collective"):
        resolve_weight_transfer(config, CPUPlatform())


class _RoleWorker:
    """The weight-sync methods of the role worker, over the module's own worker-side functions."""

    def __init__(self, *, rank: int, world_size: int, engine=None, rollout=None) -> None:
        self.rank, self.actor, self.rollout = rank, engine, rollout

    def gather_weights(self):
        from polyrl.trainer.weight_sync import gather_buckets

        return gather_buckets(self.actor, 1 << 20, keep=self.rank == 0)

    def load_rollout_weights(self, buckets):
        from polyrl.trainer.weight_sync import load_buckets

        load_buckets(self.rollout, buckets)

    def sync_rollout_weights(self):
        from polyrl.trainer.weight_sync import stream_into_rollout

        return stream_into_rollout(self.actor, self.rollout, 1 << 20)


class _WakingRollout(_Rollout):
    def __init__(self):
        super().__init__()
        self.wakes = 0

    def wake_up(self):
        self.wakes += 1


def test_the_driver_side_paths_deliver_every_tensor():
    """Each driver-side class over the local executor's groups: colocated streams in-process; the object store
    gathers on the actor, shares once and loads the rollout, blocking (``sync``) or staged then pushed."""
    from polyrl.controller.worker_group import LocalWorkerGroup
    from polyrl.trainer.weight_sync import ColocatedWeightSync, ObjectStoreWeightSync, make_weight_sync

    sent = [n for b in _buckets() for n, _ in b]
    rollout = _WakingRollout()
    both = LocalWorkerGroup(_RoleWorker, engine=_Engine(_buckets()), rollout=rollout)
    colocated = make_weight_sync(both, both, colocated=True)
    assert isinstance(colocated, ColocatedWeightSync)
    assert colocated.sync()["weight_sync/tensors"] == len(sent) and [n for n, _ in rollout.loaded] == sent
    with pytest.raises(RuntimeError, match="placement=split"):
        colocated.stage()

    rollout = _WakingRollout()
    actor, rollouts = LocalWorkerGroup(_RoleWorker, engine=_Engine(_buckets())), LocalWorkerGroup(_RoleWorker, rollout=rollout)
    store = make_weight_sync(actor, rollouts, colocated=False, transfer="object_store")
    assert isinstance(store, ObjectStoreWeightSync)
    store.sync()
    with pytest.raises(RuntimeError, match="without stage"):
        store.push()
    store.stage()
    assert [n for n, _ in rollout.loaded] == sent  # staged: gathered, not loaded yet
    store.push()
    assert store.wait(timeout=1) and [n for n, _ in rollout.loaded] == sent * 2 and rollout.wakes == 2
