"""Run-directory checkpoints, the run-directory lock, resume config checks and metrics truncation."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from polyrl.errors import CheckpointError, ConfigError
from polyrl.trainer.checkpoint import (
    STATE_FILE,
    CheckpointManager,
    config_differences,
    resolve_resume,
    truncate_metrics,
)
from polyrl.trainer.run_dir import RunDirLock, RunDirLockedError, prepare_run_dir


def _save(manager: CheckpointManager, step: int) -> None:
    from pathlib import Path

    manager.save(step, lambda path: (Path(path) / "engine.bin").write_text("x"), {"global_step": step})


def test_latest_missing_falls_back_to_newest_complete_checkpoint(tmp_path):
    manager = CheckpointManager(tmp_path)
    for step in (1, 2, 3):
        _save(manager, step)
    assert manager.latest().name == "step_3"
    (manager.root / "step_3" / STATE_FILE).unlink()  # incomplete
    assert resolve_resume("auto", manager).name == "step_2"
    import shutil

    shutil.rmtree(manager.root / "step_2")  # gone
    assert manager.latest().name == "step_1"


def test_latest_with_no_complete_checkpoint_refuses_instead_of_starting_over(tmp_path):
    manager = CheckpointManager(tmp_path)
    _save(manager, 1)
    (manager.root / "step_1" / STATE_FILE).unlink()
    with pytest.raises(CheckpointError, match="step_1.*trainer.resume=disable"):
        resolve_resume("auto", manager)
    assert resolve_resume("disable", manager) is None


def test_prune_keeps_the_newest(tmp_path):
    manager = CheckpointManager(tmp_path, keep=2)
    for step in (1, 2, 3, 10):
        _save(manager, step)
    assert [p.name for p in manager.complete()] == ["step_3", "step_10"]


def test_truncate_metrics_keeps_each_step_up_to_the_resumed_one(tmp_path):
    lines = [{"step": 0, "val": 1}, {"step": 1, "a": 1}, {"step": 2, "a": 2}, {"step": 3, "a": 3}]
    text = "".join(json.dumps(r) + "\n" for r in lines) + '{"step": 4, "a"'  # torn last line
    (tmp_path / "metrics.jsonl").write_text(text)
    assert truncate_metrics(tmp_path, 2) == 2
    kept = [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert kept == [0, 1, 2]


def test_config_differences_names_keys_and_honours_overrides():
    saved = {"actor": {"optim": {"lr": 1e-3, "total_steps": 4}}, "trainer": {"total_steps": 2}, "data": {"seed": 1}}
    current = {"actor": {"optim": {"lr": 2e-3, "total_steps": 8}}, "trainer": {"total_steps": 4}, "data": {"seed": 2}}
    assert config_differences(saved, current) == [("actor.optim.lr", 1e-3, 2e-3), ("data.seed", 1, 2)]
    assert config_differences(saved, current, ["actor.optim"]) == [("data.seed", 1, 2)]
    # a key allowed under a mapping that was empty in the checkpoint
    assert config_differences({"algorithm": {"extra": {}}}, {"algorithm": {"extra": {"pass_k": 4}}},
                              ["algorithm.extra.pass_k"]) == []


def test_second_lock_is_refused_with_the_holders_pid_and_host(tmp_path):
    with RunDirLock(tmp_path), pytest.raises(RunDirLockedError, match=rf"pid {os.getpid()} on host \S+"):
        RunDirLock(tmp_path).acquire()
    RunDirLock(tmp_path).acquire().release()  # released on exit


def test_lock_of_a_killed_process_does_not_block(tmp_path):
    code = ("import sys, time; from polyrl.trainer.run_dir import RunDirLock; lock = RunDirLock(sys.argv[1]).acquire(); "
            "print('locked', flush=True); time.sleep(60)")
    holder = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(RunDirLockedError, match=f"pid {holder.pid}"):
            RunDirLock(tmp_path).acquire()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    deadline = time.time() + 5
    while True:
        try:
            RunDirLock(tmp_path).acquire().release()
            break
        except RunDirLockedError:
            assert time.time() < deadline
            time.sleep(0.05)


def test_impossible_run_dir_is_a_config_error(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="trainer.run_dir=.*not a directory"):
        prepare_run_dir(tmp_path / "file")
    with pytest.raises(ConfigError, match="trainer.run_dir=.*cannot create"):
        prepare_run_dir(tmp_path / "file" / "run")
    if os.geteuid() != 0:  # root writes anywhere
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o500)
        with pytest.raises(ConfigError, match="not writable|cannot create"):
            prepare_run_dir(ro / "run")


def _short(text: str) -> bytes:
    raw = text.encode()
    return b"\x8c" + bytes([len(raw)]) + raw  # SHORT_BINUNICODE


def test_dcp_metadata_with_a_dotted_global_runs_nothing(tmp_path):
    # pickle resolves a dotted name attribute by attribute: an allow-listed module prefix must not reach
    # os.system through ``torch.distributed.checkpoint.filesystem`` + ``os.system``
    from polyrl.trainer.checkpoint import check_dcp_metadata

    marker = tmp_path / "pwned"
    payload = (b"\x80\x04" + _short("torch.distributed.checkpoint.filesystem") + _short("os.system") + b"\x93"
               + _short(f"touch {marker}") + b"\x85R.")
    (tmp_path / ".metadata").write_bytes(payload)
    with pytest.raises(CheckpointError, match="not allowed"):
        check_dcp_metadata(tmp_path)
    assert not marker.exists()


# ---------------------------------------------------------------------- damaged checkpoints, full disks


def _engine_file(manager: CheckpointManager, step: int):
    return manager.root / f"step_{step}" / "engine.bin"


@pytest.mark.parametrize("damage", ["truncated", "corrupted", "missing"])
def test_auto_resume_skips_a_damaged_checkpoint_with_one_warning(tmp_path, caplog, damage):
    manager = CheckpointManager(tmp_path)
    for step in (1, 2, 3):
        _save(manager, step)
    shard = _engine_file(manager, 3)
    if damage == "truncated":
        shard.write_text("")
    elif damage == "corrupted":
        shard.write_text("y")  # same size, other bytes
    else:
        shard.unlink()
    with caplog.at_level("WARNING", logger="polyrl"):
        assert resolve_resume("auto", manager).name == "step_2"
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "step_3 is damaged" in warnings[0] and "engine.bin" in warnings[0], warnings
    assert "resuming from" in warnings[0] and warnings[0].endswith("step_2, the newest intact checkpoint")


def test_explicitly_named_damaged_checkpoint_is_refused_in_one_line(tmp_path):
    manager = CheckpointManager(tmp_path)
    _save(manager, 1)
    _engine_file(manager, 1).write_text("y")
    with pytest.raises(CheckpointError) as info:
        resolve_resume(str(manager.root / "step_1"), manager)
    message = str(info.value)
    assert "\n" not in message and "engine.bin is corrupted" in message and "trainer.resume=auto" in message


def test_no_intact_checkpoint_left_refuses_instead_of_starting_over(tmp_path):
    manager = CheckpointManager(tmp_path)
    _save(manager, 1)
    _engine_file(manager, 1).write_text("")
    with pytest.raises(CheckpointError, match="no intact checkpoint.*step_1 is damaged.*trainer.resume=disable"):
        resolve_resume("auto", manager)


def test_a_checkpoint_without_manifest_still_resumes(tmp_path):
    # saved by an earlier polyrl: nothing to verify against, resumed as before
    manager = CheckpointManager(tmp_path)
    _save(manager, 1)
    (manager.root / "step_1" / "checkpoint_files.json").unlink()
    assert resolve_resume("auto", manager).name == "step_1"


def test_disk_full_during_save_is_one_error_and_keeps_the_previous_checkpoint(tmp_path):
    import errno
    from pathlib import Path

    from polyrl.errors import CheckpointDiskFullError

    manager = CheckpointManager(tmp_path)
    _save(manager, 1)

    def engines_fill_the_disk(path: str) -> None:
        (Path(path) / "engine.bin").write_text("half")
        raise OSError(errno.ENOSPC, "No space left on device", str(Path(path) / "engine.bin"))

    with pytest.raises(CheckpointDiskFullError) as info:
        manager.save(2, engines_fill_the_disk, {"global_step": 2})
    message = str(info.value)
    assert "\n" not in message and "disk full while saving checkpoint" in message and "step_2" in message
    assert "previous checkpoint (step_1) is whole" in message
    assert [p.name for p in manager.root.iterdir() if p.name.startswith(".")] == []  # the partial save is gone
    assert (manager.root / "latest").read_text() == "step_1" and resolve_resume("auto", manager).name == "step_1"
