"""Headless Chromium for tests of HTML output (``polyrl view``'s report): what a person would see.

:func:`render` loads a local page in a fresh, offline Chromium profile and returns the DOM after
layout (``--dump-dom``) and a PNG screenshot (``--screenshot``). :func:`chromium_or_skip` finds the
browser; without one the test is skipped with the install line, except under CI (``CI`` set), where a
missing browser is a failure: CI installs it (``.ci/run``: Debian's ``chromium`` package).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

#: Executable names tried in order.
CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
#: No GPU, no network chatter, no first-run or sync; a fresh profile per call.
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--no-first-run", "--disable-sync", "--hide-scrollbars",
                  "--mute-audio", "--disable-extensions")


@dataclass
class Rendered:
    """The DOM Chromium built and the screenshot it took."""

    dom: str
    screenshot: Path


def find_chromium() -> str | None:
    """The path of a Chromium (or Chrome) executable, or None."""
    return next((p for p in map(shutil.which, CHROMIUM_NAMES) if p), None)


def chromium_or_skip() -> str:
    """The Chromium executable; ``pytest.skip`` with the install line when absent (a failure under CI)."""
    import pytest

    found = find_chromium()
    if found:
        return found
    message = "headless Chromium is not installed (Debian/Ubuntu: apt-get install -y chromium)"
    if os.environ.get("CI"):
        pytest.fail(f"{message}; CI must install it (.ci/run does)")
    pytest.skip(message)


def render(page: str | Path, screenshot: str | Path, *, width: int = 1280, height: int = 2400,
           chromium: str | None = None, timeout: float = 120) -> Rendered:
    """Load ``page`` (a local file) in headless Chromium; the DOM after scripts and layout, and a
    ``width`` x ``height`` screenshot written to ``screenshot``."""
    exe = chromium or find_chromium()
    if exe is None:
        raise FileNotFoundError("headless Chromium is not installed (Debian/Ubuntu: apt-get install -y chromium)")
    url = Path(page).resolve().as_uri()
    shot = Path(screenshot).resolve()
    with tempfile.TemporaryDirectory(prefix="polyrl-chromium-") as profile:
        common = [exe, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", f"--window-size={width},{height}"]
        dom = subprocess.run([*common, "--dump-dom", url], capture_output=True, text=True, timeout=timeout, check=True)
        subprocess.run([*common, f"--screenshot={shot}", url], capture_output=True, text=True, timeout=timeout,
                       check=True)
    if not shot.exists():
        raise RuntimeError(f"Chromium wrote no screenshot to {shot}")
    return Rendered(dom.stdout, shot)
