"""Where polyrl's messages go: the console (without breaking the progress bar) and the run's log file.

Package code never prints; it logs under the ``polyrl`` logger (``logging.getLogger(__name__)``):

- :func:`setup_console_logging` gives the ``polyrl`` logger one console handler (stderr, INFO and up) that
  writes through ``tqdm.write`` while a progress bar is live, so a step line lands above the bar instead of
  on it. The CLI calls it; a Python caller gets it from :func:`setup_run_logging` unless it configured
  logging itself (then polyrl's records simply propagate to its handlers).
- :func:`setup_run_logging` adds ``RUN_DIR/train.log`` (DEBUG and up, with time and logger name; appended
  when a run resumes). The trainers call it as soon as the run directory exists; each worker process
  appends to the same file, its lines tagged ``[worker rank N]`` (its console shows warnings and up only).

For code that reports a failure (for instance an error raised inside a Ray worker): log the one-line
summary at ERROR and the full traceback at DEBUG; the console shows the line, ``train.log`` keeps both::

    from polyrl.logs import log_failure, setup_run_logging
    setup_run_logging(run_dir)                      # idempotent; returns RUN_DIR/train.log
    log_failure("error in worker rank 1: ValueError: bad shape", traceback_text)

Nothing here imports tqdm until a record is written, so importing this module stays cheap.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

#: The logger every polyrl module logs under (``polyrl.trainer.ppo``, ``polyrl.metrics``...).
ROOT = "polyrl"
#: The run's log file, inside the run directory.
LOG_FILE = "train.log"
_FILE_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class TqdmConsoleHandler(logging.StreamHandler):
    """A stderr handler that writes through ``tqdm.write``: live progress bars are cleared and redrawn around it."""

    def __init__(self, stream=None) -> None:
        super().__init__(stream if stream is not None else sys.stderr)
        self._follow_stderr = stream is None  # whatever sys.stderr is when a record comes (it may be replaced)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            from tqdm import tqdm

            if self._follow_stderr:
                self.stream = sys.stderr
            tqdm.write(self.format(record), file=self.stream)
            self.flush()
        except RecursionError:
            raise
        except Exception:
            self.handleError(record)


def _logger() -> logging.Logger:
    return logging.getLogger(ROOT)


def console_handler() -> logging.Handler | None:
    """The console handler :func:`setup_console_logging` installed, if any."""
    return next((h for h in _logger().handlers if isinstance(h, TqdmConsoleHandler)), None)


def setup_console_logging(level: int = logging.INFO) -> logging.Handler:
    """Give the ``polyrl`` logger its console handler (idempotent) and return it.

    Messages show as the text alone (``step 3: ...``); warnings and errors get their level in front.
    """
    handler = console_handler()
    if handler is None:
        handler = TqdmConsoleHandler()
        handler.setFormatter(_ConsoleFormatter())
        _logger().addHandler(handler)
    handler.setLevel(level)
    _raise_logger_level(level)
    return handler


def setup_run_logging(run_dir: str | Path, filename: str = LOG_FILE, *, tag: str = "",
                      console_level: int = logging.INFO) -> Path:
    """Log everything from polyrl (DEBUG and up) to ``run_dir/filename``, appending; returns the file.

    Idempotent for one run directory; a new run directory replaces the previous run's file handler. Adds the
    console handler too (at ``console_level``) when neither polyrl nor the root logger has a handler yet.
    ``tag`` marks this process's lines in the shared file (the workers pass ``worker rank N``).
    """
    path = (Path(run_dir) / filename).resolve()
    logger = _logger()
    for h in list(logger.handlers):
        if isinstance(h, _RunFileHandler):
            if Path(h.baseFilename) == path:
                return path
            logger.removeHandler(h)
            h.close()
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = _RunFileHandler(path, mode="a", encoding="utf-8", delay=False)
    handler.setLevel(logging.DEBUG)
    handler.setFormatter(logging.Formatter(_FILE_FORMAT.replace("%(name)s", f"[{tag}] %(name)s") if tag
                                           else _FILE_FORMAT))
    logger.addHandler(handler)
    _raise_logger_level(logging.DEBUG)
    if console_handler() is None and not logging.getLogger().handlers:
        setup_console_logging(console_level)
    return path


def run_log_file() -> Path | None:
    """The log file :func:`setup_run_logging` opened in this process, if any."""
    handler = next((h for h in _logger().handlers if isinstance(h, _RunFileHandler)), None)
    return Path(handler.baseFilename) if handler is not None else None


def log_failure(summary: str, details: str = "", logger: str = ROOT) -> None:
    """One ERROR line for the console (``summary``) and, at DEBUG, ``details`` (a traceback) for the log file."""
    log = logging.getLogger(logger)
    if details:
        log.debug("%s\n%s", summary, details.rstrip())
    log.error("%s", summary)


class _RunFileHandler(logging.FileHandler):
    """The run's ``train.log`` handler (a type of its own, so setup can find and replace it)."""


class _ConsoleFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        return text if record.levelno < logging.WARNING else f"{record.levelname.lower()}: {text}"


def _raise_logger_level(level: int) -> None:
    """Let records of ``level`` through the ``polyrl`` logger (never lowers what a user set more verbose)."""
    logger = _logger()
    if logger.level == logging.NOTSET or logger.level > level:
        logger.setLevel(level)


def progress_bar(enabled: bool, total: int, initial: int = 0, desc: str = "polyrl train") -> Any:
    """A tqdm step bar on stderr (``None`` when ``enabled`` is false, e.g. ``trainer.progress_bar=false``).

    Log records reach the console through :class:`TqdmConsoleHandler`, above the bar, never onto its line.
    """
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc=desc, unit="step", dynamic_ncols=True)
