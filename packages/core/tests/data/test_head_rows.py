"""head_rows: the first rows of a data file, read only that far for JSON lines and parquet."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from polyrl.data.dataset import head_rows, load_rows
from polyrl.errors import DataError


def test_head_rows_match_the_full_read(tmp_path):
    rows = [{"prompt": f"q{i}", "data_source": "arithmetic", "reward_model": {"ground_truth": str(i)}} for i in range(50)]
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    parquet = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(rows), parquet, row_group_size=7)
    for path in (jsonl, parquet):
        assert head_rows(path, 16) == load_rows(path)[:16] == rows[:16]
        assert head_rows(path, 100) == rows


def test_head_rows_of_a_broken_file_give_the_loaders_error(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "q"}\n{not json\n')
    assert head_rows(bad, 1) == [{"prompt": "q"}]  # the broken line is never read
    with pytest.raises(DataError, match=r"bad.jsonl line 2"):
        head_rows(bad, 5)
    with pytest.raises(DataError, match="does not exist"):
        head_rows(tmp_path / "none.jsonl", 5)
