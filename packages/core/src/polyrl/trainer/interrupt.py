"""Ctrl-C during a run: the first stops at the next step boundary, the second aborts.

The trainers wrap their loop in :class:`StopAtStepBoundary`. The first SIGINT logs one line and sets
:attr:`~StopAtStepBoundary.requested`; the loop finishes the step it is in (its metrics and, when the run
saves checkpoints, a checkpoint of it), then stops. A second SIGINT raises :class:`KeyboardInterrupt` at
once; checkpoints are written atomically (docs/checkpoints.md), so the run resumes from its last one either
way. The CLI turns a :class:`KeyboardInterrupt` into one line, not a traceback.

Ray worker processes ignore SIGINT (:class:`polyrl.controller.RayWorkerGroup` sets that up): a Ctrl-C in a
terminal reaches the whole foreground process group, and the workers must finish the step the driver asked for.
"""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType
from typing import Any

log = logging.getLogger(__name__)
_stopped = False


def stopped_by_ctrl_c() -> bool:
    """Whether a run in this process stopped early at a step boundary because of Ctrl-C (the CLI then exits
    with 130, the shell's code for an interrupted command)."""
    return _stopped


def record_stop() -> None:
    """Note that a run stopped early because of Ctrl-C (:func:`stopped_by_ctrl_c`); the trainers call it."""
    global _stopped
    _stopped = True


class StopAtStepBoundary:
    """A context manager that handles SIGINT in the main thread (elsewhere it does nothing).

    ``what`` names the unit the loop finishes before it stops, for the one line the first Ctrl-C prints.
    """

    def __init__(self, what: str = "the current step") -> None:
        self.what = what
        #: Set by the first SIGINT: the loop should stop at its next boundary.
        self.requested = False
        self._previous: Any = None
        self._installed = False

    def __enter__(self) -> StopAtStepBoundary:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.getsignal(signal.SIGINT)
            signal.signal(signal.SIGINT, self._handle)
            self._installed = True
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._installed:
            signal.signal(signal.SIGINT, self._previous if self._previous is not None else signal.default_int_handler)
            self._installed = False

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        log.info("Ctrl-C: stopping after %s (press Ctrl-C again to abort; the run resumes from its last "
                 "checkpoint either way)", self.what)


__all__ = ["StopAtStepBoundary", "record_stop", "stopped_by_ctrl_c"]
