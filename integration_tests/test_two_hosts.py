"""Two real hosts (network namespaces with their own addresses, :mod:`two_hosts`), Ray started on them as
docs/cluster.md says, ``polyrl train`` run on the head host against ``trainer.ray_address``.

The actor's worker group spans both hosts (``trainer.placement_strategy=STRICT_SPREAD``: its gloo rendezvous is on
a namespace address, never loopback), its rank 0 on host ``a`` (the driver's node comes first), and the rollout pool
sits on the second host (host ``b`` has the only CPU left), so weights travel between pools over the link: the
weight-transfer group meets at host ``a``'s address, which the test reads in the run's log. The metrics equal a one-host run's at the same seed, step
for step. Then the second host is lost: every process in its namespace SIGKILLed in the middle of a step.
Skipped (one line) where network namespaces are refused.
"""

from __future__ import annotations

import json
import re
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from two_hosts import TwoHosts, namespaces_refused

KEYS = ("critic/score/mean", "actor/pg_loss", "actor/grad_norm", "response_length/mean")
LAYOUT = ["trainer.executor=ray", "trainer.n_workers=2", "trainer.placement=split", "trainer.rollout_workers=1"]


@pytest.fixture(scope="module")
def refused() -> None:
    why = namespaces_refused()
    if why:
        pytest.skip(f"two-host tests need network namespaces: {why}")


class _Reference:
    """The same run on one host (a local Ray of 3 CPUs, no address), 2 steps: every test's reference, started once
    by the first test that asks for it and run beside that test's two hosts."""

    def __init__(self) -> None:
        self.proc: Any = None
        self.run: Path | None = None
        self.done: dict[int, dict] | None = None

    def start(self, base_overrides: list[str], manifest: Path, run: Path) -> None:
        import subprocess

        if self.proc is None:
            self.run = run
            self.proc = subprocess.Popen(_args(base_overrides, manifest, run, 2) + ["trainer.ray_num_cpus=3"],
                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def rows(self) -> dict[int, dict]:
        if self.done is None:
            _, err = self.proc.communicate(timeout=300)
            assert self.proc.returncode == 0, err[-3000:]
            assert self.run is not None
            self.done = _rows(self.run)
        return self.done

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.communicate()


@pytest.fixture(scope="module")
def _reference() -> Iterator[_Reference]:
    ref = _Reference()
    try:
        yield ref
    finally:
        ref.close()


@pytest.fixture
def one_host(_reference, base_overrides, manifest_file, tmp_path) -> Callable[[], dict[int, dict]]:
    """The one-host run's metrics by step (waits for it)."""
    _reference.start(base_overrides, manifest_file, tmp_path / "one_host")
    return _reference.rows


def _args(base_overrides: list[str], manifest: Path, run: Path, steps: int) -> list[str]:
    common = [o for o in base_overrides if not o.startswith(("trainer.run_dir", "trainer.total_steps"))]
    return [sys.executable, "-m", "polyrl", "train", "--manifest", str(manifest), *common, *LAYOUT,
            f"trainer.total_steps={steps}", "trainer.save_freq=1", "trainer.val_before_train=false",
            "trainer.max_checkpoints=0", f"trainer.run_dir={run}"]


def _rows(run: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {r["step"]: r for r in rows if "critic/score/mean" in r}


@pytest.mark.timeout(420)
def test_a_run_over_two_hosts_logs_the_metrics_of_a_one_host_run(refused, one_host, base_overrides, manifest_file,
                                                                 tmp_path):
    with TwoHosts(tmp_path / "hosts", cpus=(1, 2)) as hosts:
        two = tmp_path / "two_hosts"
        proc = hosts.start("a", _args(base_overrides, manifest_file, two, 2) + [
            f"trainer.ray_address={hosts.head}", "trainer.placement_strategy=STRICT_SPREAD"])
        _, err = proc.communicate(timeout=360)
        assert proc.returncode == 0, err[-3000:]
    log = (two / "train.log").read_text()
    a, b = hosts.ip["a"], hosts.ip["b"]
    # the actor's ranks: one on each host, rank 0 on the driver's (host a); they meet at rank 0's address
    actor = dict(re.findall(r"worker group 'actor': rank (\d) is pid \d+ on host \S+ \(([\d.]+)\)", log))
    assert actor == {"0": a, "1": b}, actor
    # the rollout on host b (the only CPU left), so the weight-transfer group (actor rank 0 and the rollout's leader)
    # spans both hosts too: both groups meet at host a's address, and the weights cross the link
    assert re.search(rf"worker group 'rollout': rank 0 is pid \d+ on host \S+ \({re.escape(b)}\)", log), log[-3000:]
    spanning = re.findall(r"rendezvous of 2 ranks over 2 node\(s\) at ([\d.]+):\d+", log)
    assert spanning == [a, a], log[-3000:]
    weight = re.findall(r"weight group: rank (\d) of 2 over gloo at ([\d.]+):\d+", log)
    assert sorted(weight) == [("0", a), ("1", a)], weight
    # loopback only for a group on one node (the rollout's own)
    for nodes, address in re.findall(r"rendezvous of \d+ ranks over (\d) node\(s\) at ([\d.]+):", log):
        assert address in ((a,) if nodes == "2" else (a, b, "127.0.0.1")), (nodes, address)
    x, y = one_host(), _rows(two)
    assert sorted(y) == [1, 2]
    for step in (1, 2):
        for key in KEYS:
            assert y[step][key] == pytest.approx(x[step][key], rel=1e-4, abs=1e-6), (step, key)


def _lose_host_b_in_step_2(hosts: TwoHosts, args: list[str], run: Path, restart_wait_s: int) -> Any:
    """``polyrl train`` started on host a with ``trainer.max_restarts=1``; every process of host b SIGKILLed once
    step 1 is checkpointed (in the middle of step 2). The driver's process."""
    proc = hosts.start("a", args + [f"trainer.ray_address={hosts.head}", "trainer.placement_strategy=STRICT_SPREAD",
                                    "trainer.phase_timeout_s=120", "trainer.max_restarts=1",
                                    f"trainer.restart_wait_s={restart_wait_s}"])
    pointer = run / "checkpoints" / "latest"
    deadline = time.monotonic() + 300
    while not (pointer.exists() and pointer.read_text().strip() == "step_1"):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.05)
    assert hosts.kill_host("b") > 0
    return proc


@pytest.mark.timeout(420)
def test_a_lost_host_stops_the_run_with_one_line_and_a_layout_that_does_not_come_back(refused, base_overrides,
                                                                                    manifest_file, tmp_path):
    """Every process of host b SIGKILLed mid-step; ``max_restarts=1`` waits ``restart_wait_s`` for the layout,
    which cannot come back (host b is gone): one warning naming the lost node, then one error line saying what
    is missing. The last checkpoint is whole."""
    run = tmp_path / "run"
    with TwoHosts(tmp_path / "hosts", cpus=(1, 2)) as hosts:
        proc = _lose_host_b_in_step_2(hosts, _args(base_overrides, manifest_file, run, 2), run, 5)
        lost_at = time.monotonic()
        _, err = proc.communicate(timeout=240)
        took = time.monotonic() - lost_at
    errors = [x for x in err.splitlines() if x.startswith("polyrl train: error")]
    assert proc.returncode == 2 and len(errors) == 1, err[-3000:]
    warning = next(x for x in err.splitlines() if "restart 1 of 1 (trainer.max_restarts)" in x)
    assert f"on node {hosts.ip['b']}" in warning and "was lost" in warning, warning
    assert "the run's layout cannot be placed again after waiting 5 s" in errors[0], errors[0]
    assert "the cluster has 1 CPU" in errors[0], errors[0]
    assert took < 120 + 60, took
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_1"


@pytest.mark.timeout(480)
def test_a_lost_host_that_comes_back_resumes_by_itself_with_an_uninterrupted_runs_history(
        refused, one_host, base_overrides, manifest_file, tmp_path):
    """Host b's processes SIGKILLed in the middle of step 2, then ``ray start --address`` on host b again (a
    replacement machine): with ``max_restarts=1`` the driver waits for the layout, resumes from step 1's checkpoint
    by itself, and the history equals a one-host run's at the same seed, each step once."""
    run = tmp_path / "run"
    with TwoHosts(tmp_path / "hosts", cpus=(1, 2)) as hosts:
        proc = _lose_host_b_in_step_2(hosts, _args(base_overrides, manifest_file, run, 2), run, 240)
        hosts.join("b")  # the replacement host joins the cluster
        _, err = proc.communicate(timeout=400)
    assert proc.returncode == 0, err[-3000:]
    assert "restart 1 of 1 (trainer.max_restarts)" in err and f"on node {hosts.ip['b']}" in err, err[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r["step"] for r in rows if "critic/score/mean" in r]
    assert steps == [1, 2], steps  # each step once: the lost attempt's step 2 was not logged, or was dropped
    x, y = one_host(), _rows(run)
    for step in (1, 2):
        for key in KEYS:
            assert y[step][key] == pytest.approx(x[step][key], rel=1e-4, abs=1e-6), (step, key)
