"""Deadlines in the driver (polyrl.controller.deadlines): code that blocks in the driver's main thread is stopped
a moment after its phase's deadline, with one line naming the phase and the driver, and nothing else changes."""

from __future__ import annotations

import signal
import threading
import time

import pytest

from polyrl.controller import deadlines
from polyrl.controller.deadlines import PhaseTimeoutError, phase


def test_a_blocking_call_in_the_driver_is_stopped_after_the_deadline():
    started = time.monotonic()
    with pytest.raises(PhaseTimeoutError) as info, phase("reward", 0.3, kind="reward", role="reward"):
        try:
            threading.Event().wait()  # a reward function that never returns...
        except Exception:  # ...and that swallows every error it sees
            pass
    took = time.monotonic() - started
    assert 0.3 + deadlines.ALARM_GRACE_S <= took < 0.3 + deadlines.ALARM_GRACE_S + 5, took
    text = str(info.value)
    assert "\n" not in text and "phase 'reward' (role reward)" in text and "the driver (pid" in text
    assert "trainer.phase_timeouts.reward = 0.3" in text
    assert deadlines.current() is None


def test_a_phase_that_finishes_in_time_changes_nothing():
    before = signal.getsignal(deadlines.DEADLINE_SIGNAL)
    with phase("outer", 5.0, kind="checkpoint"):
        with phase("inner", 0.2):
            assert deadlines.current().name == "inner"
        time.sleep(0.2 + deadlines.ALARM_GRACE_S + 0.3)  # the inner phase's timer would have fired by now
        assert deadlines.current().name == "outer"
    assert deadlines.current() is None
    assert signal.getsignal(deadlines.DEADLINE_SIGNAL) == before


def test_a_deadline_of_zero_or_less_is_one_config_error(tmp_path):
    from polyrl.config.loader import load_config
    from polyrl.config.schema import PolyrlConfig
    from polyrl.errors import ConfigError

    for override, key in (("trainer.phase_timeout_s=0", "trainer.phase_timeout_s"),
                          ("trainer.phase_timeouts.weight_sync=-1", "trainer.phase_timeouts.weight_sync"),
                          ("trainer.max_restarts=-1", "trainer.max_restarts")):
        with pytest.raises(ConfigError, match=f"config key '{key}'"):
            load_config(PolyrlConfig, [], ["model.path=x", override])
