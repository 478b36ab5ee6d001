"""Fault injection for crash tests: ``POLYRL_FAULT_AT=phase:step`` kills the driver with SIGKILL there.

Phases, in the order a step passes them: ``gen`` (after generation and rewards), ``update`` (after the
actor update), ``metrics`` (after the step's metrics line is written), ``checkpoint`` (engines and trainer
state written, before the checkpoint is renamed into place) and ``latest`` (right after ``latest`` moved).
Several points may be given, comma-separated. Unset (the normal case) this costs one dict lookup.
"""

from __future__ import annotations

import os
import signal

PHASES = ("gen", "update", "metrics", "checkpoint", "latest")


def fault_point(phase: str, step: int) -> None:
    """SIGKILL this process when ``POLYRL_FAULT_AT`` names ``phase:step``."""
    spec = os.environ.get("POLYRL_FAULT_AT")
    if spec and f"{phase}:{step}" in (s.strip() for s in spec.split(",")):
        os.kill(os.getpid(), signal.SIGKILL)
