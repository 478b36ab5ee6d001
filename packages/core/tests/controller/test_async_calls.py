"""``WorkerGroup``'s non-blocking calls: handles that finish independently, ``wait_any``, timeouts, errors,
cancelling a call that has not started, and ``share``. Real Ray actors, and the local executor's group."""

from __future__ import annotations

import time
from concurrent.futures import CancelledError

import pytest
import torch

from polyrl.controller.worker_group import CompletedCall, LocalWorkerGroup, RayWorkerGroup, wait_any


class _Worker:
    def __init__(self, *, rank: int, world_size: int) -> None:
        self.rank = rank
        self.log: list[str] = []

    def ready(self) -> bool:
        return True

    def slow(self, seconds: float, tag: str) -> tuple[int, str]:
        time.sleep(seconds)
        self.log.append(tag)
        return self.rank, tag

    def record(self, tag: str) -> str:
        self.log.append(tag)
        return tag

    def seen(self) -> list[str]:
        return list(self.log)

    def total(self, tensor: torch.Tensor) -> float:
        return float(tensor.sum()) + self.rank

    def fail(self) -> None:
        raise ValueError(f"boom on rank {self.rank}")

    def close(self) -> None:
        pass


@pytest.fixture(scope="module")
def group(ray_local):
    g = RayWorkerGroup(_Worker, 2, resources_per_worker={"CPU": 0.5}, name="async-calls")
    yield g
    g.shutdown()


def test_calls_on_ranks_finish_independently_and_wait_any_returns_the_first(group):
    start = time.monotonic()
    slow = group.call_rank_async(0, "slow", 1.5, "slow")
    quick = group.call_rank_async(1, "slow", 0.0, "quick")
    assert time.monotonic() - start < 1.0  # submitting does not wait for the call
    done = wait_any([slow, quick], timeout=10)
    assert done == [quick] and not slow.done()
    assert quick.result() == (1, "quick")
    assert slow.result(timeout=30) == (0, "slow") and slow.done()
    assert group.call_all_async("seen").result() == [["slow"], ["quick"]]  # each call ran on its rank alone


def test_result_with_a_timeout_raises_timeout_error_while_the_call_runs(group):
    handle = group.call_rank_async(0, "slow", 1.0, "t")
    with pytest.raises(TimeoutError):
        handle.result(timeout=0.05)
    assert wait_any([handle], timeout=0.01) == []
    assert handle.result(timeout=30) == (0, "t")


def test_a_cancelled_call_is_done_raises_cancelled_and_later_calls_still_run(group):
    busy = group.call_rank_async(1, "slow", 1.0, "busy")
    dropped = group.call_rank_async(1, "record", "dropped")  # queued behind `busy` on rank 1
    dropped.cancel()
    assert dropped.done() and wait_any([busy, dropped], timeout=10) == [dropped]
    with pytest.raises(CancelledError):
        dropped.result()
    kept = group.call_rank_async(1, "record", "kept")  # the rank's later calls are not held up
    assert kept.result(timeout=30) == "kept" and busy.result(timeout=30) == (1, "busy")
    finished = group.call_rank_async(0, "record", "finished")
    finished.result(timeout=30)
    finished.cancel()  # a finished call keeps its result
    assert finished.result() == "finished"


def test_errors_are_raised_by_result_and_calls_in_rank_order(group):
    with pytest.raises(Exception, match="boom on rank 1"):
        group.call_rank_async(1, "fail").result(timeout=30)
    shared = group.share(torch.arange(6.0))
    assert group.call_all_async("total", shared).result(timeout=30) == [15.0, 16.0]
    with pytest.raises(IndexError):
        group.call_rank_async(2, "record", "x")


def test_the_local_group_answers_with_completed_handles():
    local = LocalWorkerGroup(_Worker)
    handle = local.call_rank_async(0, "slow", 0.0, "now")
    assert isinstance(handle, CompletedCall) and handle.done()
    assert local.call_all("seen") == [["now"]]  # it ran when it was made
    assert handle.result() == (0, "now") and local.call_all_async("record", "x").result() == ["x"]
    failed = local.call_rank_async(0, "fail")  # the error comes from result(), as a remote call's would
    with pytest.raises(ValueError, match="boom on rank 0"):
        failed.result()
    assert wait_any([failed, handle], timeout=None) == [failed, handle]
    assert local.share(3) == 3
    with pytest.raises(IndexError):
        local.call_rank_async(1, "record", "x")


def test_a_killed_rank_met_outside_any_phase_is_named_as_a_lost_worker(ray_local):
    """A call that does not go through the deadline-aware wait (no phase is current) gets Ray's own actor error:
    ``lost_worker_in`` turns it into the WorkerLostError naming the group's rank, as ``fit_with_restarts`` needs."""
    import ray

    from polyrl.controller.deadlines import WorkerLostError, lost_worker_in

    g = RayWorkerGroup(_Worker, 2, resources_per_worker={"CPU": 0.5}, name="lost-outside")
    try:
        ray.kill(g.workers[1])
        error = None
        deadline = time.monotonic() + 30
        while error is None and time.monotonic() < deadline:  # ray.kill is asynchronous: a call may still land
            try:
                g.call_rank_async(1, "record", "x").result(timeout=30)
            except ray.exceptions.RayActorError as exc:
                error = exc
        assert error is not None, "the killed rank still answers after 30 s"
        lost = lost_worker_in(error)
        assert isinstance(lost, WorkerLostError)
        assert "rank 1 of worker group 'lost-outside'" in str(lost) and lost.node_id
        assert lost_worker_in(ValueError("boom")) is None
        wrapped = RuntimeError("a rollout call failed")
        wrapped.__cause__ = error
        assert "rank 1 of worker group 'lost-outside'" in str(lost_worker_in(wrapped))
    finally:
        g.shutdown()
