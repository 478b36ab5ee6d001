"""polyrl.logs: console lines above a live progress bar, and the run's own log file."""

from __future__ import annotations

import io
import logging
import subprocess
import sys

import pytest
from tqdm import tqdm

from polyrl.logs import TqdmConsoleHandler, log_failure, run_log_file, setup_run_logging


@pytest.fixture
def clean_polyrl_logger():
    logger = logging.getLogger("polyrl")
    before, level = list(logger.handlers), logger.level
    yield logger
    for h in list(logger.handlers):
        if h not in before:
            logger.removeHandler(h)
            h.close()
    logger.setLevel(level)


def _last_segment(text: str, needle: str) -> str:
    """What a terminal shows on the line that holds ``needle``: the text after its last carriage return."""
    [line] = [seg for seg in text.split("\n") if needle in seg]
    return line.rsplit("\r", 1)[-1]


def test_step_line_lands_above_the_bar_not_on_it(clean_polyrl_logger):
    stream = io.StringIO()
    logger = logging.getLogger("polyrl.test_logs")
    handler = TqdmConsoleHandler(stream)
    clean_polyrl_logger.addHandler(handler)
    clean_polyrl_logger.setLevel(logging.INFO)
    bar = tqdm(total=3, file=stream, desc="polyrl train", ascii=True, mininterval=0)
    bar.update(1)
    logger.info("step 1: score=0.5")
    bar.update(1)
    bar.close()
    assert _last_segment(stream.getvalue(), "step 1:") == "step 1: score=0.5"

    # what a plain stream handler does instead (the collision this handler exists for)
    plain_stream = io.StringIO()
    plain = tqdm(total=3, file=plain_stream, desc="polyrl train", ascii=True, mininterval=0)
    plain.update(1)
    plain_stream.write("step 1: score=0.5\n")
    plain.close()
    assert _last_segment(plain_stream.getvalue(), "step 1:") != "step 1: score=0.5"


def test_run_log_file_appends_and_follows_the_run(tmp_path, clean_polyrl_logger):
    log = logging.getLogger("polyrl.trainer.test")
    first = setup_run_logging(tmp_path / "run1")
    assert first == (tmp_path / "run1" / "train.log").resolve() and run_log_file() == first
    log.debug("details for the file")
    log.info("step 1")
    setup_run_logging(tmp_path / "run2")  # another run in the same process: its own file
    log.info("step 1 of run2")
    setup_run_logging(tmp_path / "run1")  # resumed: appended, nothing lost
    log.info("step 2")
    text = first.read_text()
    assert "details for the file" in text and "test: step 1\n" in text and "step 2" in text
    assert "run2" not in text and "step 1 of run2" in (tmp_path / "run2" / "train.log").read_text()
    assert "INFO polyrl.trainer.test: step 2" in text


def test_log_failure_one_line_on_console_traceback_in_file(tmp_path):
    """In a fresh interpreter (no handlers configured): the console gets one line, train.log the traceback."""
    code = f"""
import logging
from polyrl.logs import log_failure, setup_run_logging
path = setup_run_logging({str(tmp_path)!r})
log_failure("error in worker rank 1: ValueError: bad shape", "Traceback (most recent call last):\\n  boom")
logging.getLogger("polyrl.trainer.ppo").info("step 3: score=1")
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.splitlines() == ["error: error in worker rank 1: ValueError: bad shape", "step 3: score=1"]
    text = (tmp_path / "train.log").read_text()
    assert "Traceback (most recent call last):" in text and "ERROR polyrl: error in worker rank 1" in text


def test_log_failure_sends_traceback_at_debug(caplog):
    with caplog.at_level(logging.DEBUG, logger="polyrl"):
        log_failure("it broke", "Traceback: here")
    assert [(r.levelname, r.getMessage().splitlines()[0]) for r in caplog.records] == [
        ("DEBUG", "it broke"), ("ERROR", "it broke")]


def test_library_warnings_and_logs_go_to_the_run_log_ours_to_the_console(tmp_path):
    """In a fresh interpreter: a warning raised inside an installed library and a library logger's WARNING land in
    train.log only; the library's ERROR, and a warning raised by the user's own code, still reach the console."""
    code = f"""
import logging, warnings
from polyrl.logs import route_library_logger, setup_run_logging
setup_run_logging({str(tmp_path)!r})
warnings.warn_explicit("deprecated thing", FutureWarning, "/venv/lib/python3.11/site-packages/somelib/mod.py", 7)
warnings.warn_explicit("yours", UserWarning, "/home/me/my_reward.py", 3)
lib = logging.getLogger("somelib")
lib.addHandler(logging.StreamHandler())  # the library's own stderr handler, replaced below
route_library_logger("somelib")
lib.warning("token notice")
lib.error("it failed")
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    err = proc.stderr
    assert "deprecated thing" not in err and "token notice" not in err
    assert "yours" in err and "error: it failed" in err
    text = (tmp_path / "train.log").read_text()
    assert "deprecated thing" in text and "WARNING somelib: token notice" in text and "ERROR somelib: it failed" in text
