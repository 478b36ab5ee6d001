"""A driver killed with SIGKILL mid-run resumes from its last checkpoint and continues exactly."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest


def _cmd(manifest: Path, overrides: list[str]) -> list[str]:
    return [sys.executable, "-m", "polyrl", "train", "--manifest", str(manifest), *overrides]


def _train_rows(run: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {r["step"]: r for r in rows if "critic/score/mean" in r}


@pytest.mark.slow
def test_sigkill_then_resume_matches_uninterrupted(base_overrides, manifest_file, tmp_path):
    common = [o for o in base_overrides if not o.startswith(("trainer.run_dir", "trainer.total_steps"))]
    common += ["trainer.executor=local", "trainer.total_steps=4", "trainer.save_freq=1",
               "trainer.val_before_train=false", "trainer.max_checkpoints=0"]
    env = dict(os.environ, OMP_NUM_THREADS="1")

    straight = tmp_path / "straight"
    subprocess.run(_cmd(manifest_file, common + [f"trainer.run_dir={straight}"]), check=True, env=env,
                   capture_output=True, timeout=600)

    killed = tmp_path / "killed"
    proc = subprocess.Popen(_cmd(manifest_file, common + [f"trainer.run_dir={killed}"]), env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    latest = killed / "checkpoints" / "latest"
    deadline = time.time() + 600
    while time.time() < deadline and not (latest.exists() and latest.read_text().strip() == "step_2"):
        assert proc.poll() is None, "the run ended before it could be killed"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert (killed / "checkpoints" / "step_2" / "trainer_state.json").exists()

    subprocess.run(_cmd(manifest_file, common + [f"trainer.run_dir={killed}", "trainer.resume=auto"]), check=True,
                   env=env, capture_output=True, timeout=600)
    a, b = _train_rows(straight), _train_rows(killed)
    assert set(b) == {1, 2, 3, 4}
    for step in (3, 4):
        for key in ("critic/score/mean", "actor/pg_loss", "actor/grad_norm", "response_length/mean"):
            assert b[step][key] == pytest.approx(a[step][key], rel=1e-4, abs=1e-6), (step, key)
