"""Run-directory checkpoints: every role's engine plus the trainer's own state, written atomically.

Layout: ``RUN_DIR/checkpoints/step_N/{actor,critic,trainer_state.json,checkpoint_files.json}`` and a
``latest`` file naming the newest complete one. A checkpoint is assembled in a hidden temporary folder and
renamed into place only when complete, and ``latest`` is replaced atomically, so a crash (or a full disk)
mid-save leaves the previous checkpoint whole and resumable.

Every checkpoint records the size and digest of its files (:mod:`polyrl.checkpoint_io`); a resume checks
them first. With ``trainer.resume=auto`` a damaged checkpoint (a truncated or corrupted shard, a missing
file) is skipped for the newest intact earlier one, with one warning; a checkpoint named explicitly is
refused with one line instead.

Checkpoints are data, never code: the trainer state is JSON, and engines load their files through
:mod:`polyrl.checkpoint_io` (``weights_only=True``, DCP metadata through an allow-list), so a planted
pickle payload is refused, not run.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

# the loaders moved to polyrl.checkpoint_io (engines must not import the trainer); kept here for 0.1 plugins
from polyrl.checkpoint_io import (  # noqa: F401
    atomic_write_text,
    check_dcp_metadata,
    disk_full_error,
    load_dcp,
    load_tensors,
    verify_files,
    write_file_manifest,
)
from polyrl.errors import CheckpointDiskFullError, CheckpointError
from polyrl.trainer.faults import fault_point

STATE_FILE = "trainer_state.json"

log = logging.getLogger("polyrl")


class CheckpointManager:
    """Saves and finds checkpoints under ``run_dir/checkpoints``."""

    def __init__(self, run_dir: str | Path, keep: int = 0) -> None:
        self.root = Path(run_dir).resolve() / "checkpoints"
        self.keep = keep

    def save(self, step: int, save_engines: Callable[[str], None], state: dict[str, Any]) -> Path:
        """``save_engines(path)`` writes the engines (collectively); then the state, the file manifest, the
        rename and ``latest``. A full disk is one :class:`~polyrl.errors.CheckpointDiskFullError`, with the
        half-written checkpoint removed and the previous one untouched."""
        self.root.mkdir(parents=True, exist_ok=True)
        final = self.root / f"step_{step}"
        tmp = self.root / f".step_{step}.tmp"
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
            save_engines(str(tmp))
            (tmp / STATE_FILE).write_text(json.dumps(state))
            write_file_manifest(tmp)  # the engines' folders carry their own manifests: only those are hashed here
        except Exception as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            if disk_full_error(exc, final) is not None:
                raise self._disk_full(final, exc) from None
            raise
        fault_point("checkpoint", step)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        try:
            atomic_write_text(self.root / "latest", final.name)
        except CheckpointDiskFullError as exc:
            raise CheckpointDiskFullError(
                f"disk full while recording {final.name} in {self.root / 'latest'} ({exc.reason}): the checkpoint is "
                "complete but `latest` still names the previous one, which trainer.resume=auto continues from. "
                "Free space on that file system (or lower trainer.max_checkpoints) and run again") from None
        fault_point("latest", step)
        self._prune()
        return final

    def _disk_full(self, final: Path, exc: BaseException) -> CheckpointDiskFullError:
        whole = [p for p in self.complete() if p != final]
        previous = f"the previous checkpoint ({whole[-1].name}) is whole" if whole else "no earlier checkpoint exists"
        cause = disk_full_error(exc, final)
        detail = cause.reason if cause is not None else ""
        return CheckpointDiskFullError(
            f"disk full while saving checkpoint {final}{f' ({detail})' if detail else ''}: it was not written and "
            f"{previous}. Free space on that file system (or lower trainer.max_checkpoints) and run again: "
            "trainer.resume=auto continues from the last checkpoint")

    def complete(self) -> list[Path]:
        """Every complete checkpoint, oldest first."""
        if not self.root.is_dir():
            return []
        found = [p for p in self.root.glob("step_*") if p.is_dir() and p.name[5:].isdigit() and (p / STATE_FILE).exists()]
        return sorted(found, key=lambda p: int(p.name[5:]))

    def latest(self, *, verify: bool = True) -> Path | None:
        """The newest intact checkpoint: the one ``latest`` names when it is complete and intact, else the newest
        complete and intact one, else None. With ``verify`` each candidate's files are checked against its
        manifest (:func:`verify_checkpoint`); skipping a damaged or incomplete one logs one warning.

        Raises ``CheckpointError`` when checkpoints exist but none is intact, rather than silently starting
        over from step 0.
        """
        pointer = self.root / "latest"
        whole = self.complete()
        named = pointer.read_text().strip() if pointer.exists() else None
        candidates = list(reversed(whole))
        if named is not None and (self.root / named) in candidates:  # `latest` first, then newest first
            candidates.remove(self.root / named)
            candidates.insert(0, self.root / named)
        skipped: list[str] = []
        if named is not None and (self.root / named) not in whole:
            skipped.append(f"'{named}' (named by {pointer}) is missing or incomplete")
        for path in candidates:
            if verify:
                try:
                    verify_checkpoint(path)
                except CheckpointError as exc:
                    skipped.append(f"{path.name} is damaged: {exc}")
                    continue
            if skipped:
                log.warning("checkpoint %s; resuming from %s, the newest intact checkpoint", "; ".join(skipped), path)
            return path
        if skipped:
            raise CheckpointError(
                f"no intact checkpoint is left in {self.root} ({'; '.join(skipped)}). Start over with "
                "trainer.resume=disable (the run's history is then rewritten) or point trainer.resume at a "
                "checkpoint folder.")
        return None

    def _prune(self) -> None:
        if self.keep <= 0:
            return
        for old in self.complete()[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)


def verify_checkpoint(path: str | Path) -> bool:
    """Check a checkpoint's files against the sizes and digests recorded when it was saved
    (:func:`polyrl.checkpoint_io.verify_files`); ``CheckpointError`` names the first damaged file. Returns
    False for a checkpoint saved before polyrl recorded them (nothing to check)."""
    verified = verify_files(path)
    if not verified:
        log.debug("checkpoint %s records no file manifest (saved by an older polyrl): not verified", path)
    return verified


def resolve_resume(resume: str, manager: CheckpointManager) -> Path | None:
    """The checkpoint a run should continue from: ``auto`` (the newest intact one), ``disable`` or an explicit
    path (refused with one line when it is incomplete or damaged)."""
    if resume in ("disable", "false", "False", ""):
        return None
    if resume == "auto":
        return manager.latest()
    path = Path(resume)
    if not (path / STATE_FILE).exists():
        raise CheckpointError(f"trainer.resume={resume}: no complete checkpoint there (missing {STATE_FILE})")
    try:
        verify_checkpoint(path)
    except CheckpointError as exc:
        raise CheckpointError(f"trainer.resume={resume}: the checkpoint is damaged: {exc}. Resume from another "
                              "checkpoint (trainer.resume=auto takes the newest intact one)") from None
    return path


def read_state(path: Path) -> dict[str, Any]:
    """The trainer state stored in checkpoint ``path``."""
    try:
        return json.loads((path / STATE_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path / STATE_FILE} cannot be read: {exc}") from None


#: Keys that may change between a run and its resumption without being named in ``trainer.resume_override``:
#: how long to train, how often to save/validate/log, where to run (checkpoints are device-agnostic), and
#: values the trainer derives from those.
RESUME_FREE_KEYS = (
    "trainer.total_steps", "trainer.total_epochs", "trainer.resume", "trainer.resume_override",
    "trainer.save_freq", "trainer.max_checkpoints", "trainer.test_freq", "trainer.val_before_train",
    "trainer.logger", "trainer.progress_bar", "trainer.ray_num_cpus", "trainer.run_dir", "trainer.ray_address",
    "trainer.device", "trainer.placement_strategy", "trainer.weight_transfer",
    # deadlines and restarts: a run stopped by a deadline resumes with a longer one
    "trainer.phase_timeout_s", "trainer.phase_timeouts", "trainer.max_restarts", "trainer.restart_wait_s",
    "actor.optim.total_steps", "critic.optim.total_steps",
)


def config_differences(saved: Mapping[str, Any], current: Mapping[str, Any],
                       allowed: Iterable[str] = ()) -> list[tuple[str, Any, Any]]:
    """``(key, saved value, current value)`` for each leaf that differs, skipping :data:`RESUME_FREE_KEYS` and
    ``allowed`` (a key or any parent of it)."""
    free = tuple(RESUME_FREE_KEYS) + tuple(allowed)
    out: list[tuple[str, Any, Any]] = []
    missing = object()
    saved_flat, current_flat = _flatten(saved), _flatten(current)
    for key in sorted(set(saved_flat) | set(current_flat)):
        # an allowed key, a key under it, or an empty mapping above it (``algorithm.extra: {}`` -> ``.pass_k``)
        if any(key == f or key.startswith(f + ".") or f.startswith(key + ".") for f in free):
            continue
        old, new = saved_flat.get(key, missing), current_flat.get(key, missing)
        if old != new:
            out.append((key, None if old is missing else old, None if new is missing else new))
    return out


def _flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, Mapping) and v:
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def truncate_metrics(run_dir: str | Path, step: int) -> int:
    """Drop the lines of ``run_dir/metrics.jsonl`` logged after ``step`` (a resumed run re-runs those steps, so
    each step appears once). Atomic; returns how many lines were dropped."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return 0
    kept, dropped = [], 0
    for line in path.read_text().splitlines():
        try:
            row_step = json.loads(line).get("step", 0) if line.strip() else None
        except ValueError:  # a line torn by a kill mid-write
            dropped += 1
            continue
        if row_step is None:
            continue
        if row_step > step:
            dropped += 1
        else:
            kept.append(line)
    if dropped:
        _atomic_write(path, "".join(line + "\n" for line in kept))
    return dropped


def _atomic_write(path: Path, text: str) -> None:
    atomic_write_text(path, text)
