"""Worker groups and lost peers, real Ray actors: a collective's "peer went away" error in one group when the peer
that went is a rank of another group (the rollout's end of a weight transfer) is that rank's WorkerLostError; a
constructor that fails stays its own error; a placement waits no longer than a restart has left; ranks are
numbered node by node, the driver's node first."""

from __future__ import annotations

import os
import signal
import time

import pytest

from polyrl.controller import worker_group as wg
from polyrl.controller.deadlines import WorkerLostError
from polyrl.controller.worker_group import PlacementError, RayWorkerGroup, placement_deadline, rank_order


class _Peer:
    def __init__(self, *, rank: int, world_size: int) -> None:
        self.rank = rank

    def ready(self) -> bool:
        return True

    def broadcast(self) -> None:  # what gloo says when the process at the other end of the link died
        raise RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error [10.0.0.2]:1234: Connection reset by peer")


class _Broken:
    def __init__(self, *, rank: int, world_size: int) -> None:
        raise ValueError(f"bad setting on rank {rank}")

    def ready(self) -> bool:
        return True


def test_rank_order_puts_the_ranks_of_a_node_together_the_drivers_node_first():
    assert rank_order(["b", "a", "b", "c", "a"], "a") == [1, 4, 0, 2, 3]
    assert rank_order(["b", "b"], "a") == [0, 1]  # the driver's node holds none: Ray's order
    assert rank_order([], "a") == []


def test_a_peer_gone_error_names_the_lost_rank_of_another_group(ray_local):
    sender = RayWorkerGroup(_Peer, 1, resources_per_worker={"CPU": 0.5}, name="sender")
    receiver = RayWorkerGroup(_Peer, 1, resources_per_worker={"CPU": 0.5}, name="receiver")
    try:
        with pytest.raises(RuntimeError, match="Connection reset by peer") as plain:
            sender.call_all("broadcast")  # every rank of the run is there: the error is the rank's own
        assert not isinstance(plain.value, WorkerLostError)
        pid = int(receiver.processes[0]["pid"])
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
            time.sleep(0.05)
        with pytest.raises(WorkerLostError) as lost:
            sender.call_all("broadcast")
        assert f"rank 0 of worker group 'receiver' (pid {pid}" in str(lost.value), str(lost.value)
    finally:
        sender.shutdown()
        receiver.shutdown()


def test_a_constructor_that_fails_is_its_own_error_not_a_lost_worker(ray_local):
    with pytest.raises(Exception, match="bad setting on rank") as error:
        RayWorkerGroup(_Broken, 2, resources_per_worker={"CPU": 0.5}, name="broken")
    assert not isinstance(error.value, WorkerLostError)


def test_a_restarts_placement_waits_only_what_is_left_and_names_it(ray_local, monkeypatch):
    monkeypatch.setattr(wg, "PLACEMENT_MIN_S", 1.0)
    started = time.monotonic()
    with placement_deadline(0.5, "what was left of trainer.restart_wait_s"), pytest.raises(PlacementError) as error:
        RayWorkerGroup(_Peer, 1, resources_per_worker={"CPU": 64}, name="too-big")
    assert time.monotonic() - started < 30  # not the 600 s of a placement outside a restart
    text = str(error.value)
    assert "worker group 'too-big'" in text and "{'CPU': 64}" in text, text
    assert "what was left of trainer.restart_wait_s" in text, text
