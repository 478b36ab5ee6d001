"""polyrl.checkpoint_io: the safe loader, atomic folders, file manifests and disk-full errors.

Real torch.distributed.checkpoint folders (no process group: DCP's single-process path); payloads are pickles
that would visibly run (they create a marker file) if anything unpickled them without restrictions.
"""

from __future__ import annotations

import errno
import json
import pickle

import pytest
import torch

from polyrl.checkpoint_io import (
    MANIFEST_FILE,
    atomic_checkpoint_dir,
    disk_full_error,
    load_dcp,
    load_tensors,
    read_dcp_metadata,
    verify_files,
    write_file_manifest,
)
from polyrl.errors import CheckpointDiskFullError, CheckpointError


class _Payload:
    """Unpickling this runs ``open(marker, 'w')``: what a planted checkpoint would do."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _dcp_folder(path, **extra):
    import torch.distributed.checkpoint as dcp

    state = {"w": torch.arange(6.0), "b": torch.ones(3), **extra}
    dcp.save(state, checkpoint_id=str(path), no_dist=True)
    return path


def test_load_dcp_round_trip_and_plain_objects(tmp_path):
    _dcp_folder(tmp_path / "ck", step=7, betas=(0.9, 0.99))
    state = {"w": torch.zeros(6), "b": torch.zeros(3), "step": 0, "betas": None}
    load_dcp(state, tmp_path / "ck")
    assert torch.equal(state["w"], torch.arange(6.0)) and state["step"] == 7 and state["betas"] == (0.9, 0.99)


def test_planted_metadata_is_refused_and_runs_nothing(tmp_path):
    folder = _dcp_folder(tmp_path / "ck")
    marker = tmp_path / "pwned"
    (folder / ".metadata").write_bytes(pickle.dumps(_Payload(str(marker))))
    with pytest.raises(CheckpointError, match=r"ck/\.metadata .*not allowed"):
        load_dcp({"w": torch.zeros(6), "b": torch.zeros(3)}, folder)
    with pytest.raises(CheckpointError, match=r"\.metadata"):
        read_dcp_metadata(folder)
    assert not marker.exists()


def test_planted_item_is_refused_and_runs_nothing(tmp_path):
    # a checkpoint someone wrote with an object whose unpickling runs code: torch's DefaultLoadPlanner would
    # call torch.load(weights_only=False) on it
    marker = tmp_path / "pwned"
    folder = _dcp_folder(tmp_path / "ck", meta=_Payload(str(marker)))
    with pytest.raises(CheckpointError, match="item 'meta' is not plain data"):
        load_dcp({"w": torch.zeros(6), "b": torch.zeros(3), "meta": None}, folder)
    assert not marker.exists()


def test_load_tensors_refuses_a_pickle_and_names_the_file(tmp_path):
    marker = tmp_path / "pwned"
    torch.save({"rng": _Payload(str(marker))}, tmp_path / "extra.pt")
    with pytest.raises(CheckpointError, match=r"extra\.pt cannot be loaded .*nothing from it was run"):
        load_tensors(tmp_path / "extra.pt")
    assert not marker.exists()


def _folder_with_files(root):
    root.mkdir()
    (root / "a.bin").write_bytes(bytes(range(256)) * 300)
    (root / "sub").mkdir()
    (root / "sub" / "b.txt").write_text("hello")
    return root


def test_manifest_detects_truncated_corrupted_and_missing_files(tmp_path):
    folder = _folder_with_files(tmp_path / "ck")
    manifest = write_file_manifest(folder)
    assert set(manifest["files"]) == {"a.bin", "sub/b.txt"}
    assert verify_files(folder) is True
    data = (folder / "a.bin").read_bytes()
    (folder / "a.bin").write_bytes(data[:100])
    with pytest.raises(CheckpointError, match=r"a\.bin is 100 bytes where 76800 were written \(truncated\)"):
        verify_files(folder)
    (folder / "a.bin").write_bytes(data[:5000] + bytes([data[5000] ^ 1]) + data[5001:])  # one bit, same size
    with pytest.raises(CheckpointError, match=r"a\.bin is corrupted"):
        verify_files(folder)
    (folder / "a.bin").write_bytes(data)
    (folder / "sub" / "b.txt").unlink()
    with pytest.raises(CheckpointError, match=r"sub/b\.txt is missing"):
        verify_files(folder)


def test_a_sub_folder_with_its_own_manifest_is_verified_through_it(tmp_path):
    folder = _folder_with_files(tmp_path / "ck")
    write_file_manifest(folder / "sub")  # an engine's folder
    manifest = write_file_manifest(folder)
    assert set(manifest["files"]) == {"a.bin", f"sub/{MANIFEST_FILE}"}  # not hashed twice
    assert verify_files(folder)
    (folder / "sub" / "b.txt").write_text("hellO")
    with pytest.raises(CheckpointError, match=r"sub/b\.txt is corrupted"):
        verify_files(folder)


def test_a_folder_without_manifest_is_not_verified(tmp_path):
    assert verify_files(_folder_with_files(tmp_path / "ck")) is False


def test_a_manifest_naming_a_file_outside_is_refused(tmp_path):
    folder = _folder_with_files(tmp_path / "ck")
    (folder / MANIFEST_FILE).write_text(json.dumps({"format": "polyrl-files-1", "files": {"../x": {"size": 1}}}))
    with pytest.raises(CheckpointError, match="outside the checkpoint"):
        verify_files(folder)


def test_atomic_dir_leaves_the_previous_folder_whole_on_disk_full(tmp_path):
    target = tmp_path / "ck"
    with atomic_checkpoint_dir(target) as tmp:
        (tmp / "x").write_text("first")
    assert (target / "x").read_text() == "first" and verify_files(target)
    with pytest.raises(CheckpointDiskFullError, match=r"disk full while saving checkpoint .*ck \(No space left"), \
            atomic_checkpoint_dir(target) as tmp:
        (tmp / "x").write_text("half")
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp / "x"))
    assert (target / "x").read_text() == "first" and verify_files(target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]  # the half-written folder is gone


def test_disk_full_is_found_inside_a_dcp_failure():
    from torch.distributed.checkpoint.api import CheckpointException

    inner = OSError(errno.ENOSPC, "No space left on device")
    wrapped = CheckpointException("save failed", {0: (inner, None)})
    assert isinstance(disk_full_error(wrapped, "/ck"), CheckpointDiskFullError)
    assert disk_full_error(RuntimeError("other"), "/ck") is None
