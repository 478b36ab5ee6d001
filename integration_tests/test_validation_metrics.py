"""What ``val/<data source>/mean@1`` averages (issue 47): as verl's ``val-core`` metric, the reward function's
``acc`` when it returns one, else the score itself (verl's ``reward``); reward extras a sample did not return are
left out of its validation row, not shown as 0.0."""

from __future__ import annotations

import json

import numpy as np
import pytest

from polyrl.trainer.commands import train
from polyrl.trainer.generations import read_jsonl


@pytest.mark.timeout(300)
def test_mean_at_1_is_the_mean_score_without_acc_and_missing_extras_stay_missing(base_overrides, manifest_file,
                                                                                 tmp_path):
    reward = tmp_path / "graded.py"
    reward.write_text(  # a graded score (no acc); a numeric pred only for some samples
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    score = 0.25 * (sum(map(ord, solution_str)) % 4) - 0.5\n"
        "    return {'score': score, 'pred': 7} if len(solution_str) % 2 else {'score': score}\n")
    overrides = [o for o in base_overrides if not o.startswith(("reward.function", "trainer.total_steps"))]
    train(manifest_file, [], overrides + [f"reward.function={reward}:compute_score", "trainer.executor=local",
                                          "trainer.total_steps=1", "data.val_max_samples=8"])
    run = tmp_path / "run"
    rows = read_jsonl(run / "generations" / "validation" / "0.jsonl")
    scores = [r["score"] for r in rows]
    assert len(rows) == 8 and len(set(scores)) > 1, scores
    metrics = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert metrics["val/arithmetic/mean@1"] == pytest.approx(np.mean(scores))  # not the share of scores > 0
    preds = [(r.get("reward_extra") or {}).get("pred", "missing") for r in rows]
    assert set(preds) == {7, "missing"}, preds  # before: the samples without a pred showed "pred: 0.0"
