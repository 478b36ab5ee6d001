"""A reward function and a reward manager, as a user would write them.

``concise_score`` has verl's ``compute_score`` signature. ``ClippedRewardManager``
implements :class:`polyrl.protocols.RewardManager` from scratch (no base class), so
it shows everything a reward manager does: read the batch, decode, score, never
raise for a failing score, and return a :class:`polyrl.protocols.RewardOutput`.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch

from polyrl.batch import non_tensor
from polyrl.protocols import RewardOutput

log = logging.getLogger(__name__)


def concise_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> dict:
    """1.0 for a response that starts with the answer, minus 0.01 per extra character (floor 0); 0.0 otherwise.

    Returns ``{"score": float, "acc": float}``; ``acc`` (1.0 when the answer is right, however long)
    becomes a validation metric.
    """
    text = solution_str.strip()
    truth = str(ground_truth).strip()
    if not truth or not text.startswith(truth):
        return {"score": 0.0, "acc": 0.0}
    return {"score": max(0.0, 1.0 - 0.01 * (len(text) - len(truth))), "acc": 1.0}


class ClippedRewardManager:
    """One ``compute_score`` call per sample, each score clipped to ``[low, high]``.

    Built by polyrl as ``ClippedRewardManager(tokenizer=..., compute_score=..., config=...)``
    where ``config`` is the run's ``reward`` block (:class:`polyrl.rewards.RewardConfig`);
    its ``fallback_score`` is used for samples whose ``compute_score`` raised or returned
    NaN/inf (counted in the ``reward/failures`` metric, a warning is logged once).

    The score goes on the last model-generated token of each response (the last
    ``response_mask == 1`` position); every other position is 0.
    """

    def __init__(self, *, tokenizer: Any, compute_score: Any, config: Any = None,
                 low: float = -1.0, high: float = 1.0) -> None:
        if low > high:
            raise ValueError(f"ClippedRewardManager: low={low} is above high={high}")
        self.tokenizer = tokenizer
        self.compute_score = compute_score
        self.fallback_score = float(getattr(config, "fallback_score", 0.0))
        self.low, self.high = low, high
        self._warned = False

    def __call__(self, batch: Any) -> RewardOutput:
        """Score ``batch`` (``responses``, ``response_mask``; non-tensor ``data_source``,
        ``ground_truth``, ``extra_info``)."""
        responses, mask = batch["responses"], batch["response_mask"].bool()
        # decode every generated position, tool output included, as verl's managers do
        width = responses.shape[1]
        valid = batch["attention_mask"][:, -width:].bool() if "attention_mask" in batch.keys() else mask
        sources = non_tensor(batch, "data_source", "")
        truths = non_tensor(batch, "ground_truth", None)
        infos = non_tensor(batch, "extra_info", None)

        scores = torch.zeros(responses.shape, dtype=torch.float32)
        raw_scores, clipped_scores, accs, failures = [], [], [], 0
        for i in range(responses.shape[0]):
            text = self.tokenizer.decode(responses[i][valid[i]].tolist(), skip_special_tokens=True)
            raw, acc = self._score(sources[i], text, truths[i], infos[i] or {})
            failures += raw is None
            score = self.fallback_score if raw is None else min(max(raw, self.low), self.high)
            positions = mask[i].nonzero()
            if len(positions):
                scores[i, positions[-1]] = score
            raw_scores.append(raw)
            clipped_scores.append(score)
            accs.append(acc)
        clipped = sum(r is not None and r != s for r, s in zip(raw_scores, clipped_scores, strict=True))
        return RewardOutput(
            token_level_scores=scores,
            extra={"score": clipped_scores, "raw_score": raw_scores, "acc": accs},
            metrics={"reward/failures": float(failures), "reward/clipped_fraction": clipped / max(1, len(scores))},
        )

    def _score(self, source: str, text: str, truth: Any, info: dict) -> tuple[float | None, float | None]:
        """``(score, acc)``; ``score`` is None when ``compute_score`` failed."""
        try:
            result = self.compute_score(source, text, truth, info)
            score = float(result["score"]) if isinstance(result, dict) else float(result)
        except Exception:
            self._warn_once("compute_score raised", exc_info=True)
            return None, None
        if not math.isfinite(score):
            self._warn_once(f"compute_score returned {score}")
            return None, None
        acc = result.get("acc") if isinstance(result, dict) else None
        return score, acc

    def _warn_once(self, what: str, exc_info: bool = False) -> None:
        if not self._warned:
            log.warning("%s; using reward.fallback_score=%s for such samples (shown once)", what,
                        self.fallback_score, exc_info=exc_info)
            self._warned = True
