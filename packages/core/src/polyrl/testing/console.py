"""What a clean run's console must not hold: a check for tests that capture ``polyrl train``'s stderr.

A polyrl run prints its own lines only (``platform cpu (...)``, ``step N: ...``, the end-of-run summary), with
warnings of its own marked ``warning:``. :func:`console_noise` returns every line of captured output that is a
warning (polyrl's, Python's) or third-party noise: progress bars other than polyrl's, Ray's own log lines and
its worker prefixes, tracebacks. A plugin's test can hold its plugin to the same standard::

    proc = subprocess.run(["polyrl", "train", ...], capture_output=True, text=True)
    assert console_noise(proc.stderr) == []
"""

from __future__ import annotations

import re

#: Signatures of lines a clean run does not print, each with what it is.
NOISE_PATTERNS: tuple[tuple[str, str], ...] = (
    (r"^(warning|error): ", "a polyrl warning or error"),
    (r"\b[A-Z]\w*(Warning|Error)\b:", "a Python warning or exception"),
    (r"^Traceback \(most recent call last\)", "a traceback"),
    (r"\d+%\|", "a progress bar (other than polyrl's own)"),
    (r"\d+/\d+ \[\d", "a progress bar (other than polyrl's own)"),
    (r"\b(INFO|WARNING|ERROR|DEBUG)\s+\S+\.py:\d+ --", "a Ray log line"),
    (r"\((\w+ )?pid=\d+", "a line relayed from a Ray worker"),
    (r"\(raylet\)|\(autoscaler\)|\(gcs_server\)", "a line from a Ray process"),
    (r"Loading weights|Writing model shards|Loading checkpoint shards", "a transformers progress line"),
    (r"^\[W\d+ |^\[rank\d+\]:\[W", "a torch C++ warning"),
)


def console_noise(text: str, *, allow_own_bar: bool = True) -> list[str]:
    """The lines of ``text`` (captured stdout/stderr of a run) that match :data:`NOISE_PATTERNS`, each as
    ``"<what it is>: <line>"``. With ``allow_own_bar`` polyrl's own progress bar (``polyrl train``/``polyrl sft``)
    is not counted."""
    found = []
    for raw in text.splitlines():
        for line in raw.split("\r"):
            line = line.strip("\n")
            if not line.strip():
                continue
            if allow_own_bar and re.match(r"^\s*polyrl (train|sft):\s+\d+%\|", line):
                continue
            for pattern, what in NOISE_PATTERNS:
                if re.search(pattern, line):
                    found.append(f"{what}: {line}")
                    break
    return found


__all__ = ["NOISE_PATTERNS", "console_noise"]
