"""``local``: programs run on this machine in polyrl's namespace sandbox (:mod:`polyrl.tools.sandbox`).

Each program runs in a fresh process with no network, no host files, no capabilities and OS-enforced limits
(CPU seconds, address space, processes, output; wall time enforced by the parent). The standard input is given
to the program inside the sandbox (the program is wrapped: it reads ``stdin`` from ``sys.stdin``), and what it
writes to ``sys.stderr`` comes back apart from its standard output. Python only.
"""

from __future__ import annotations

import math
import secrets
from typing import Any

from polyrl.errors import ConfigError
from polyrl.sandboxes.base import ExecutionResult

#: Runs the user's program with its standard input and keeps its stderr apart; ``{marker}`` separates them.
_WRAPPER = """\
import io as _io, sys as _sys, traceback as _tb
_sys.stdin = _io.TextIOWrapper(_io.BytesIO({stdin!r}.encode("utf-8")), encoding="utf-8")
_err = _io.StringIO()
_sys.stderr = _err
_status = 0
try:
    exec(compile({code!r}, "solution.py", "exec"), {{"__name__": "__main__"}})
except SystemExit as _exit:
    _status = _exit.code if isinstance(_exit.code, int) else (0 if _exit.code is None else 1)
except BaseException as _exc:
    _tb.print_exception(type(_exc), _exc, _exc.__traceback__.tb_next, file=_err)
    _status = 1
_sys.stdout.flush()
_sys.__stdout__.write("\\n{marker}\\n" + _err.getvalue())
_sys.__stdout__.flush()
_sys.exit(_status)
"""


class LocalSandbox:
    """Runs Python programs in :class:`polyrl.tools.sandbox.Sandbox` (``reward.code.isolation``: ``namespaces``,
    or ``none``: limits only, not a security boundary)."""

    name = "local"

    def __init__(self, config: Any = None) -> None:
        code = getattr(config, "code", None)
        self.isolation = str(getattr(code, "isolation", "namespaces"))
        if self.isolation not in ("namespaces", "none"):
            raise ConfigError(f"reward.code.isolation={self.isolation!r}: choose 'namespaces' or 'none'")
        self.memory_mb = int(getattr(code, "memory_mb", 1024))
        self.max_output_bytes = int(getattr(code, "max_output_bytes", 1 << 20))

    def check(self) -> None:
        """The namespace sandbox must work on this machine (with ``isolation=none`` there is nothing to check)."""
        if self.isolation == "none":
            return
        from polyrl.tools.sandbox import namespaces_available

        ok, why = namespaces_available()
        if not ok:
            raise ConfigError(f"reward.sandbox=local: {why}. Run where user namespaces are allowed, use "
                              "reward.sandbox=sandbox_fusion, or set reward.code.isolation=none (limits only, NOT a "
                              "security boundary)")

    def run(self, code: str, *, stdin: str = "", timeout_s: float = 10.0, language: str = "python",
            memory_mb: int | None = None) -> ExecutionResult:
        """Run ``code`` (Python) with ``stdin``; see the module docstring."""
        from polyrl.tools.sandbox import Sandbox, SandboxLimits

        if language != "python":
            return ExecutionResult("sandbox_error", detail=f"the local sandbox runs Python only, not {language!r}")
        marker = f"--polyrl-stderr-{secrets.token_hex(8)}--"
        limits = SandboxLimits(timeout_s=timeout_s, cpu_s=max(1, math.ceil(timeout_s)),
                               memory_mb=memory_mb or self.memory_mb, max_output_bytes=self.max_output_bytes)
        result = Sandbox(limits, isolation=self.isolation).run(_WRAPPER.format(stdin=stdin, code=code, marker=marker))
        out, sep, err = result.stdout.partition(f"\n{marker}\n")
        if not sep:  # killed before the wrapper's end: everything is the program's output
            out, err = result.stdout, ""
        if result.timed_out:
            return ExecutionResult("timeout", out, err, None, result.duration_s, result.error or "timed out")
        if result.error and result.error.startswith(("python sandbox", "sandbox setup failed")):
            return ExecutionResult("sandbox_error", out, err, result.returncode, result.duration_s, result.error)
        status = "ok" if result.ok else "error"
        detail = result.error or ("" if result.ok else f"exit status {result.returncode}")
        if result.error and "CPU time limit" in result.error:
            status = "timeout"
        return ExecutionResult(status, out, err, result.returncode, result.duration_s, detail)
