"""Faults: the driver SIGKILLed at each phase of a step, then resumed; a second run into a busy run directory;
a resume with a changed config. After every resume the history holds each step exactly once, equal to an
uninterrupted run's.

The kill points come from ``POLYRL_FAULT_AT=phase:step`` (polyrl.trainer.faults). One run directory goes
through every kill point in turn (each resume is killed at the next point), so the whole chain costs a few
short runs of the tiny model with ``trainer.executor=local``; one more pair of runs covers Ray mode.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from polyrl.errors import ConfigError
from polyrl.trainer.commands import train

KEYS = ("critic/score/mean", "actor/pg_loss", "actor/grad_norm", "response_length/mean")


def _common(base_overrides: list[str], steps: int) -> list[str]:
    common = [o for o in base_overrides if not o.startswith(("trainer.run_dir", "trainer.total_steps"))]
    return common + [f"trainer.total_steps={steps}", "trainer.save_freq=1", "trainer.val_before_train=false",
                     "trainer.max_checkpoints=0"]


def _start(manifest: Path, overrides: list[str], fault: str | None = None) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("POLYRL_FAULT_AT", None)
    if fault:
        env["POLYRL_FAULT_AT"] = fault
    return subprocess.Popen([sys.executable, "-m", "polyrl", "train", "--manifest", str(manifest), *overrides],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen) -> subprocess.CompletedProcess:
    out, err = proc.communicate(timeout=600)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _run(manifest: Path, overrides: list[str], fault: str | None = None) -> subprocess.CompletedProcess:
    return _finish(_start(manifest, overrides, fault))


def _steps(run: Path) -> list[int]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r["step"] for r in rows if "critic/score/mean" in r]


def _train_rows(run: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {r["step"]: r for r in rows if "critic/score/mean" in r}


def _latest(run: Path) -> str | None:
    pointer = run / "checkpoints" / "latest"
    return pointer.read_text().strip() if pointer.exists() else None


def test_sigkill_at_every_phase_then_resume_keeps_each_step_once(base_overrides, manifest_file, tmp_path):
    common = _common(base_overrides, 4) + ["trainer.executor=local"]
    straight = tmp_path / "straight"
    assert _run(manifest_file, common + [f"trainer.run_dir={straight}"]).returncode == 0

    run = tmp_path / "killed"
    args = common + [f"trainer.run_dir={run}"]
    # (kill point, steps in metrics.jsonl afterwards, latest checkpoint afterwards)
    chain = [
        ("gen:2", [1], "step_1"),  # mid-generation of step 2
        ("update:2", [1], "step_1"),  # after the actor update
        ("metrics:2", [1, 2], "step_1"),  # step 2's metrics written, its checkpoint not
        ("checkpoint:2", [1, 2], "step_1"),  # checkpoint written, not yet renamed into place
        ("latest:3", [1, 2, 3], "step_3"),  # right after `latest` moved to step 3
    ]
    for fault, steps, latest in chain:
        proc = _run(manifest_file, args, fault)
        assert proc.returncode == -9, (fault, proc.returncode, proc.stderr[-2000:])
        assert _latest(run) == latest, fault
        assert _steps(run) == steps, (fault, _steps(run))
    proc = _run(manifest_file, args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _steps(run) == [1, 2, 3, 4]
    a, b = _train_rows(straight), _train_rows(run)
    for step in (1, 2, 3, 4):
        for key in KEYS:
            assert b[step][key] == pytest.approx(a[step][key], rel=1e-4, abs=1e-6), (step, key)
    assert not list((run / "checkpoints").glob(".step_*"))  # the half-written checkpoint was cleaned up
    assert "Traceback" not in proc.stderr


def test_ray_mode_kill_then_resume_drops_the_dead_runs_later_lines(base_overrides, manifest_file, tmp_path):
    run = tmp_path / "ray"
    args = _common(base_overrides, 2) + ["trainer.executor=ray", "trainer.ray_num_cpus=2", f"trainer.run_dir={run}"]
    proc = _run(manifest_file, args, "metrics:2")
    assert proc.returncode == -9, proc.stderr[-2000:]
    assert _steps(run) == [1, 2] and _latest(run) == "step_1"
    proc = _run(manifest_file, args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _steps(run) == [1, 2] and _latest(run) == "step_2"  # step 2 re-ran and is logged once


def test_second_run_into_a_busy_run_dir_is_refused(base_overrides, manifest_file, tmp_path):
    from polyrl.trainer.run_dir import RunDirLock

    run = tmp_path / "run"
    run.mkdir()
    code = ("import sys, time; from polyrl.trainer.run_dir import RunDirLock; lock = RunDirLock(sys.argv[1]).acquire(); "
            "print('locked', flush=True); time.sleep(120)")
    holder = subprocess.Popen([sys.executable, "-c", code, str(run)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        proc = _run(manifest_file, base_overrides + ["trainer.executor=local"])
        assert proc.returncode == 2
        err = proc.stderr.strip().splitlines()
        assert len(err) == 1 and f"pid {holder.pid}" in err[0] and "in use" in err[0], proc.stderr[-2000:]
        assert not (run / "metrics.jsonl").exists() and not (run / "config.yaml").exists()
    finally:
        holder.kill()
        holder.wait()
    RunDirLock(run).acquire().release()


def test_resume_with_a_changed_config_is_refused_unless_allowed(base_overrides, manifest_file, tmp_path):
    common = [o for o in base_overrides if not o.startswith("trainer.total_steps")]
    common += ["trainer.executor=local", "trainer.save_freq=1", "trainer.val_before_train=false"]
    run = tmp_path / "run"
    train(manifest_file, [], common + ["trainer.total_steps=1"])
    config_before = (run / "config.yaml").read_text()
    with pytest.raises(ConfigError, match=r"actor\.optim\.lr: 0\.001 -> 0\.002.*resume_override=\[actor\.optim\.lr\]"):
        train(manifest_file, [], common + ["trainer.total_steps=2", "actor.optim.lr=2e-3"])
    assert (run / "config.yaml").read_text() == config_before  # not rewritten with values never used
    train(manifest_file, [], common + ["trainer.total_steps=2", "actor.optim.lr=2e-3",
                                       "trainer.resume_override=[actor.optim.lr]"])
    rows = _train_rows(run)
    assert sorted(rows) == [1, 2]
    assert rows[1]["actor/lr"] == pytest.approx(1e-3) and rows[2]["actor/lr"] == pytest.approx(2e-3)
    assert "lr: 0.002" in (run / "config.yaml").read_text()


def test_invalid_config_exits_2_with_one_line_and_leaves_no_run_dir(base_overrides, manifest_file, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"prompt": [{"role": "user", "content": "caf\xe9"}]}\n')
    cases = [
        (["actor.ppo_mini_batch_size=0"], "actor.ppo_mini_batch_size"),
        (["trainer.total_steps=-1"], "trainer.total_steps"),
        ([f"data.train_files=[{bad}]"], "bad.jsonl line 1"),
        # used to start Ray, then fail with a traceback inside the rollout stream
        (["trainer.async_mode=fully_async", "trainer.executor=ray", "trainer.placement=split",
          "trainer.async_chunk_groups=-1"], "trainer.async_chunk_groups"),
    ]
    runs = [tmp_path / f"run_{i}" for i in range(len(cases))]
    procs = [_start(manifest_file, base_overrides + extra + [f"trainer.run_dir={run}"])  # side by side
             for (extra, _), run in zip(cases, runs)]
    for (extra, needle), run, started in zip(cases, runs, procs):
        proc = _finish(started)
        err = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(err) == 1 and needle in err[0], (extra, proc.stderr[-2000:])
        assert not run.exists(), extra


def test_error_inside_a_ray_worker_is_one_line_with_its_rank(base_overrides, manifest_file, tmp_path):
    proc = _run(manifest_file, base_overrides + ["trainer.executor=ray", "trainer.ray_num_cpus=2",
                                                 "actor.fsdp.param_dtype=bf16"])
    lines = [x for x in proc.stderr.strip().splitlines() if x.startswith("polyrl train: error")]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert lines == [lines[-1]] and "error in worker rank 0" in lines[0] and "param_dtype" in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "param_dtype" in (tmp_path / "run" / "train.log").read_text()  # the full traceback went there
