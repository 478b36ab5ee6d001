"""The GSM8K preparation script on a fixture in GSM8K's own format."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from polyrl.data import RLDataset, load_rows
from polyrl.rewards import default_compute_score

ROOT = Path(__file__).resolve().parents[4]
FIXTURE = Path(__file__).parent / "fixtures" / "gsm8k_sample.jsonl"


def test_prepare_and_load(tmp_path, tiny_tokenizer):
    out = tmp_path / "train.parquet"
    subprocess.run([sys.executable, str(ROOT / "examples" / "data_preprocess" / "gsm8k.py"), "--input", str(FIXTURE),
                    "--output", str(out)], check=True, capture_output=True)
    rows = load_rows(out)
    assert [r["reward_model"]["ground_truth"] for r in rows] == ["72", "10", "3600"]
    assert rows[0]["data_source"] == "openai/gsm8k" and "####" in rows[0]["prompt"][0]["content"]
    ds = RLDataset([out], tiny_tokenizer, max_prompt_length=1024)
    assert len(ds) == 3 and ds[0]["prompt_ids"]
    assert default_compute_score(rows[2]["data_source"], "so #### 3,600", rows[2]["reward_model"]["ground_truth"])["acc"] == 1.0
