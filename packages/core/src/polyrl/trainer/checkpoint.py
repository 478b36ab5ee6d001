"""Run-directory checkpoints: every role's engine plus the trainer's own state, written atomically.

Layout: ``RUN_DIR/checkpoints/step_N/{actor,critic,trainer_state.json}`` and a
``latest`` file naming the newest complete one. A checkpoint is assembled in a
hidden temporary folder and renamed into place only when complete, and
``latest`` is replaced atomically, so a crash mid-save leaves the previous
checkpoint whole and resumable.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from polyrl.errors import CheckpointError

STATE_FILE = "trainer_state.json"


class CheckpointManager:
    """Saves and finds checkpoints under ``run_dir/checkpoints``."""

    def __init__(self, run_dir: str | Path, keep: int = 0) -> None:
        self.root = Path(run_dir).resolve() / "checkpoints"
        self.keep = keep

    def save(self, step: int, save_engines: Any, state: dict[str, Any]) -> Path:
        """``save_engines(path)`` writes the engines (collectively); then state, rename, ``latest``."""
        self.root.mkdir(parents=True, exist_ok=True)
        final = self.root / f"step_{step}"
        tmp = self.root / f".step_{step}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        save_engines(str(tmp))
        (tmp / STATE_FILE).write_text(json.dumps(state))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _atomic_write(self.root / "latest", final.name)
        self._prune()
        return final

    def latest(self) -> Path | None:
        """The newest complete checkpoint, or None."""
        pointer = self.root / "latest"
        if not pointer.exists():
            return None
        path = self.root / pointer.read_text().strip()
        return path if (path / STATE_FILE).exists() else None

    def _prune(self) -> None:
        if self.keep <= 0:
            return
        steps = sorted((p for p in self.root.glob("step_*") if p.is_dir()), key=lambda p: int(p.name[5:]))
        for old in steps[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)


def resolve_resume(resume: str, manager: CheckpointManager) -> Path | None:
    """The checkpoint a run should continue from: ``auto``, ``disable`` or an explicit path."""
    if resume in ("disable", "false", "False", ""):
        return None
    if resume == "auto":
        return manager.latest()
    path = Path(resume)
    if not (path / STATE_FILE).exists():
        raise CheckpointError(f"trainer.resume={resume}: no complete checkpoint there (missing {STATE_FILE})")
    return path


def read_state(path: Path) -> dict[str, Any]:
    """The trainer state stored in checkpoint ``path``."""
    return json.loads((path / STATE_FILE).read_text())


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
