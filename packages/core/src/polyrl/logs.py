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

Third-party output goes through the same two places (:func:`quiet_third_party`, called by
:func:`setup_run_logging` in the driver and in every worker): transformers' weight-loading and shard-writing
bars are off (one bar on the console: polyrl's), warnings raised inside installed libraries go to the log file
only (yours and polyrl's still reach the console), and with Ray, its own logger (the token-auth notice, "Started
a local Ray instance") goes to the log file and only its errors to the console (:func:`route_ray_logger`),
while what worker processes print reaches the console through ``tqdm.write``, above the bar
(:func:`route_ray_worker_output`).

Nothing here imports tqdm until a record is written, so importing this module stays cheap.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
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
    quiet_third_party(worker=bool(tag))
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


def quiet_third_party(*, worker: bool = False) -> None:
    """Keep third-party output off the console (idempotent): transformers' progress bars off (in a worker the
    Hub's download bars too; the driver keeps them, a download being worth a bar), and warnings raised inside
    installed libraries sent to the log file (:func:`capture_library_warnings`)."""
    if "transformers" in sys.modules or _importable("transformers"):
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # also turns the Hub's bars off...
        if not worker:
            try:
                from huggingface_hub.utils import enable_progress_bars

                enable_progress_bars()  # ...which the driver keeps for downloads
            except ImportError:
                pass
    capture_library_warnings()


def _importable(name: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


#: Path parts that mark a file as an installed third-party library (polyrl's own packages excepted).
_LIBRARY_DIRS = (f"{os.sep}site-packages{os.sep}", f"{os.sep}dist-packages{os.sep}")
_original_showwarning: Any = None


def _from_library(filename: str) -> bool:
    """Whether ``filename`` lies in an installed package other than polyrl's own (``polyrl``, ``polyrl_*``)."""
    for marker in _LIBRARY_DIRS:
        if marker in filename:
            top = filename.split(marker, 1)[1].split(os.sep, 1)[0]
            return not (top == "polyrl" or top.startswith("polyrl_"))
    return False


def capture_library_warnings() -> None:
    """Python warnings raised inside installed libraries (torch, transformers, Ray...) go to the run's log file
    at DEBUG instead of the console; any other warning (your code's, polyrl's) is shown as Python shows it.
    Idempotent."""
    global _original_showwarning
    if _original_showwarning is not None:
        return
    _original_showwarning = warnings.showwarning

    def showwarning(message: Any, category: type, filename: str, lineno: int, file: Any = None,
                    line: str | None = None) -> None:
        if file is None and _from_library(str(filename)):
            logging.getLogger(f"{ROOT}.third_party").debug(
                "%s", warnings.formatwarning(message, category, filename, lineno, line).rstrip())
            return
        _original_showwarning(message, category, filename, lineno, file, line)

    warnings.showwarning = showwarning


class _ToRunLog(logging.Handler):
    """Hands a library's records to polyrl's handlers: every record to the run's log file, records at
    ``console_level`` and up to the console as well (formatted by polyrl's handlers, whatever formatter
    the library later sets on this one)."""

    def __init__(self, console_level: int) -> None:
        super().__init__(logging.DEBUG)
        self.console_level = console_level

    def emit(self, record: logging.LogRecord) -> None:
        for handler in _logger().handlers:
            wanted = isinstance(handler, _RunFileHandler) or record.levelno >= self.console_level
            if wanted and record.levelno >= handler.level:
                handler.handle(record)


def route_library_logger(name: str, console_level: int = logging.ERROR) -> None:
    """Send the records of library logger ``name`` to the run's log file, and those at ``console_level`` and up
    to polyrl's console handler too, instead of the library's own stderr handler. Idempotent."""
    logger = logging.getLogger(name)
    if any(isinstance(h, _ToRunLog) for h in logger.handlers):
        return
    for h in list(logger.handlers):
        logger.removeHandler(h)
    logger.addHandler(_ToRunLog(console_level))
    logger.propagate = False


def route_ray_logger() -> None:
    """Ray's ``ray`` logger (token-auth notice, "Started a local Ray instance"...) into the run's log file, its
    errors to the console. Call after ``import ray`` (which installs Ray's own handler) and before ``ray.init``."""
    route_library_logger("ray", logging.ERROR)


def route_ray_worker_output() -> bool:
    """What Ray worker processes print (their warnings, a stray ``print``) reaches the console through
    ``tqdm.write``, above a live progress bar, as ``(Worker pid=N) text``, instead of Ray's own printer.

    Call after ``ray.init(log_to_driver=True)``. Ray offers no public hook for this, so it replaces the handler
    Ray registers on its (internal) stdout/stderr dispatcher; where that is missing (another Ray release), Ray's
    printer stays and False is returned.
    """
    try:
        from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher
    except ImportError:
        return False
    names = [name for name, _ in getattr(dispatcher, "handlers", [])]
    if "ray_print_logs" not in names or not hasattr(dispatcher, "remove_handler"):
        return False
    dispatcher.remove_handler("ray_print_logs")
    dispatcher.add_handler("polyrl_worker_output", _print_worker_lines)
    return True


#: Ray's marker before an informational line a worker prints (its ``LOG_PREFIX_INFO_MESSAGE``).
_RAY_INFO_MARK = ":info_message:"


def _print_worker_lines(data: dict) -> None:
    """One Ray log batch (``lines`` of the process ``pid``) onto the console above the bar. The autoscaler's
    status reports (every few seconds; ``ray status`` shows them) and Ray's own distributed-tqdm updates are
    left out."""
    pid = data.get("pid", "")
    if pid == "autoscaler":
        return
    handler = console_handler()
    stream = sys.stderr
    who = data.get("actor_name") or data.get("task_name") or ""
    prefix = f"({who} pid={pid}) " if pid not in ("raylet", "") else f"({pid}) " if pid else ""
    for line in data.get("lines", []):
        if not line.strip() or "__ray_tqdm_magic_token__" in line:
            continue
        text = line.split(_RAY_INFO_MARK, 1)[1] if _RAY_INFO_MARK in line else line
        try:
            from tqdm import tqdm

            tqdm.write(prefix + text, file=handler.stream if handler is not None else stream)
        except Exception:  # the console is gone (a closed pipe): nothing to show it on
            return


def progress_bar(enabled: bool, total: int, initial: int = 0, desc: str = "polyrl train") -> Any:
    """A tqdm step bar on stderr (``None`` when ``enabled`` is false, e.g. ``trainer.progress_bar=false``).

    Log records reach the console through :class:`TqdmConsoleHandler`, above the bar, never onto its line.
    """
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc=desc, unit="step", dynamic_ncols=True)
