"""No silent hang: every phase of a step has a deadline (``trainer.phase_timeout_s``, ``trainer.phase_timeouts``).

Each test wedges one real part of a run of the tiny model and checks that the run stops by itself within the
deadline with one line naming the phase, role, rank and host, that every worker's Python stacks reached
RUN_DIR/train.log, and (where a checkpoint was due) that the last checkpoint is whole and the run resumes from it.
The wedges: a Ray worker frozen with SIGSTOP (found by the pid the run logged for it), a rank that never reaches
the actor update while its peer waits inside the update's collective (``POLYRL_HANG_AT``,
polyrl.trainer.faults), a rollout that never returns (``local`` executor: the driver's own alarm) and a reward
function that blocks.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest


def _common(base_overrides: list[str], steps: int, run: Path) -> list[str]:
    common = [o for o in base_overrides if not o.startswith(("trainer.run_dir", "trainer.total_steps"))]
    return common + [f"trainer.total_steps={steps}", "trainer.save_freq=1", "trainer.val_before_train=false",
                     "trainer.max_checkpoints=0", f"trainer.run_dir={run}"]


def _start(manifest: Path, overrides: list[str], hang: str | None = None) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("POLYRL_HANG_AT", None)
    if hang:
        env["POLYRL_HANG_AT"] = hang
    return subprocess.Popen([sys.executable, "-m", "polyrl", "train", "--manifest", str(manifest), *overrides],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen, timeout: float = 240) -> tuple[int, list[str], str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, [x for x in err.strip().splitlines() if x.startswith("polyrl train: error")], err


def _steps(run: Path) -> list[int]:
    path = run / "metrics.jsonl"
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r["step"] for r in rows if "critic/score/mean" in r]


def _latest(run: Path) -> str | None:
    pointer = run / "checkpoints" / "latest"
    return pointer.read_text().strip() if pointer.exists() else None


@pytest.mark.timeout(180)
def test_a_worker_frozen_with_sigstop_stops_the_run_with_one_line_and_it_resumes(base_overrides, manifest_file,
                                                                                 tmp_path):
    run = tmp_path / "run"
    args = _common(base_overrides, 3, run) + ["trainer.executor=ray", "trainer.ray_num_cpus=2",
                                              "trainer.phase_timeout_s=10"]
    proc = _start(manifest_file, args)
    pid = None
    try:
        deadline = time.monotonic() + 150
        while _latest(run) != "step_1":  # step 1 checkpointed: freeze the worker in the middle of step 2
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
            time.sleep(0.05)
        match = re.search(r"worker group '(\w+)': rank 0 is pid (\d+) on host (\S+)", (run / "train.log").read_text())
        assert match, "the run logs each rank's pid"
        group, pid, host = match.group(1), int(match.group(2)), match.group(3)
        os.kill(pid, signal.SIGSTOP)
        frozen_at = time.monotonic()
        code, errors, err = _finish(proc)
        took = time.monotonic() - frozen_at
    finally:
        if proc.poll() is None:
            proc.kill()
        if pid is not None:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
    assert code == 2 and len(errors) == 1, err[-3000:]
    line = errors[0]
    assert re.search(r"phase '\w+'", line) and f"rank 0 of worker group '{group}' (pid {pid} on host {host}" in line
    assert "stopped (SIGSTOP" in line and "waited" in line and "the last checkpoint is whole" in line, line
    assert took < 10 + 30, took  # the deadline, the stacks (a stopped process is not waited for) and the shutdown
    assert "Traceback" not in err
    logged = (run / "train.log").read_text()
    assert "Python stacks of the driver and every worker" in logged and "==== driver" in logged
    # the frozen worker is gone, not left stopped behind the run
    time.sleep(1)
    state = Path(f"/proc/{pid}/status")
    assert not state.exists() or "State:\tZ" in state.read_text()

    assert _latest(run) == "step_1" and _steps(run)[:1] == [1]
    code, errors, err = _finish(_start(manifest_file, args))  # resumes from the checkpoint the timeout left whole
    assert code == 0, err[-3000:]
    assert _steps(run) == [1, 2, 3] and _latest(run) == "step_3"


@pytest.mark.timeout(180)
def test_a_rank_stuck_inside_a_collective_is_named_with_its_stack(base_overrides, manifest_file, tmp_path):
    """Rank 1 never reaches the update; rank 0 enters it and waits inside FSDP's collectives for rank 1."""
    run = tmp_path / "run"
    args = _common(base_overrides, 2, run) + ["trainer.executor=ray", "trainer.ray_num_cpus=2", "trainer.n_workers=2",
                                              "trainer.phase_timeouts.worker_call=8"]
    started = time.monotonic()
    code, errors, err = _finish(_start(manifest_file, args, hang="update_actor:1:2"))  # step 2's update
    assert code == 2 and len(errors) == 1, err[-3000:]
    line = errors[0]
    assert "phase 'update_actor' (role actor)" in line and "trainer.phase_timeouts.worker_call = 8" in line, line
    assert "rank 0 of worker group 'colocated'" in line and "rank 1 of worker group 'colocated'" in line, line
    assert time.monotonic() - started < 150
    logged = (run / "train.log").read_text()
    dump = logged[logged.index("Python stacks of the driver and every worker"):]
    rank0 = dump[dump.index("==== rank 0 of worker group"):dump.index("==== rank 1 of worker group")]
    rank1 = dump[dump.index("==== rank 1 of worker group"):]
    assert "torch/distributed" in rank0 and "update_actor" in rank0, rank0[:3000]  # inside the collective
    assert "hang_point" in rank1, rank1[:3000]
    assert _latest(run) == "step_1"


@pytest.mark.timeout(120)
def test_a_rollout_that_never_returns_in_the_local_executor(base_overrides, manifest_file, tmp_path):
    run = tmp_path / "run"
    args = _common(base_overrides, 2, run) + ["trainer.executor=local", "trainer.phase_timeouts.generation=5"]
    started = time.monotonic()
    code, errors, err = _finish(_start(manifest_file, args, hang="generate:0:2"))  # step 2's generation
    assert code == 2 and len(errors) == 1, err[-3000:]
    assert "phase 'generation' (role rollout)" in errors[0] and "the driver (pid" in errors[0], errors[0]
    assert time.monotonic() - started < 90
    logged = (run / "train.log").read_text()
    assert "hang_point" in logged[logged.index("Python stacks of the driver"):]  # the driver's own stack
    assert _latest(run) == "step_1" and _steps(run) == [1]


@pytest.mark.timeout(120)
def test_a_reward_function_that_blocks(base_overrides, manifest_file, tmp_path):
    reward = tmp_path / "blocking_reward.py"
    reward.write_text(
        "import threading\n"
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    threading.Event().wait()  # a remote judge that never answers\n"
        "    return 0.0\n")
    run = tmp_path / "run"
    args = [o for o in _common(base_overrides, 2, run) if not o.startswith("reward.function")]
    args += [f"reward.function={reward}:compute_score", "reward.num_workers=0", "trainer.executor=local",
             "trainer.phase_timeouts.reward=5"]
    code, errors, err = _finish(_start(manifest_file, args))
    assert code == 2 and len(errors) == 1, err[-3000:]
    assert "phase 'reward' (role reward)" in errors[0] and "trainer.phase_timeouts.reward = 5" in errors[0], errors[0]
    logged = (run / "train.log").read_text()
    assert "blocking_reward.py" in logged[logged.index("Python stacks of the driver"):]


def test_a_deadline_of_zero_or_less_is_one_line(base_overrides, manifest_file, tmp_path):
    cases = [("trainer.phase_timeout_s=0", "trainer.phase_timeout_s"),
             ("trainer.phase_timeouts.checkpoint=-5", "trainer.phase_timeouts.checkpoint")]
    procs = [_start(manifest_file, base_overrides + [extra, f"trainer.run_dir={tmp_path / str(i)}"])
             for i, (extra, _) in enumerate(cases)]
    for (_, key), proc in zip(cases, procs):
        code, errors, err = _finish(proc)
        assert code == 2 and len(err.strip().splitlines()) == 1 and f"'{key}'" in errors[0], err[-2000:]
