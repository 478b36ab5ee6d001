"""Row loaders by file type: parquet, jsonl/json, and local HF datasets (``save_to_disk`` folders)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from polyrl.errors import DataError


def load_parquet(path: str | Path, *, config: Any = None) -> list[dict]:
    """Rows of a parquet file."""
    import pyarrow.parquet as pq

    return pq.read_table(str(path)).to_pylist()


def load_jsonl(path: str | Path, *, config: Any = None) -> list[dict]:
    """Rows of a JSON-lines file (or a JSON list)."""
    raw = Path(path).read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise DataError(f"{path} line {line}: byte {raw[exc.start]:#04x} is not UTF-8 ({exc.reason}); save the "
                        "file as UTF-8") from None
    if str(path).endswith(".json") and text.lstrip().startswith("["):
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise DataError(f"{path} line {exc.lineno}: not valid JSON: {exc.msg}") from None
    rows = []
    for i, line in enumerate(text.splitlines()):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise DataError(f"{path} line {i + 1}: not valid JSON: {exc}") from None
    return rows


def load_hf_dataset(path: str | Path, *, config: Any = None) -> list[dict]:
    """Rows of a local HF dataset folder (``datasets.Dataset.save_to_disk``); a DatasetDict's ``train`` split."""
    import datasets

    ds = datasets.load_from_disk(str(path))
    if isinstance(ds, datasets.DatasetDict):
        ds = ds["train"] if "train" in ds else next(iter(ds.values()))
    return ds.to_list()
