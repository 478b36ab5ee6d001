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


# ---------------------------------------------------------------------- damaged checkpoints, a full disk


def _shard(run: Path, step: int) -> Path:
    return run / "checkpoints" / f"step_{step}" / "actor" / "__0_0.distcp"


def test_damaged_checkpoints_are_refused_or_skipped_for_the_newest_intact_one(base_overrides, manifest_file,
                                                                             tmp_path):
    run = tmp_path / "run"
    common = _common(base_overrides, 3) + ["trainer.executor=local", f"trainer.run_dir={run}"]
    assert _run(manifest_file, common).returncode == 0
    corrupted, truncated = _shard(run, 3), _shard(run, 2)
    data = bytearray(corrupted.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte in the middle of the weights: same size
    corrupted.write_bytes(bytes(data))
    truncated.write_bytes(truncated.read_bytes()[:1000])

    # named explicitly: refused in one line that names the file
    proc = _run(manifest_file, common + [f"trainer.resume={run / 'checkpoints' / 'step_3'}"])
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(err) == 1, proc.stderr[-3000:]
    assert "step_3/actor/__0_0.distcp is corrupted" in err[0] and "trainer.resume=auto" in err[0]

    # trainer.resume=auto: one warning naming both, then the run continues from step 1, the newest intact one
    proc = _run(manifest_file, _common(base_overrides, 4) + ["trainer.executor=local", f"trainer.run_dir={run}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    warnings = [line for line in proc.stderr.splitlines() if "is damaged" in line]
    assert len(warnings) == 1, proc.stderr[-3000:]
    assert "step_3 is damaged" in warnings[0] and "step_2 is damaged" in warnings[0] and "truncated" in warnings[0]
    assert warnings[0].rstrip().endswith("step_1, the newest intact checkpoint")
    assert _steps(run) == [1, 2, 3, 4] and _latest(run) == "step_4"
    assert "Traceback" not in proc.stderr


def test_disk_full_during_a_save_is_one_error_and_the_run_resumes(base_overrides, manifest_file, tmp_path,
                                                                  monkeypatch):
    """ENOSPC raised where the engine writes its shards (torch.distributed.checkpoint's FileSystemWriter), as a
    full file system would. A value read from the environment (a secret) is recorded as its interpolation."""
    import errno

    from torch.distributed.checkpoint import FileSystemWriter

    from polyrl.checkpoint_io import verify_files
    from polyrl.errors import CheckpointDiskFullError

    monkeypatch.setenv("POLYRL_TEST_SECRET", "hunter2-secret")
    run = tmp_path / "run"
    args = _common(base_overrides, 2) + ["trainer.executor=local", f"trainer.run_dir={run}",
                                         "trainer.experiment_name=${oc.env:POLYRL_TEST_SECRET}"]
    real_write = FileSystemWriter.write_data
    writes: list[str] = []

    def full_on_the_second_save(self, plan, planner):
        writes.append(str(self.path))
        if len(writes) == 2:
            raise OSError(errno.ENOSPC, "No space left on device", str(self.path))
        return real_write(self, plan, planner)

    monkeypatch.setattr(FileSystemWriter, "write_data", full_on_the_second_save)
    with pytest.raises(CheckpointDiskFullError) as info:
        train(manifest_file, [], args)
    message = str(info.value)
    assert "\n" not in message and "disk full while saving checkpoint" in message and "step_2" in message
    assert "No space left on device" in message and "previous checkpoint (step_1) is whole" in message
    ckpts = run / "checkpoints"
    assert _latest(run) == "step_1" and verify_files(ckpts / "step_1")
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step_1"]  # nothing half-written left
    monkeypatch.setattr(FileSystemWriter, "write_data", real_write)

    train(manifest_file, [], args)  # the resumed run resolves the interpolation again and passes the config check
    assert _steps(run) == [1, 2] and _latest(run) == "step_2"
    assert "${oc.env:POLYRL_TEST_SECRET}" in (run / "config.yaml").read_text()
    for path in run.rglob("*"):
        if path.is_file() and path.suffix in (".yaml", ".json", ".jsonl", ".toml", ".log"):
            assert "hunter2-secret" not in path.read_text(errors="replace"), path


def test_a_refused_resume_leaves_the_run_files_and_the_checkpoint_exports(base_overrides, tmp_path):
    """Resuming an fsdp checkpoint with the megatron engine is refused by the engine; the run's config.yaml,
    manifest lock and platform record stay the ones its checkpoints were written with."""
    pytest.importorskip("megatron.core")
    from polyrl.trainer.commands import export

    manifest = tmp_path / "both.toml"
    manifest.write_text('[plugins]\nrequire = ["polyrl-engine-fsdp", "polyrl-engine-megatron"]\n')
    run = tmp_path / "run"
    common = _common(base_overrides, 1) + ["trainer.executor=local", f"trainer.run_dir={run}"]
    assert _run(manifest, common).returncode == 0
    files = ("config.yaml", "manifest.lock.toml", "platform.json", "metrics.jsonl")
    before = {f: (run / f).read_bytes() for f in files}
    proc = _run(manifest, _common(base_overrides, 2) + [
        "trainer.executor=local", f"trainer.run_dir={run}", "actor.engine=megatron",
        "trainer.resume_override=[actor,ref]"])
    err = [line for line in proc.stderr.strip().splitlines() if "error" in line]
    assert proc.returncode == 2 and len(err) == 1 and "another engine" in err[0], proc.stderr[-3000:]
    assert {f: (run / f).read_bytes() for f in files} == before
    export(run / "checkpoints" / "step_1", tmp_path / "hf", manifest)
    assert (tmp_path / "hf" / "config.json").exists()
