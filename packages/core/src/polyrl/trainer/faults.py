"""Fault injection for crash tests: ``POLYRL_FAULT_AT=phase:step`` kills the driver with SIGKILL there.

Phases, in the order a step passes them: ``gen`` (after generation and rewards), ``update`` (after the
actor update), ``metrics`` (after the step's metrics line is written), ``checkpoint`` (engines and trainer
state written, before the checkpoint is renamed into place) and ``latest`` (right after ``latest`` moved).
Several points may be given, comma-separated. Unset (the normal case) this costs one dict lookup.

``POLYRL_HANG_AT=method:rank:call`` makes a worker hang instead (the deadline tests, docs/cluster.md): rank
``rank`` blocks forever at the start of its ``call``-th call of ``method`` (``generate``, ``compute_log_prob``,
``update_actor``); its peers go on into the method's collectives and wait there for it.
"""

from __future__ import annotations

import os
import signal
import time
from collections import Counter

PHASES = ("gen", "update", "metrics", "checkpoint", "latest")


def fault_point(phase: str, step: int) -> None:
    """SIGKILL this process when ``POLYRL_FAULT_AT`` names ``phase:step``."""
    spec = os.environ.get("POLYRL_FAULT_AT")
    if spec and f"{phase}:{step}" in (s.strip() for s in spec.split(",")):
        os.kill(os.getpid(), signal.SIGKILL)


_calls: Counter[str] = Counter()


def hang_point(method: str, rank: int) -> None:
    """Block this worker forever when ``POLYRL_HANG_AT`` names this call of ``method`` on ``rank``."""
    spec = os.environ.get("POLYRL_HANG_AT")
    if not spec:
        return
    _calls[method] += 1
    if f"{method}:{rank}:{_calls[method]}" in (s.strip() for s in spec.split(",")):
        while True:  # what a wedged library call looks like from outside: a process that never returns
            time.sleep(3600)
