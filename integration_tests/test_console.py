"""What a user sees in the terminal: ``polyrl train`` as a subprocess, its output captured.

A Ray run's console holds polyrl's lines only (Ray's token-auth notice and its other log records go to
train.log; no worker prefixes, no weight-loading bars, no warnings). Ctrl-C (SIGINT to the whole process group,
as a terminal sends it) at a random point stops at a step boundary with one line and exit code 130, leaving a
checkpoint; a second Ctrl-C aborts with one line; either way the same command resumes and finishes the run with
each step logged once. (The local executor's clean console is checked in
packages/engine-fsdp/tests/test_without_ray.py, where Ray is not installed.)
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from polyrl.testing.console import console_noise


def _cmd(manifest: Path, overrides: list[str]) -> list[str]:
    return [sys.executable, "-m", "polyrl", "train", "--manifest", str(manifest), *overrides]


def _steps(run: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()
            if "timing/step" in line]


def test_ray_run_prints_polyrl_lines_only(base_overrides, manifest_file, tmp_path):
    """With Ray's token authentication on (its default; the notice it prints goes to train.log) and a progress
    bar: every line is polyrl's, above the bar."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_MODE"}
    env["HOME"] = str(tmp_path / "home")  # Ray writes its generated token under ~/.ray
    run = tmp_path / "run"
    proc = subprocess.run(_cmd(manifest_file, base_overrides + [
        "trainer.executor=ray", "trainer.n_workers=2", "trainer.ray_num_cpus=2", "trainer.progress_bar=true",
        "trainer.logger=[console,jsonl]", "trainer.save_freq=2", "trainer.test_freq=2"]),
        capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert console_noise(proc.stderr + proc.stdout) == [], proc.stderr
    err = proc.stderr
    assert "step 2:" in err and "polyrl train: finished at step 2 of 2" in err and "polyrl export " in err
    log = (run / "train.log").read_text()
    assert "Started a local Ray instance" in log  # Ray's own records: in the run's log, not on the console
    assert "Token authentication is enabled" in log and "Token authentication" not in err


def _interrupt(cmd: list[str], at_step: int, delay: float, twice: bool = False) -> tuple[int, str]:
    """Run ``cmd`` in its own process group; after its ``step {at_step}:`` line (and ``delay`` seconds) send SIGINT to
    the group, as a terminal's Ctrl-C does (``twice``: again right after). Returns the exit code and the output."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines = []
    assert proc.stdout is not None
    sent = False
    for line in proc.stdout:
        lines.append(line)
        if not sent and line.startswith(f"step {at_step}:"):
            time.sleep(delay)
            os.killpg(proc.pid, signal.SIGINT)
            if twice:
                time.sleep(0.2)
                os.killpg(proc.pid, signal.SIGINT)
            sent = True
    return proc.wait(timeout=300), "".join(lines)


def test_ctrl_c_stops_at_a_step_boundary_and_the_run_resumes(base_overrides, manifest_file, tmp_path):
    seed = random.randrange(1 << 16)
    delay = random.Random(seed).uniform(0.0, 1.0)  # a random point of the run, after its first step
    why = f"seed {seed}: SIGINT {delay:.2f}s after step 1"
    run, total = tmp_path / "run", 30
    cmd = _cmd(manifest_file, base_overrides + ["trainer.executor=local", f"trainer.total_steps={total}",
                                                 "trainer.save_freq=100", "trainer.test_freq=0",
                                                 "trainer.val_before_train=false", "trainer.logger=[console,jsonl]"])
    code, out = _interrupt(cmd, 1, delay)
    assert code == 130, f"{why}\n{out}"
    said = [line for line in out.splitlines() if "Ctrl-C" in line]
    assert len(said) == 1 and said[0].startswith("Ctrl-C: stopping after step"), f"{why}\n{out}"
    assert "Traceback" not in out and console_noise(out) == [], f"{why}\n{out}"
    stopped = _steps(run)[-1]
    announced = int(said[0].split("step ")[1].split()[0])
    assert stopped == announced < total, f"{why}\n{out}"  # the step in progress finished, no later one started
    assert f"polyrl train: stopped at step {stopped} of {total}" in out, out
    assert (run / "checkpoints" / f"step_{stopped}").is_dir()  # saved at the boundary although save_freq=100

    again = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr
    assert f"resumed from {run / 'checkpoints' / f'step_{stopped}'} at step {stopped}" in (run / "train.log").read_text()
    assert _steps(run) == list(range(1, total + 1)), why  # each step once, in order
    assert f"polyrl train: finished at step {total} of {total}" in again.stderr


def test_a_second_ctrl_c_aborts_ray_run_with_one_line_and_it_resumes(base_overrides, manifest_file, tmp_path):
    """Ray mode (the worker process ignores SIGINT; the driver decides): two Ctrl-C abort with one line. The run
    resumes from its last checkpoint, here with the local executor (one worker: the same single rank)."""
    run = tmp_path / "run"
    common = base_overrides + ["trainer.n_workers=1", "trainer.total_steps=4", "trainer.save_freq=1",
                               "trainer.test_freq=0", "trainer.val_before_train=false", "trainer.logger=[console,jsonl]"]
    code, out = _interrupt(_cmd(manifest_file, common + ["trainer.executor=ray", "trainer.ray_num_cpus=2"]), 2, 0.0,
                           twice=True)
    assert code == 130, out
    assert "Traceback" not in out and console_noise(out) == [], out
    assert out.strip().splitlines()[-1] == ("polyrl train: aborted by Ctrl-C (started again, the run resumes from its "
                                            "last checkpoint)"), out
    saved = sorted(int(p.name[5:]) for p in (run / "checkpoints").glob("step_*"))
    assert saved and saved[-1] >= 1  # whole checkpoints only (atomic: an aborted save leaves none half-written)

    again = subprocess.run(_cmd(manifest_file, common + ["trainer.executor=local"]), capture_output=True, text=True,
                           timeout=600)
    assert again.returncode == 0, again.stderr
    assert _steps(run) == [1, 2, 3, 4]
