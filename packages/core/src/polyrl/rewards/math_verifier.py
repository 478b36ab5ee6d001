"""Math answers checked by the ``math-verify`` library (``pip install 'polyrl[math]'``), safely and with a time limit.

``math_verify`` bounds its own work with ``signal.alarm``, which only works in a
process's main thread: called from a reward worker thread or a Ray actor's thread
it fails or never times out (verl #5635). Here it runs with its own timeouts
disabled, in a child process (``spawn``) that answers one question at a time; the
caller waits at most ``timeout_s`` and, past it, kills the child and starts a new
one. Callers may be any thread; calls are serialised per verifier.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import threading
from multiprocessing.connection import Connection
from typing import Any

log = logging.getLogger("polyrl.rewards")

__all__ = ["MathVerifier", "MathVerifyTimeout", "get_math_verifier", "math_verify_available"]

INSTALL_HINT = "MATH scoring needs the math-verify library: pip install 'polyrl[math]' (or pip install math-verify)"


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


def _serve(conn: Connection) -> None:
    """The child's loop: ``(ground_truth, solution)`` in, ``(ok, result_or_error)`` out, until ``None``."""
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # "timeout is disabled" warnings: we enforce it
    try:
        import math_verify  # noqa: F401 - imported before "ready" so the first answer's deadline excludes it
    except Exception as exc:  # noqa: BLE001
        conn.send((False, f"{type(exc).__name__}: {exc}"))
        return
    conn.send((True, "ready"))
    while True:
        try:
            request = conn.recv()
        except EOFError:
            return
        if request is None:
            return
        try:
            conn.send((True, verify_answer(*request)))
        except Exception as exc:  # noqa: BLE001 - a bad answer must not kill the verifier
            conn.send((False, f"{type(exc).__name__}: {exc}"))


class MathVerifier:
    """Checks answers with ``math_verify`` in a child process, at most ``timeout_s`` seconds per call."""

    def __init__(self, timeout_s: float = 10.0) -> None:
        if timeout_s <= 0:
            raise ValueError(f"MathVerifier timeout_s must be > 0, got {timeout_s}")
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._proc: Any = None
        self._conn: Connection | None = None

    def _start(self) -> Connection:
        if not math_verify_available():
            raise ModuleNotFoundError(INSTALL_HINT)
        ctx = multiprocessing.get_context("spawn")  # no fork: the caller may hold threads, CUDA, Ray state
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_serve, args=(child,), name="polyrl-math-verify", daemon=True)
        proc.start()
        child.close()
        self._proc, self._conn = proc, parent
        if not parent.poll(STARTUP_TIMEOUT_S):
            self._stop()
            raise RuntimeError(f"the math_verify child process did not start within {STARTUP_TIMEOUT_S}s")
        ok, message = parent.recv()
        if not ok:
            self._stop()
            raise RuntimeError(f"math_verify does not import in the child process: {message}. {INSTALL_HINT}")
        return parent

    def _stop(self) -> None:
        if self._conn is not None:
            self._conn.close()
        if self._proc is not None and self._proc.is_alive():
            self._proc.kill()
            self._proc.join(timeout=5)
        self._proc, self._conn = None, None

    def close(self) -> None:
        """Stop the child process (a later call starts a new one)."""
        with self._lock:
            self._stop()

    def __call__(self, solution: str, ground_truth: str) -> bool:
        """True when ``solution`` holds an answer equal to ``ground_truth``; raises :class:`MathVerifyTimeout`
        past ``timeout_s`` (starting the child, on the first call or after a timeout, is not counted)."""
        with self._lock:
            alive = self._conn is not None and self._proc is not None and self._proc.is_alive()
            conn = self._conn if alive and self._conn is not None else self._start()
            conn.send((str(ground_truth), str(solution)))
            if not conn.poll(self.timeout_s):
                self._stop()
                raise MathVerifyTimeout(f"math_verify took more than {self.timeout_s}s")
            try:
                ok, result = conn.recv()
            except EOFError:  # the child died (out of memory, killed): start afresh next time
                self._stop()
                raise RuntimeError("the math_verify child process exited while checking an answer") from None
        if not ok:
            raise RuntimeError(f"math_verify failed: {result}")
        return bool(result)


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
