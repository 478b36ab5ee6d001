"""Math answers checked by the ``math-verify`` library, safely and with a time limit.

``math_verify`` bounds its own work with ``signal.alarm``, which only works in a
process's main thread: called from a reward worker thread or a Ray actor's thread
it fails or never times out (verl #5635). Here it runs with its own timeouts
disabled, in a child process (``python -m polyrl.rewards.math_verifier``, a fresh
interpreter: unlike ``multiprocessing``'s ``spawn`` it never re-imports the caller's
``__main__``, so a training script without an ``if __name__ == "__main__":`` guard
does not run twice) that answers one question at a time over JSON lines on its
stdin/stdout. The caller waits at most ``timeout_s`` and, past it, kills the child
and starts a new one. Callers may be any thread; calls are serialised per verifier.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import select
import subprocess
import sys
import threading
import time
from typing import Any

log = logging.getLogger("polyrl.rewards")

__all__ = ["MathVerifier", "MathVerifyTimeout", "get_math_verifier", "math_verify_available"]

INSTALL_HINT = "MATH scoring needs the math-verify library (an extra of polyrl): pip install 'polyrl[math]'"


#: seconds a new child may take to start and import math_verify (sympy), not counted in a call's timeout
STARTUP_TIMEOUT_S = 120.0


class MathVerifyTimeout(TimeoutError):
    """``math_verify`` took longer than the verifier's ``timeout_s`` (the child process was restarted)."""


def math_verify_available() -> bool:
    """Whether ``math_verify`` can be imported."""
    import importlib.util

    return importlib.util.find_spec("math_verify") is not None


def verify_answer(ground_truth: str, solution: str) -> bool:
    """``math_verify`` on one pair, in this process, with its signal-based timeouts off.

    The gold answer is parsed as LaTeX (wrapped in ``\\boxed{}`` unless it holds one);
    the solution as LaTeX or a plain expression; correct when any parse of the
    solution equals any parse of the gold answer.
    """
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    gold_text = ground_truth if "\\boxed" in ground_truth else "\\boxed{" + ground_truth + "}"
    gold = parse(gold_text, (LatexExtractionConfig(),), parsing_timeout=None)
    pred = parse(solution, (ExprExtractionConfig(), LatexExtractionConfig()), parsing_timeout=None)
    if not gold or not pred:
        return False
    return bool(verify(gold, pred, timeout_seconds=None))


def _serve() -> None:
    """The child's loop: ``{"gold", "solution"}`` lines on stdin, ``{"ok", "result"|"error"}`` lines on
    stdout (the first one says it is ready), until stdin closes."""
    # answers go to a private copy of stdout; anything else the libraries print lands on stderr
    out = os.fdopen(os.dup(1), "w", encoding="utf-8", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def answer(**message: Any) -> None:
        out.write(json.dumps(message) + "\n")
        out.flush()

    logging.getLogger("math_verify").setLevel(logging.ERROR)  # "timeout is disabled" warnings: we enforce it
    try:
        import math_verify  # noqa: F401 - imported before "ready" so the first answer's deadline excludes it
    except Exception as exc:  # noqa: BLE001
        answer(ok=False, error=f"{type(exc).__name__}: {exc}")
        return
    answer(ok=True, result="ready")
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            request = json.loads(line)
            answer(ok=True, result=verify_answer(str(request["gold"]), str(request["solution"])))
        except Exception as exc:  # noqa: BLE001 - a bad answer must not kill the verifier
            answer(ok=False, error=f"{type(exc).__name__}: {exc}")


class _ChildDied(Exception):
    """The child closed its stdout (it exited or was killed)."""


class MathVerifier:
    """Checks answers with ``math_verify`` in a child process, at most ``timeout_s`` seconds per call."""

    def __init__(self, timeout_s: float = 10.0) -> None:
        if timeout_s <= 0:
            raise ValueError(f"MathVerifier timeout_s must be > 0, got {timeout_s}")
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._buffer = b""

    def _read_line(self, timeout_s: float) -> dict | None:
        """The child's next answer, or None past ``timeout_s``; raises :class:`_ChildDied` on EOF."""
        assert self._proc is not None and self._proc.stdout is not None
        fd = self._proc.stdout.fileno()
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            readable, _, _ = select.select([fd], [], [], remaining)
            if not readable:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                raise _ChildDied
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return json.loads(line)

    def _start(self) -> subprocess.Popen[bytes]:
        if not math_verify_available():
            raise ModuleNotFoundError(INSTALL_HINT)
        import polyrl

        # the child must import this very polyrl, also when it was found through sys.path rather than installed
        src = os.path.dirname(os.path.dirname(os.path.abspath(polyrl.__file__)))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH", "")) if p)
        self._buffer = b""
        # a fresh interpreter (no fork: the caller may hold threads, CUDA, Ray state; no multiprocessing spawn:
        # it re-runs the caller's __main__); stdin closing (the caller exiting) ends it
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "polyrl.rewards.math_verifier"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, bufsize=0, close_fds=True,
        )
        try:
            ready = self._read_line(STARTUP_TIMEOUT_S)
        except (_ChildDied, ValueError):
            code = self._stop()
            raise RuntimeError(f"the math_verify child process ({sys.executable} -m polyrl.rewards.math_verifier) "
                               f"exited while starting (exit code {code}; its stderr is above). {INSTALL_HINT}") from None
        if ready is None:
            self._stop()
            raise RuntimeError(f"the math_verify child process did not start within {STARTUP_TIMEOUT_S}s")
        if not ready.get("ok"):
            self._stop()
            raise RuntimeError(f"math_verify does not import in the child process: {ready.get('error')}. {INSTALL_HINT}")
        return self._proc

    def _stop(self) -> int | None:
        """Kill the child (if any); its exit code, when it had one."""
        proc, self._proc, self._buffer = self._proc, None, b""
        if proc is None:
            return None
        if proc.poll() is None:
            proc.kill()
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                try:
                    pipe.close()
                except OSError:
                    pass
        try:
            return proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            return None

    def close(self) -> None:
        """Stop the child process (a later call starts a new one)."""
        with self._lock:
            self._stop()

    def __call__(self, solution: str, ground_truth: str) -> bool:
        """True when ``solution`` holds an answer equal to ``ground_truth``; raises :class:`MathVerifyTimeout`
        past ``timeout_s`` (starting the child, on the first call or after a timeout, is not counted) and
        RuntimeError when the child process dies (the next call starts a new one)."""
        with self._lock:
            proc = self._proc if self._proc is not None and self._proc.poll() is None else None
            if proc is None:
                self._stop()
                proc = self._start()
            assert proc.stdin is not None
            request = json.dumps({"gold": str(ground_truth), "solution": str(solution)}) + "\n"
            try:
                proc.stdin.write(request.encode("utf-8"))
                proc.stdin.flush()
                reply = self._read_line(self.timeout_s)
            except (_ChildDied, OSError, ValueError):  # died (out of memory, killed) or spoke garbage
                code = self._stop()
                raise RuntimeError(f"the math_verify child process exited while checking an answer (exit code "
                                   f"{code}); the next call starts a new one") from None
            if reply is None:
                self._stop()
                raise MathVerifyTimeout(f"math_verify took more than {self.timeout_s}s")
        if not reply.get("ok"):
            raise RuntimeError(f"math_verify failed: {reply.get('error')}")
        return bool(reply.get("result"))


_default: MathVerifier | None = None
_default_lock = threading.Lock()


def get_math_verifier(timeout_s: float = 10.0) -> MathVerifier:
    """The process-wide verifier (created on first use; its child stops at interpreter exit)."""
    global _default
    with _default_lock:
        if _default is None or _default.timeout_s != timeout_s:
            if _default is not None:
                _default.close()
            _default = MathVerifier(timeout_s)
            atexit.register(_default.close)
        return _default


if __name__ == "__main__":
    _serve()
