"""Prompt rows in verl's format with negative prompts, read back through the core's dataset loaders, and the
OCR preprocessing example."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from polyrl_diffusion.data import check_prompt_row, load_prompt_rows, ocr_rows, prompt_rows, write_rows
from polyrl_diffusion.rewards import quoted_text

from polyrl.errors import DataError

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "diffusion" / "ocr_prompts.py"


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl"])
def test_rows_round_trip_through_core_loaders(tmp_path, suffix):
    rows = prompt_rows(["a red cube", "a cat"], data_source="colourfulness", negative_prompt="blurry")
    rows[1]["negative_prompt"] = "dark"
    back = load_prompt_rows(write_rows(rows, tmp_path / f"p{suffix}"))
    assert [r["prompt"][0]["content"] for r in back] == ["a red cube", "a cat"]
    assert [r["negative_prompt"] for r in back] == ["blurry", "dark"]
    assert back[0]["data_source"] == "colourfulness" and back[1]["extra_info"]["index"] == 1


def test_ocr_rows_are_seeded_and_consistent():
    rows = ocr_rows(20, seed=3)
    assert rows == ocr_rows(20, seed=3) and rows != ocr_rows(20, seed=4)
    for row in rows:
        text = row["reward_model"]["ground_truth"]
        assert quoted_text(row["prompt"][0]["content"]) == text, "the ocr reward reads the target from the quotes"
        assert 1 <= len(text.split()) <= 2 and row["data_source"] == "ocr"


def test_bad_rows_name_file_row_and_key(tmp_path):
    with pytest.raises(DataError, match="f.jsonl row 0: 'negative_prompt'"):
        check_prompt_row({"prompt": "x", "negative_prompt": ["a"]}, "f.jsonl", 0)
    with pytest.raises(DataError, match="row 2: missing key 'prompt'"):
        check_prompt_row({"text": "x"}, "f.jsonl", 2)
    with pytest.raises(DataError, match="empty"):
        check_prompt_row({"prompt": [{"role": "user", "content": "  "}]}, "f.jsonl", 0)
    with pytest.raises(DataError, match="3 ground truths"):
        prompt_rows(["a", "b"], data_source="ocr", ground_truths=["1", "2", "3"])


def test_ocr_preprocessing_example(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("ocr_prompts_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(["--out", str(tmp_path / "gen"), "--train", "8", "--val", "2"])
    train = load_prompt_rows(tmp_path / "gen" / "train.parquet")
    assert len(train) == 8 and len(load_prompt_rows(tmp_path / "gen" / "val.parquet")) == 2
    texts = tmp_path / "texts.txt"
    texts.write_text('hello "world"\npolyrl\n\nflow grpo\n')
    module.main(["--out", str(tmp_path / "mine"), "--texts", str(texts), "--val", "1", "--format", "jsonl"])
    mine = load_prompt_rows(tmp_path / "mine" / "train.jsonl")
    assert [r["reward_model"]["ground_truth"] for r in mine] == ["hello world", "polyrl"]
    assert "wrote 2 rows" in capsys.readouterr().out
