"""Datasets: formats, validation errors naming file and row, truncation, resumable order."""

from __future__ import annotations

import json

import pytest

from polyrl.data import RLDataLoader, RLDataset, load_rows
from polyrl.data.synthetic import make_arithmetic_rows, write_jsonl
from polyrl.errors import DataError


def test_jsonl_parquet_and_hf_disk_give_the_same_rows(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = make_arithmetic_rows(5, seed=1)
    write_jsonl(rows, tmp_path / "a.jsonl")
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "a.parquet")
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "hf"))
    a, b, c = load_rows(tmp_path / "a.jsonl"), load_rows(tmp_path / "a.parquet"), load_rows(tmp_path / "hf")
    assert [r["prompt"] for r in a] == [r["prompt"] for r in b] == [r["prompt"] for r in c]


def test_malformed_rows_name_file_row_and_key(tmp_path, tiny_tokenizer):
    f = tmp_path / "bad.jsonl"
    f.write_text(json.dumps(make_arithmetic_rows(1)[0]) + "\n" + json.dumps({"data_source": "x"}) + "\n")
    with pytest.raises(DataError, match=r"bad.jsonl row 1: missing key 'prompt'"):
        RLDataset([f], tiny_tokenizer, max_prompt_length=64)
    f.write_text(json.dumps({"prompt": [{"content": "hi"}]}) + "\n")
    with pytest.raises(DataError, match=r"row 0: prompt\[0\] must be a mapping with 'role' and 'content'"):
        RLDataset([f], tiny_tokenizer, max_prompt_length=64)
    f.write_text("{not json\n")
    with pytest.raises(DataError, match="line 1: not valid JSON"):
        RLDataset([f], tiny_tokenizer, max_prompt_length=64)
    with pytest.raises(DataError, match="does not exist"):
        RLDataset([tmp_path / "none.jsonl"], tiny_tokenizer, max_prompt_length=64)


def test_over_long_prompts(tmp_path, tiny_tokenizer):
    rows = make_arithmetic_rows(4, seed=0)
    rows[1]["prompt"][0]["content"] = "9" * 100
    f = write_jsonl(rows, tmp_path / "d.jsonl")
    with pytest.raises(DataError, match="row 1: prompt is .* tokens, over data.max_prompt_length=32"):
        RLDataset([f], tiny_tokenizer, max_prompt_length=32, truncation="error")
    ds = RLDataset([f], tiny_tokenizer, max_prompt_length=32, truncation="filter")
    assert len(ds) == 3 and ds.stats["filtered"] == 1
    ds = RLDataset([f], tiny_tokenizer, max_prompt_length=32, truncation="left")
    assert len(ds) == 4 and ds.stats["truncated"] == 1 and len(ds[1]["prompt_ids"]) == 32


def test_loader_resumes_at_the_same_position(tmp_path, tiny_tokenizer):
    f = write_jsonl(make_arithmetic_rows(20, seed=0), tmp_path / "d.jsonl")
    ds = RLDataset([f], tiny_tokenizer, max_prompt_length=64)
    loader = RLDataLoader(ds, batch_size=3, shuffle=True, seed=5)
    it = iter(loader)
    seen = [next(it) for _ in range(4)]
    state = loader.state_dict()
    rest = [r["prompt"] for batch in it for r in batch]
    again = RLDataLoader(ds, batch_size=3, shuffle=True, seed=5)
    again.load_state_dict(state)
    assert [r["prompt"] for batch in again for r in batch] == rest
    assert len({r["uid"] for b in seen for r in b}) == 12
    # a new epoch has a new order
    assert [r["prompt"] for r in next(iter(loader))] != [r["prompt"] for r in seen[0]]


def test_non_utf8_byte_names_file_and_line(tmp_path):
    from polyrl.data import load_rows
    from polyrl.errors import DataError

    bad = tmp_path / "latin1.jsonl"
    bad.write_bytes(b'{"prompt": "a"}\n{"prompt": "caf\xe9"}\n')
    with pytest.raises(DataError, match=r"latin1.jsonl line 2: byte 0xe9 is not UTF-8"):
        load_rows(bad)


def test_corrupt_parquet_names_the_file(tmp_path):
    bad = tmp_path / "broken.parquet"
    bad.write_bytes(b"PAR1 this is not parquet")
    with pytest.raises(DataError, match=r"data file .*broken.parquet cannot be read"):
        load_rows(bad)


class _Recording:
    """The real tokenizer, noting the longest prompt content it was asked to tokenize."""

    def __init__(self, tokenizer) -> None:
        self._tok = tokenizer
        self.longest = 0

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def apply_chat_template(self, messages, **kw):
        self.longest = max(self.longest, sum(len(m["content"]) for m in messages))
        return self._tok.apply_chat_template(messages, **kw)


def test_a_huge_prompt_is_never_tokenized_whole(tmp_path, tiny_tokenizer):
    from polyrl.data.dataset import char_clip

    rows = make_arithmetic_rows(3, seed=0)
    rows[1]["prompt"][0]["content"] = "1 + 2 = ? " * 200_000  # a 2 MB line
    f = write_jsonl(rows, tmp_path / "d.jsonl")
    clip = char_clip(tiny_tokenizer, 32)
    for truncation in ("filter", "left", "right"):
        tok = _Recording(tiny_tokenizer)
        ds = RLDataset([f], tok, max_prompt_length=32, truncation=truncation)
        assert tok.longest <= clip < 100_000, (truncation, tok.longest)
        if truncation == "filter":
            assert len(ds) == 2 and ds.stats["filtered"] == 1
        else:
            assert len(ds) == 3 and ds.stats["truncated"] == 1 and len(ds[1]["prompt_ids"]) == 32
    tok = _Recording(tiny_tokenizer)
    with pytest.raises(DataError, match=r"d.jsonl row 1: prompt is at least \d+ tokens .*over data.max_prompt_length=32"):
        RLDataset([f], tok, max_prompt_length=32, truncation="error")
    assert tok.longest <= clip


def test_clipped_truncation_keeps_the_tokens_a_whole_tokenization_keeps(tmp_path, tiny_tokenizer):
    from polyrl.data.dataset import _prompt_ids, char_clip

    text = " ".join(f"{i} + {i % 7} = ?" for i in range(3000))  # over the clip, small enough to tokenize whole
    assert len(text) > char_clip(tiny_tokenizer, 32)
    rows = [{"prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": text}]}]
    f = write_jsonl(rows, tmp_path / "d.jsonl")
    whole = _prompt_ids(rows[0]["prompt"], tiny_tokenizer, True)
    assert RLDataset([f], tiny_tokenizer, max_prompt_length=32, truncation="left")[0]["prompt_ids"] == whole[-32:]
    assert RLDataset([f], tiny_tokenizer, max_prompt_length=32, truncation="right")[0]["prompt_ids"] == whole[:32]
