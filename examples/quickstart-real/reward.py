"""The quickstart's reward: verl's GSM8K scorer in its ``flexible`` mode (the last number of the response).

verl's default for ``openai/gsm8k`` is ``strict`` (the number after ``####``); the quickstart asks for "the number
only", so a right answer has no ``####``: ``flexible`` reads the last number instead (``7 + 8 = 15`` scores).
"""

from __future__ import annotations

from typing import Any

from polyrl.rewards.functions import gsm8k_score


def compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> dict:
    """1.0 when the last number of the response equals the ground truth, else 0.0."""
    return gsm8k_score(data_source, solution_str, ground_truth, extra_info, method="flexible")
