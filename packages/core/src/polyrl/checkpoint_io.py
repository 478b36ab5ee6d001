"""Checkpoint I/O for engines and the trainer: one safe loader, atomic folders, verifiable files.

Every polyrl engine (fsdp, megatron, diffusers) and the trainer read and write checkpoints through this
module, and third-party engines should too (docs/plugins/checkpoints.md):

- **Loading runs no code from the checkpoint.** :func:`load_tensors` is ``torch.load(weights_only=True)``;
  :func:`load_dcp` loads a ``torch.distributed.checkpoint`` folder whose pickled ``.metadata`` is read by
  :func:`read_dcp_metadata` (an unpickler that only builds DCP's own metadata classes) and whose
  non-tensor items are read with ``weights_only=True``. :func:`dcp_reader` and :func:`plain_data_planner`
  are the two halves, for an engine that drives DCP through another library (megatron-core).
- **Saving is atomic.** :func:`atomic_checkpoint_dir` gives every rank a temporary folder next to the
  target and renames it into place when all ranks finished, so a crash, a kill or a full disk mid-save
  leaves the previous checkpoint whole. A full disk is one :class:`~polyrl.errors.CheckpointDiskFullError`.
- **Checkpoints are verifiable.** The size and a SHA-256 digest of every file are recorded in
  ``checkpoint_files.json`` when the folder is complete (:func:`write_file_manifest`; the ranks share the
  hashing) and checked by :func:`verify_files` before a resume or an export: a truncated or corrupted
  shard is named instead of being loaded. The digest is over 16 MiB blocks hashed in parallel threads, so
  it costs one read of the checkpoint at the disk's or page cache's speed (docs/checkpoints.md).

The file manifest detects damage (a torn copy, a bad disk, a truncated download); it is not a signature:
whoever can change the files can change the manifest. What keeps a hostile checkpoint from running code
is the loader.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import logging
import os
import pickle
import shutil
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from polyrl.errors import CheckpointDiskFullError, CheckpointError, PolyrlError

if TYPE_CHECKING:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import Metadata
    from torch.distributed.checkpoint.planner import LoadPlanner

log = logging.getLogger("polyrl")

#: The file in a checkpoint folder that records the size and digest of every other file in it.
MANIFEST_FILE = "checkpoint_files.json"
MANIFEST_FORMAT = "polyrl-files-1"
#: Files are hashed in blocks of this size (the unit of parallel work); the file's digest is the SHA-256 of
#: its blocks' SHA-256 digests.
BLOCK_BYTES = 16 << 20
_CHUNK_BYTES = 4 << 20
#: errno values that mean "the file system has no room for this write".
DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})

__all__ = [
    "BLOCK_BYTES", "DISK_FULL_ERRNOS", "MANIFEST_FILE", "atomic_checkpoint_dir", "atomic_write_text",
    "check_dcp_metadata", "checksums_enabled", "dcp_reader", "disk_full_error", "load_dcp", "load_json", "load_tensors", "plain_data_planner",
    "read_dcp_metadata", "verify_files", "write_file_manifest",
]


# ---------------------------------------------------------------------- loading, safely


def load_tensors(path: str | Path) -> Any:
    """``torch.load(path, map_location="cpu", weights_only=True)``: tensors and plain containers only.

    Raises :class:`~polyrl.errors.CheckpointError` naming ``path`` for anything else (a pickled object,
    a truncated or corrupted file); nothing from the file runs.
    """
    import torch

    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing") from None
    except Exception as exc:
        raise CheckpointError(f"{path} cannot be loaded as tensors and plain data (refused, nothing from it "
                              f"was run): {_first_line(exc)}") from None


def load_json(path: str | Path) -> Any:
    """The JSON in checkpoint file ``path``; :class:`~polyrl.errors.CheckpointError` naming it when it is
    missing or not JSON (a torn or corrupted file)."""
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path} cannot be read as JSON (damaged?): {_first_line(exc)}") from None


#: Globals torch.distributed.checkpoint's ``.metadata`` pickle may name besides DCP's own classes.
_DCP_GLOBALS = frozenset({("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
                          ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"),
                          ("pathlib", "PureWindowsPath")})


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata dataclasses, sizes, dtypes and layouts; refuses every other global."""

    def find_class(self, module: str, name: str) -> Any:
        import torch

        # a dotted name is looked up attribute by attribute (``dcp.filesystem`` + ``os.system`` would reach
        # os.system): only plain names, and from DCP's modules only its own classes (dataclasses, enums)
        allowed = "." not in name and (
            (module, name) in _DCP_GLOBALS or module.startswith("torch.distributed.checkpoint.")
            or (module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout))))
        if not allowed:
            raise pickle.UnpicklingError(f"global '{module}.{name}' is not allowed in checkpoint metadata")
        obj = super().find_class(module, name)
        if module.startswith("torch.distributed.checkpoint.") and not (
                isinstance(obj, type) and obj.__module__.startswith("torch.distributed.checkpoint")):
            raise pickle.UnpicklingError(f"global '{module}.{name}' is not one of torch.distributed.checkpoint's "
                                         "own classes and is not allowed in checkpoint metadata")
        return obj


def read_dcp_metadata(folder: str | Path, *, file: str = ".metadata") -> Metadata:
    """The ``Metadata`` of a torch.distributed.checkpoint folder, unpickled through an allow-list of DCP's own
    classes (torch's reader unpickles that file without restrictions).

    Raises :class:`~polyrl.errors.CheckpointError` naming the file when it is missing, names any other
    global (a planted payload: refused, never run) or is not DCP metadata.
    """
    from torch.distributed.checkpoint.metadata import Metadata

    path = Path(folder) / file
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except FileNotFoundError:
        raise CheckpointError(f"{folder} holds no torch.distributed.checkpoint metadata ({file} missing)") from None
    except Exception as exc:
        raise CheckpointError(f"{path} is not a valid checkpoint metadata file and was not loaded (nothing from it "
                              f"was run): {_first_line(exc)}") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{path} is not a valid checkpoint metadata file and was not loaded: it holds a "
                              f"{type(metadata).__name__}, not torch.distributed.checkpoint Metadata")
    return metadata


def check_dcp_metadata(folder: str | Path) -> None:
    """Raise :class:`~polyrl.errors.CheckpointError` unless :func:`read_dcp_metadata` accepts ``folder``."""
    read_dcp_metadata(folder)


def dcp_reader(folder: str | Path) -> FileSystemReader:
    """A ``torch.distributed.checkpoint.FileSystemReader`` of ``folder`` whose ``read_metadata`` goes through
    :func:`read_dcp_metadata`: give it to ``dcp.load(storage_reader=...)`` (with :func:`plain_data_planner`)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class _AllowListReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
            rank = kwargs.get("rank")
            metadata = read_dcp_metadata(str(self.path), file=".metadata" if rank is None else f"__{rank}.metadata")
            storage_meta = getattr(metadata, "storage_meta", None) or StorageMeta()
            storage_meta.load_id = self.load_id
            metadata.storage_meta = storage_meta
            return metadata

    return _AllowListReader(str(folder))


def plain_data_planner(planner: LoadPlanner | None = None, *, folder: str | Path = "checkpoint") -> LoadPlanner:
    """``planner`` (default: DCP's ``DefaultLoadPlanner()``) with its non-tensor items read as plain data.

    DCP hands every non-tensor item (a pickled Python object) to ``planner.load_bytes``, whose default
    unpickles it without restrictions. Here each item is first loaded with ``weights_only=True``; anything
    else is a :class:`~polyrl.errors.CheckpointError` naming the item, and nothing from it runs. The planner's
    own ``load_bytes`` then receives the item re-serialised from that plain data, so a subclass (megatron's)
    keeps its behaviour. Tensors are read by torch with ``weights_only=True`` already.
    """
    import torch
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    planner = planner if planner is not None else DefaultLoadPlanner()
    inner = planner.load_bytes

    def load_bytes(read_item: Any, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except Exception as exc:
            raise CheckpointError(f"{folder}: item '{read_item.dest_index.fqn}' is not plain data and was not loaded "
                                  f"(nothing from it was run): {_first_line(exc)}") from None
        clean = io.BytesIO()
        torch.save(obj, clean)
        clean.seek(0)
        inner(read_item, clean)

    planner.load_bytes = load_bytes  # type: ignore[method-assign]
    return planner


def load_dcp(state: dict[str, Any], folder: str | Path, *, planner: LoadPlanner | None = None) -> None:
    """``torch.distributed.checkpoint.load(state, folder)`` that runs no code from the folder.

    The metadata goes through :func:`read_dcp_metadata` and non-tensor items through
    :func:`plain_data_planner` (wrapping ``planner``, default DCP's ``DefaultLoadPlanner``). Collective when
    torch.distributed is initialised, as ``dcp.load`` is. A refusal or a damaged shard is a
    :class:`~polyrl.errors.CheckpointError` naming the folder and, where known, the file or item.
    """
    import torch.distributed.checkpoint as dcp

    read_dcp_metadata(folder)  # a missing or hostile .metadata is refused before torch sees the folder
    try:
        dcp.load(state, storage_reader=dcp_reader(folder), planner=plain_data_planner(planner, folder=folder))
    except BaseException as exc:  # DCP wraps each rank's failure in CheckpointException, a BaseException
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        own = _polyrl_error_in(exc)
        if own is not None:
            raise own from None
        raise CheckpointError(f"checkpoint {folder} cannot be loaded: {_first_line(_innermost(exc))}") from None


# ---------------------------------------------------------------------- saving, atomically


@contextmanager
def atomic_checkpoint_dir(path: str | Path, *, checksums: bool | None = None) -> Iterator[Path]:
    """Write a checkpoint folder that appears at ``path`` complete or not at all.

    Yields a temporary folder next to ``path`` (``<name>.tmp-<id>``, the same on every rank) for every rank to
    write into. On a normal exit, after all ranks arrive: the file manifest is written (the ranks share the
    hashing; ``checksums=False`` records sizes only, ``None`` asks :func:`checksums_enabled`), then rank 0
    renames the folder into place, replacing an older one, and all ranks wait for that. Collective when
    torch.distributed is initialised.

    On an error inside the block the temporary folder is removed and ``path`` is left as it was; a full disk
    (``ENOSPC``, ``EDQUOT``, ``EFBIG`` anywhere in the error's chain) becomes one
    :class:`~polyrl.errors.CheckpointDiskFullError` naming ``path``.
    """
    import torch.distributed as dist

    final = Path(path)
    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    token = [uuid.uuid4().hex[:8] if rank == 0 else None]
    if distributed:
        dist.broadcast_object_list(token, src=0)
    tmp = final.parent / f"{final.name}.tmp-{token[0]}"
    try:
        if rank == 0:
            tmp.mkdir(parents=True)
        if distributed:
            dist.barrier()
        yield tmp
        if distributed:
            dist.barrier()
        write_file_manifest(tmp, checksums=checksums)
        if rank == 0:
            old = final.parent / f"{final.name}.old-{token[0]}"
            if final.exists():
                os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        if distributed:
            dist.barrier()
    except BaseException as exc:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # frees what the failed save took
        full = disk_full_error(exc, final)
        if full is not None:
            raise full from None
        raise


def disk_full_error(exc: BaseException, target: str | Path) -> CheckpointDiskFullError | None:
    """A :class:`~polyrl.errors.CheckpointDiskFullError` about saving ``target`` when ``exc`` is (or wraps, in
    its cause chain, a torch.distributed.checkpoint failure or a Ray task error) a full disk; else None."""
    seen: set[int] = set()
    stack: list[Any] = [exc]
    while stack:
        e = stack.pop()
        if not isinstance(e, BaseException) or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, CheckpointDiskFullError):
            return e
        if isinstance(e, OSError) and e.errno in DISK_FULL_ERRNOS:
            reason = f"{e.strerror or os.strerror(e.errno)}{f', {e.filename}' if e.filename else ''}"
            full = CheckpointDiskFullError(
                f"disk full while saving checkpoint {target} ({reason}): it was not written and the previous one "
                "is whole; free space (or lower trainer.max_checkpoints) and resume")
            full.reason = reason
            return full
        stack += [e.__cause__, e.__context__, getattr(e, "cause", None)]
        failures = getattr(e, "failures", None)  # torch.distributed.checkpoint's CheckpointException
        if isinstance(failures, dict):
            stack += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
    return None


def atomic_write_text(path: str | Path, text: str) -> None:
    """Replace ``path`` with ``text`` atomically (written next to it, then renamed); a full disk is a
    :class:`~polyrl.errors.CheckpointDiskFullError` and leaves the old file."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        full = disk_full_error(exc, path)
        if full is not None:
            raise full from None
        raise


# ---------------------------------------------------------------------- verifiable files


def _files(folder: Path) -> list[str]:
    """Files under ``folder`` a manifest covers, relative and sorted: a sub-folder with its own manifest is
    covered by that manifest alone (listed here), and the folder's own manifest is left out."""
    out: list[str] = []

    def walk(d: Path, prefix: str) -> None:
        for entry in sorted(d.iterdir(), key=lambda p: p.name):
            rel = f"{prefix}{entry.name}"
            if entry.is_dir() and not entry.is_symlink():
                if (entry / MANIFEST_FILE).is_file():
                    out.append(f"{rel}/{MANIFEST_FILE}")
                else:
                    walk(entry, f"{rel}/")
            elif entry.is_file() and rel != MANIFEST_FILE:
                out.append(rel)

    walk(folder, "")
    return out


def _hash_block(path: Path, offset: int, length: int) -> bytes:
    h = hashlib.sha256()
    buf = bytearray(min(_CHUNK_BYTES, max(length, 1)))
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        f.seek(offset)
        left = length
        while left > 0:
            n = f.readinto(view[: min(left, len(buf))])
            if not n:
                break
            h.update(view[:n])
            left -= n
    return h.digest()


def _digests(folder: Path, files: list[str], sizes: dict[str, int]) -> dict[str, str]:
    """SHA-256 block digest of each file, blocks hashed in parallel threads (hashlib releases the GIL)."""
    jobs = [(rel, off, min(BLOCK_BYTES, sizes[rel] - off)) for rel in files for off in range(0, max(sizes[rel], 1),
                                                                                             BLOCK_BYTES)]
    threads = max(1, min(16, os.cpu_count() or 1, len(jobs)))
    with ThreadPoolExecutor(threads) as pool:
        blocks = list(pool.map(lambda j: _hash_block(folder / j[0], j[1], max(j[2], 0)), jobs))
    combined: dict[str, Any] = {rel: hashlib.sha256() for rel in files}
    for (rel, _, _), digest in zip(jobs, blocks):
        combined[rel].update(digest)
    return {rel: h.hexdigest() for rel, h in combined.items()}


def checksums_enabled() -> bool:
    """Whether checkpoints record digests: yes unless ``POLYRL_CHECKPOINT_CHECKSUMS=0`` (sizes only, for very
    large checkpoints on machines where hashing costs more than it is worth; truncation is still caught)."""
    return os.environ.get("POLYRL_CHECKPOINT_CHECKSUMS", "1").strip().lower() not in ("0", "false", "no", "off")


def write_file_manifest(folder: str | Path, *, checksums: bool | None = None) -> dict[str, Any]:
    """Record the size (and, with ``checksums``, the block SHA-256) of every file under ``folder`` in
    ``folder/checkpoint_files.json``; returns the manifest. ``checksums=None``: :func:`checksums_enabled`.

    Collective when torch.distributed is initialised (call it on every rank): each rank hashes a share of the
    files and rank 0 writes the manifest. A sub-folder that carries its own manifest (an engine's, written by
    :func:`atomic_checkpoint_dir`) is recorded by that manifest's digest instead of being hashed again.
    """
    import torch.distributed as dist

    root = Path(folder)
    checksums = checksums_enabled() if checksums is None else checksums
    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    listing: list[Any] = [None]
    if rank == 0:
        files = _files(root)
        listing[0] = {rel: (root / rel).stat().st_size for rel in files}
    if distributed:
        dist.broadcast_object_list(listing, src=0)
    sizes: dict[str, int] = listing[0]
    # biggest first, dealt round-robin, so the ranks hash about as much each
    mine = sorted(sizes, key=lambda r: (-sizes[r], r))[rank::world]
    digests = _digests(root, mine, sizes) if checksums else {}
    if distributed:
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, digests)
        digests = {k: v for part in gathered for k, v in part.items()}
    manifest = {"format": MANIFEST_FORMAT, "hash": f"sha256-blocks-{BLOCK_BYTES >> 20}MiB" if checksums else None,
                "files": {rel: {"size": sizes[rel], **({"sha256": digests[rel]} if checksums else {})}
                          for rel in sorted(sizes)}}
    if rank == 0:
        atomic_write_text(root / MANIFEST_FILE, json.dumps(manifest, indent=1))
    if distributed:
        dist.barrier()
    return manifest


def verify_files(folder: str | Path) -> bool:
    """Check every file ``folder``'s manifest lists (sizes first, then digests; sub-manifests recursively).

    Returns True when the folder was verified, False when it has no manifest (written before polyrl recorded
    one: nothing to check against). Raises :class:`~polyrl.errors.CheckpointError` naming the first missing,
    truncated or corrupted file. Reads every listed file once, in parallel threads.
    """
    root = Path(folder)
    manifest_path = root / MANIFEST_FILE
    if not manifest_path.is_file():
        return False
    try:
        manifest = json.loads(manifest_path.read_text())
        files: dict[str, dict[str, Any]] = manifest["files"]
        if manifest.get("format") != MANIFEST_FORMAT or not isinstance(files, dict):
            raise ValueError(f"format {manifest.get('format')!r}")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{manifest_path} is damaged ({_first_line(exc)}); the checkpoint cannot be "
                              "verified") from None
    for rel, entry in files.items():
        path = root / rel
        if ".." in Path(rel).parts or Path(rel).is_absolute():
            raise CheckpointError(f"{manifest_path} lists {rel!r}, which is outside the checkpoint")
        if not path.is_file():
            raise CheckpointError(f"{path} is missing (the checkpoint's manifest lists it)")
        size = path.stat().st_size
        if size != entry.get("size"):
            what = "truncated" if size < entry.get("size", 0) else "has grown"
            raise CheckpointError(f"{path} is {size} bytes where {entry.get('size')} were written ({what})")
    hashed = [rel for rel, entry in files.items() if "sha256" in entry]
    if hashed:
        digests = _digests(root, hashed, {rel: files[rel]["size"] for rel in hashed})
        for rel in hashed:
            if digests[rel] != files[rel]["sha256"]:
                raise CheckpointError(f"{root / rel} is corrupted: its content differs from what was written "
                                      "(checksum mismatch)")
    for rel in files:
        if rel.endswith(f"/{MANIFEST_FILE}"):
            verify_files(root / rel[: -len(MANIFEST_FILE) - 1])
    return True


# ---------------------------------------------------------------------- helpers


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    if "WeightsUnpickler error:" in text:  # torch's weights-only refusal: what it refused, not its advice
        rest = [line.strip() for line in text.split("WeightsUnpickler error:", 1)[1].splitlines() if line.strip()]
        if rest:
            return f"not plain data ({rest[0]})"
    return text.splitlines()[0] if text else type(exc).__name__


def _innermost(exc: BaseException) -> BaseException:
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))
        return first[0] if isinstance(first, tuple) else first
    return exc


def _polyrl_error_in(exc: BaseException) -> PolyrlError | None:
    """The polyrl error inside a torch.distributed.checkpoint failure (raised by our planner or reader)."""
    seen: set[int] = set()
    stack: list[Any] = [exc]
    while stack:
        e = stack.pop()
        if not isinstance(e, BaseException) or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, PolyrlError):
            return e
        stack += [e.__cause__, e.__context__]
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            stack += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
    return None
