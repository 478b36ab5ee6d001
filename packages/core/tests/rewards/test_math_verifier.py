"""The math-verify child process: a fresh interpreter, a deadline, and clear errors when it dies."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from polyrl.rewards.math_verifier import MathVerifier

pytest.importorskip("math_verify")

SCRIPT = """\
import pathlib, sys
with open(sys.argv[1], "a") as marker:  # top-level code, no main guard: must run exactly once
    marker.write("ran\\n")
from polyrl.rewards.math_verifier import MathVerifier
verifier = MathVerifier(timeout_s=60.0)
assert verifier("\\\\boxed{\\\\frac{2}{4}}", "\\\\frac{1}{2}") is True
verifier.close()
"""


def test_a_script_without_a_main_guard_runs_once(tmp_path):
    """multiprocessing's spawn re-ran the caller's __main__ in the child (a second training run)."""
    script, marker = tmp_path / "train.py", tmp_path / "ran.txt"
    script.write_text(SCRIPT)
    done = subprocess.run([sys.executable, str(script), str(marker)], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    assert marker.read_text().splitlines() == ["ran"]


def test_a_child_that_cannot_start_is_a_runtime_error(monkeypatch):
    monkeypatch.setattr(sys, "executable", "/bin/false")
    verifier = MathVerifier(timeout_s=5.0)
    with pytest.raises(RuntimeError, match="exited while starting"):
        verifier("\\boxed{2}", "2")
    verifier.close()


def test_a_child_killed_mid_check_is_a_runtime_error_and_the_next_call_restarts_it():
    verifier = MathVerifier(timeout_s=60.0)
    try:
        assert verifier("\\boxed{2}", "2") is True
        child = verifier._proc
        assert child is not None
        slow = "\\boxed{" + "+".join(f"x^{{{i}}}" for i in range(300)) + "}"
        errors: list[BaseException] = []

        def check() -> None:
            try:
                verifier(slow, slow)
            except BaseException as exc:  # noqa: BLE001 - inspected below
                errors.append(exc)

        thread = threading.Thread(target=check)
        thread.start()
        time.sleep(0.3)
        child.kill()  # as the OOM killer would
        thread.join(timeout=60)
        assert not thread.is_alive()
        assert len(errors) == 1 and type(errors[0]) is RuntimeError, errors
        assert "exited while checking" in str(errors[0])
        assert verifier("\\boxed{3}", "3") is True  # a new child took over
        assert verifier._proc is not child
    finally:
        verifier.close()
