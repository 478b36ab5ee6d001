"""What a code sandbox is: run a program with an input and limits, say what happened (kind ``sandbox``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

#: ``ExecutionResult.status`` values.
STATUSES = ("ok", "error", "timeout", "compile_error", "sandbox_error")


@dataclass
class ExecutionResult:
    """One run of a program.

    ``status``: ``ok`` (it ran and exited 0), ``error`` (it ran and failed: an exception, a non-zero exit, a
    resource limit), ``timeout`` (it ran out of time), ``compile_error``, or ``sandbox_error`` (the sandbox could
    not run it at all: the program is not to blame, and a reward must not score it).
    """

    status: str
    stdout: str = ""
    stderr: str = ""
    return_code: int | None = None
    duration_s: float = 0.0
    #: Why (the sandbox's own words), for ``error``, ``timeout`` and ``sandbox_error``.
    detail: str = ""

    @property
    def ok(self) -> bool:
        """Ran and exited 0."""
        return self.status == "ok"


@runtime_checkable
class CodeSandbox(Protocol):
    """Runs untrusted programs for code-execution rewards. Built as ``factory(reward_config)``.

    ``run`` must never raise for what the program does, and must not raise for a sandbox that fails either: it
    returns ``sandbox_error``. ``check`` runs once at start-up and raises :class:`polyrl.errors.ConfigError` (one
    line naming the key) when the sandbox cannot run anything (no server answers, no isolation on this machine).
    """

    name: str

    def run(self, code: str, *, stdin: str = "", timeout_s: float = 10.0, language: str = "python",
            memory_mb: int | None = None) -> ExecutionResult:
        """Run ``code`` with ``stdin`` as its standard input, within ``timeout_s`` seconds and ``memory_mb``."""
        ...

    def check(self) -> None:
        """Raise ``ConfigError`` when the sandbox cannot run programs here."""
        ...
