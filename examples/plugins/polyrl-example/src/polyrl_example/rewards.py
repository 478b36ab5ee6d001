"""A reward function and a reward manager, as a user would write them."""

from __future__ import annotations

from typing import Any

from polyrl.rewards import NaiveRewardManager


def concise_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> dict:
    """1.0 for the exact answer, minus 0.01 per character beyond the answer; 0.0 when wrong."""
    text = solution_str.strip()
    truth = str(ground_truth).strip()
    if not text.startswith(truth):
        return {"score": 0.0, "acc": 0.0}
    return {"score": max(0.0, 1.0 - 0.01 * (len(text) - len(truth))), "acc": 1.0}


class ClippedRewardManager(NaiveRewardManager):
    """The built-in ``naive`` manager with every score clipped to ``[-1, 1]``."""

    def __call__(self, batch):
        out = super().__call__(batch)
        out.token_level_scores.clamp_(-1.0, 1.0)
        out.extra["score"] = [max(-1.0, min(1.0, s)) for s in out.extra["score"]]
        return out
