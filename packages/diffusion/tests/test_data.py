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
    texts.write_text('polyrl\nhello world\n\nflow grpo\n')
    module.main(["--out", str(tmp_path / "mine"), "--texts", str(texts), "--val", "1", "--format", "jsonl"])
    mine = load_prompt_rows(tmp_path / "mine" / "train.jsonl")
    assert [r["reward_model"]["ground_truth"] for r in mine] == ["polyrl", "hello world"]
    assert all(f'"{r["reward_model"]["ground_truth"]}"' in r["prompt"][0]["content"] for r in mine)
    assert "wrote 2 rows" in capsys.readouterr().out
    # Flow-GRPO's own dataset/ocr/*.txt: whole scene descriptions; the target is the quoted text, the line the prompt
    scenes = tmp_path / "scenes.txt"
    scenes.write_text("\n".join(FLOW_GRPO_OCR) + "\n")
    module.main(["--out", str(tmp_path / "scenes"), "--texts", str(scenes), "--val", "1", "--format", "jsonl"])
    rows = load_prompt_rows(tmp_path / "scenes" / "train.jsonl")
    assert [r["reward_model"]["ground_truth"] for r in rows] == ["Spring Collection 2024", "Step Goal Achieved"]
    assert [r["prompt"][0]["content"] for r in rows] == FLOW_GRPO_OCR[:2]


#: Lines of Flow-GRPO's dataset/ocr/test.txt, dataset/pickscore/train.txt and dataset/geneval/test_metadata.jsonl
#: (yifan123/flow_grpo), as those files hold them.
FLOW_GRPO_OCR = [
    'A high-fashion runway with a sleek, modern backdrop displaying "Spring Collection 2024". Models walk '
    'confidently on the catwalk, showcasing vibrant, floral prints and pastel tones.',
    'A close-up of a sleek smartwatch on a wrist, the screen displaying "Step Goal Achieved" with a celebratory '
    'animation, set against a blurred cityscape at dusk.',
    'A close-up photograph of an engraved silver ring with the inscription "Forever Yours" delicately etched into '
    'its surface.',
]
FLOW_GRPO_PICKSCORE = [
    "a photograph of patterdale dog driving a land rover car toy in the cave lava,terrier",
    "'a couple of soldier that are standing in front of a building, exterior of scifi temple, eternals",
]
FLOW_GRPO_GENEVAL = [
    {"tag": "colors", "include": [{"class": "book", "count": 1, "color": "blue"}], "prompt": "a photo of a blue book"},
    {"tag": "two_object", "include": [{"class": "skis", "count": 1}, {"class": "frisbee", "count": 1}],
     "prompt": "a photo of a skis and a frisbee"},
]


def test_flow_grpo_prompt_files_load_as_they_are(tmp_path):
    import json

    root = tmp_path / "dataset"
    for task, lines in (("ocr", FLOW_GRPO_OCR), ("pickscore", FLOW_GRPO_PICKSCORE)):
        (root / task).mkdir(parents=True)
        (root / task / "train.txt").write_text("\n".join(lines) + "\n\n")  # a trailing blank line is no prompt
    (root / "geneval").mkdir()
    (root / "geneval" / "test_metadata.jsonl").write_text("".join(json.dumps(m) + "\n" for m in FLOW_GRPO_GENEVAL))

    ocr = load_prompt_rows(root / "ocr" / "train.txt")
    assert [r["prompt"] for r in ocr] == FLOW_GRPO_OCR and {r["data_source"] for r in ocr} == {"ocr"}
    assert [r["reward_model"]["ground_truth"] for r in ocr] == ["Spring Collection 2024", "Step Goal Achieved",
                                                                "Forever Yours"]
    assert ocr[1]["extra_info"] == {"split": "train", "index": 1}
    pick = load_prompt_rows(root / "pickscore" / "train.txt")
    assert [r["prompt"] for r in pick] == FLOW_GRPO_PICKSCORE and {r["data_source"] for r in pick} == {"pickscore"}
    geneval = load_prompt_rows(root / "geneval" / "test_metadata.jsonl")
    assert [r["prompt"] for r in geneval] == [m["prompt"] for m in FLOW_GRPO_GENEVAL]
    assert {r["data_source"] for r in geneval} == {"geneval"}
    assert geneval[1]["extra_info"]["include"] == FLOW_GRPO_GENEVAL[1]["include"]
    assert geneval[0]["extra_info"]["tag"] == "colors"
