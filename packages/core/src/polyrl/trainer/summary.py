"""The lines a run prints when it ends: how far it got, its best validation score, where everything is and
the commands that come next (``polyrl export``, ``polyrl serve``).

::

    finished 200 of 200 steps in 3m12s; run dir runs/quickstart/grpo
      best val/arithmetic/mean@4: 0.5703 at step 200 (last: 0.5703)
      last checkpoint: runs/quickstart/grpo/checkpoints/step_200
      export: polyrl export runs/quickstart/grpo/checkpoints/step_200 --to runs/quickstart/grpo/hf
      serve:  polyrl serve runs/quickstart/grpo/checkpoints/step_200
"""

from __future__ import annotations

import logging
import re
import shlex
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

#: A validation score: ``val/<data source>/mean@<k>`` (the mean over k samples per prompt).
_VAL_MEAN = re.compile(r"^val/(?P<source>.+)/mean@(?P<k>\d+)$")


def best_validation(rows: Iterable[Mapping[str, float]]) -> list[tuple[str, float, int, float]]:
    """``(metric, best value, its step, last value)`` per data source, for its ``mean@k`` with the largest k.

    ``rows`` are metrics rows with a ``step`` (``metrics.jsonl``, or what the trainer logged).
    """
    series: dict[str, list[tuple[int, float]]] = {}
    for row in rows:
        step = int(row.get("step", 0))
        for key, value in row.items():
            if _VAL_MEAN.match(key):
                series.setdefault(key, []).append((step, float(value)))
    chosen: dict[str, str] = {}
    for key in series:
        match = _VAL_MEAN.match(key)
        assert match is not None
        source, k = match["source"], int(match["k"])
        current = chosen.get(source)
        if current is None or k > int(_VAL_MEAN.match(current)["k"]):  # type: ignore[index]
            chosen[source] = key
    out = []
    for source in sorted(chosen):
        key = chosen[source]
        points = series[key]
        step, best = max(points, key=lambda p: (p[1], -p[0]))  # the earliest step that reached the best value
        out.append((key, best, step, points[-1][1]))
    return out


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}m{seconds:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


def _shown(path: Path) -> str:
    """``path`` relative to the working directory when it lies below it (shorter to copy), quoted for a shell."""
    try:
        text = str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        text = str(path)
    return shlex.quote(text)


def run_summary(*, verb: str, state: str, step: int, total: int, seconds: float | None, run_dir: Path,
                checkpoint: Path | None, rows: Iterable[Mapping[str, float]] = ()) -> list[str]:
    """The summary lines. ``state``: ``finished``, ``stopped`` (Ctrl-C) or ``already finished`` (a finished run
    started again); ``checkpoint``: the newest complete checkpoint, if any."""
    took = f" in {_duration(seconds)}" if seconds is not None else ""
    lines = [f"polyrl {verb}: {state} at step {step} of {total}{took}; run dir {_shown(run_dir)}"]
    for key, best, best_step, last in best_validation(rows)[:4]:
        lines.append(f"  best {key}: {best:.4g} at step {best_step} (last: {last:.4g})")
    if checkpoint is None:
        lines.append("  no checkpoint (trainer.save_freq=0)" if state != "stopped" else
                     "  no checkpoint yet: started again, the run begins at step 0")
        return lines
    lines.append(f"  last checkpoint: {_shown(checkpoint)}")
    if state == "stopped":
        lines.append("  resume: run the same command again (trainer.resume=auto continues from the last checkpoint)")
    lines.append(f"  export: polyrl export {_shown(checkpoint)} --to {_shown(run_dir / 'hf')}")
    lines.append(f"  serve:  polyrl serve {_shown(checkpoint)}")
    return lines


def metrics_rows(run_dir: Path, loggers: Iterable[str], history: list[dict[str, float]]) -> list[dict[str, float]]:
    """A run's metrics rows for the summary: ``metrics.jsonl`` (the whole history, across resumes) when the run
    writes it, else ``history`` (what this process logged)."""
    from polyrl.tracking import read_metrics

    if "jsonl" in loggers and (run_dir / "metrics.jsonl").exists():
        try:
            return read_metrics(run_dir)
        except (OSError, ValueError):  # a torn last line from a killed run: the summary does without it
            pass
    return history


def log_run_end(*, verb: str, state: str, step: int, total: int, seconds: float | None, run_dir: Path,
                checkpoint: Path | None, rows: Iterable[Mapping[str, float]] = ()) -> None:
    """Log :func:`run_summary`'s lines at INFO (console and ``train.log``)."""
    log = logging.getLogger("polyrl")
    for line in run_summary(verb=verb, state=state, step=step, total=total, seconds=seconds, run_dir=run_dir,
                            checkpoint=checkpoint, rows=rows):
        log.info("%s", line)
    if state == "already finished":
        log.info("  nothing to train: raise trainer.total_steps to train on from step %d, or start over in another "
                 "trainer.run_dir (or with trainer.resume=disable)", step)


def finished_run(config: Any) -> dict[str, float] | None:
    """``polyrl train`` of a run that already reached ``trainer.total_steps`` (its newest checkpoint says so):
    log that and the summary, and return the run's last metrics, without building anything. ``None`` when the
    run has steps left, or when that cannot be told without loading the data (``total_steps`` 0: epochs)."""
    from polyrl.errors import CheckpointError
    from polyrl.logs import setup_run_logging
    from polyrl.trainer.checkpoint import STATE_FILE, read_state, verify_checkpoint

    t = config.trainer
    if not t.total_steps or str(t.resume) != "auto":
        return None
    run_dir = Path(t.run_dir).expanduser().resolve()
    pointer = run_dir / "checkpoints" / "latest"
    try:
        checkpoint = run_dir / "checkpoints" / pointer.read_text().strip()
        if not (checkpoint / STATE_FILE).exists():
            return None
        step = int(read_state(checkpoint)["global_step"])
        if step < t.total_steps:
            return None
        verify_checkpoint(checkpoint)  # a damaged last checkpoint is not a finished run: the trainer says what to do
    except (OSError, CheckpointError, KeyError, ValueError):
        return None
    setup_run_logging(run_dir)
    rows = metrics_rows(run_dir, list(t.logger), [])
    log_run_end(verb="train", state="already finished", step=step, total=int(t.total_steps), seconds=None,
                run_dir=run_dir, checkpoint=checkpoint, rows=rows)
    last = dict(rows[-1]) if rows else {}
    last.pop("time", None)
    last.pop("step", None)
    return last


__all__ = ["best_validation", "finished_run", "log_run_end", "metrics_rows", "run_summary"]
