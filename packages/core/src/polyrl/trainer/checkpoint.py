"""Run-directory checkpoints: every role's engine plus the trainer's own state, written atomically.

Layout: ``RUN_DIR/checkpoints/step_N/{actor,critic,trainer_state.json}`` and a
``latest`` file naming the newest complete one. A checkpoint is assembled in a
hidden temporary folder and renamed into place only when complete, and
``latest`` is replaced atomically, so a crash mid-save leaves the previous
checkpoint whole and resumable. When ``latest`` names a checkpoint that is gone
or incomplete, the newest complete ``step_N`` is used instead (with a warning).

Checkpoints are data, never code: the trainer state is JSON, and engines load
their tensors with ``torch.load(weights_only=True)`` (:func:`load_tensors`) and
check torch.distributed.checkpoint's pickled metadata before reading it
(:func:`check_dcp_metadata`), so a planted pickle payload is refused, not run.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import shutil
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from polyrl.errors import CheckpointError
from polyrl.trainer.faults import fault_point

STATE_FILE = "trainer_state.json"

log = logging.getLogger("polyrl")


class CheckpointManager:
    """Saves and finds checkpoints under ``run_dir/checkpoints``."""

    def __init__(self, run_dir: str | Path, keep: int = 0) -> None:
        self.root = Path(run_dir).resolve() / "checkpoints"
        self.keep = keep

    def save(self, step: int, save_engines: Callable[[str], None], state: dict[str, Any]) -> Path:
        """``save_engines(path)`` writes the engines (collectively); then state, rename, ``latest``."""
        self.root.mkdir(parents=True, exist_ok=True)
        final = self.root / f"step_{step}"
        tmp = self.root / f".step_{step}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        save_engines(str(tmp))
        (tmp / STATE_FILE).write_text(json.dumps(state))
        fault_point("checkpoint", step)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _atomic_write(self.root / "latest", final.name)
        fault_point("latest", step)
        self._prune()
        return final

    def complete(self) -> list[Path]:
        """Every complete checkpoint, oldest first."""
        if not self.root.is_dir():
            return []
        found = [p for p in self.root.glob("step_*") if p.is_dir() and p.name[5:].isdigit() and (p / STATE_FILE).exists()]
        return sorted(found, key=lambda p: int(p.name[5:]))

    def latest(self) -> Path | None:
        """The checkpoint ``latest`` names when it is complete, else the newest complete one, else None.

        Raises ``CheckpointError`` when ``latest`` exists but no complete checkpoint is left, rather than
        silently starting over from step 0.
        """
        pointer = self.root / "latest"
        whole = self.complete()
        if pointer.exists():
            named = pointer.read_text().strip()
            path = self.root / named
            if (path / STATE_FILE).exists():
                return path
            if not whole:
                raise CheckpointError(
                    f"{pointer} names checkpoint '{named}', which is missing or incomplete, and no other complete "
                    f"checkpoint is left in {self.root}. Start over with trainer.resume=disable (the run's history "
                    "is then rewritten) or point trainer.resume at a checkpoint folder."
                )
            log.warning("%s names '%s', which is missing or incomplete; resuming from %s, the newest complete "
                        "checkpoint", pointer, named, whole[-1])
        return whole[-1] if whole else None

    def _prune(self) -> None:
        if self.keep <= 0:
            return
        for old in self.complete()[: -self.keep]:
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


# ---------------------------------------------------------------------- loading engine files safely

#: Globals torch.distributed.checkpoint's ``.metadata`` pickle may name (dataclasses of its own, sizes, dtypes).
_DCP_GLOBALS = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
                ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"),
                ("pathlib", "PureWindowsPath")}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        import torch

        # a dotted name is looked up attribute by attribute (``dcp.filesystem`` + ``os.system`` would reach
        # os.system): only plain names, and from DCP's modules only its own classes (dataclasses, enums)
        allowed = "." not in name and (
            (module, name) in _DCP_GLOBALS or module.startswith("torch.distributed.checkpoint.")
            or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)))
        if not allowed:
            raise pickle.UnpicklingError(f"global '{module}.{name}' is not allowed in checkpoint metadata")
        obj = super().find_class(module, name)
        if module.startswith("torch.distributed.checkpoint.") and not (
                isinstance(obj, type) and obj.__module__.startswith("torch.distributed.checkpoint")):
            raise pickle.UnpicklingError(f"global '{module}.{name}' is not one of torch.distributed.checkpoint's "
                                         "own classes and is not allowed in checkpoint metadata")
        return obj


def check_dcp_metadata(folder: str | Path) -> None:
    """Refuse a torch.distributed.checkpoint folder whose ``.metadata`` pickle names anything but DCP's own
    metadata types (torch's reader unpickles that file without restrictions)."""
    path = Path(folder) / ".metadata"
    if not path.exists():
        raise CheckpointError(f"{folder} holds no torch.distributed.checkpoint metadata (.metadata missing)")
    try:
        with open(path, "rb") as f:
            _MetadataUnpickler(f).load()
    except Exception as exc:
        raise CheckpointError(f"{path} is not a valid checkpoint metadata file and was not loaded: {exc}") from None


def load_dcp(state: dict[str, Any], folder: str | Path) -> None:
    """``torch.distributed.checkpoint.load(state, folder)`` that runs no code from the folder: the metadata is
    checked first (:func:`check_dcp_metadata`) and non-tensor items are read with ``weights_only=True``."""
    import io

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class _PlainDataPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            try:
                obj = torch.load(value, weights_only=True)
            except Exception as exc:
                raise CheckpointError(f"{folder}: item '{read_item.dest_index.fqn}' is not plain data and was not "
                                      f"loaded: {str(exc).strip().splitlines()[0]}") from None
            clean = io.BytesIO()
            torch.save(obj, clean)
            clean.seek(0)
            super().load_bytes(read_item, clean)

    check_dcp_metadata(folder)
    dcp.load(state, checkpoint_id=str(folder), planner=_PlainDataPlanner())


def load_tensors(path: str | Path) -> Any:
    """``torch.load(path, weights_only=True)``: tensors and plain containers only, never code."""
    import torch

    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"{path} cannot be loaded as tensors and plain data (refused, nothing from it "
                              f"was run): {first}") from None


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
