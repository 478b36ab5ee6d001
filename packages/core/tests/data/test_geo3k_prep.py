"""The Geometry3K preparation script on a fixture in the dataset's own format (parquet: ``images`` as
``{"bytes", "path"}`` structs, ``problem`` with ``<image>``, ``answer``), written here: this machine cannot
download the dataset."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image, ImageDraw

from polyrl.data import RLDataset, load_rows
from polyrl.data.multimodal import load_processor
from polyrl.rewards import default_compute_score

ROOT = Path(__file__).resolve().parents[4]


def _figure(label: str) -> bytes:
    img = Image.new("RGB", (120, 90), "white")
    ImageDraw.Draw(img).polygon([(10, 80), (110, 80), (60, 10)], outline="black")
    ImageDraw.Draw(img).text((55, 60), label, fill="black")
    out = io.BytesIO()
    img.save(out, format="PNG")
    return out.getvalue()


@pytest.fixture
def geo3k_fixture(tmp_path) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [
        {"images": [{"bytes": _figure("x"), "path": "0.png"}], "problem": "<image>Find x.", "answer": "3"},
        {"images": [{"bytes": _figure("y"), "path": "1.png"}], "problem": "<image>Find y. Round to the nearest tenth.",
         "answer": "7.2"},
        {"images": [{"bytes": _figure("A"), "path": None}], "problem": "Find m \\angle A.", "answer": "60"},
    ]
    path = tmp_path / "geometry3k_train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def test_prepare_load_and_score(geo3k_fixture, tmp_path, tiny_vlm_dir):
    out = tmp_path / "train.parquet"
    subprocess.run([sys.executable, str(ROOT / "examples" / "data_preprocess" / "geo3k.py"), "--input",
                    str(geo3k_fixture), "--output", str(out)], check=True, capture_output=True)
    rows = load_rows(out)
    assert [r["reward_model"]["ground_truth"] for r in rows] == ["3", "7.2", "60"]
    assert rows[0]["data_source"] == "hiyouga/geometry3k" and rows[0]["images"][0]["bytes"].startswith(b"\x89PNG")
    assert rows[2]["prompt"][0]["content"].startswith("<image>Find m")  # a placeholder added where none was
    assert all("\\boxed{}" in r["prompt"][0]["content"] for r in rows)
    processor = load_processor(str(tiny_vlm_dir))
    ds = RLDataset([out], processor.tokenizer, max_prompt_length=512, processor=processor)
    assert len(ds) == 3 and ds.stats["images"] == 3 and ds.stats["images_downscaled"] == 0
    image_token = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert ds[0]["prompt_ids"].count(image_token) == 12  # 120x90 -> 112x84: 4x3 merged patches
    good = default_compute_score(rows[1]["data_source"], "<think>similar triangles</think> so \\boxed{7.2}", "7.2")
    assert good["score"] == pytest.approx(1.0) and good["acc"] == 1.0
    assert default_compute_score("hiyouga/geometry3k", "\\boxed{7.2}", "7.2")["score"] == pytest.approx(0.9)
    assert default_compute_score("hiyouga/geometry3k", "<think>hm</think> \\boxed{7}", "7.2")["score"] == pytest.approx(0.1)


def test_mismatched_rows_are_refused(tmp_path):
    import json

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"images": ["a.png"], "problem": "<image><image>Find x.", "answer": "1"}) + "\n")
    run = subprocess.run([sys.executable, str(ROOT / "examples" / "data_preprocess" / "geo3k.py"), "--input", str(bad),
                          "--output", str(tmp_path / "o.parquet")], capture_output=True, text=True)
    assert run.returncode != 0 and "row 0: the problem has 2 <image> placeholders for 1 images" in run.stderr
