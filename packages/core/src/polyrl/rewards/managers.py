"""Reward managers: decode finished samples, call the reward function, put the score on the last token.

A reward function that raises or returns NaN/inf gives the sample ``fallback_score``;
``reward/failures`` counts such samples, and the first traceback is logged once.
"""

from __future__ import annotations

import logging
import math
import traceback
from typing import Any

import torch
from tensordict import TensorDict

from polyrl.batch import non_tensor
from polyrl.protocols import RewardOutput
from polyrl.rewards.config import RewardConfig

log = logging.getLogger("polyrl.rewards")


class NaiveRewardManager:
    """One ``compute_score`` call per sample (verl's ``naive``)."""

    def __init__(self, *, tokenizer: Any, compute_score: Any, config: RewardConfig | None = None) -> None:
        self.tokenizer = tokenizer
        self.compute_score = compute_score
        self.config = config or RewardConfig()
        self._warned = False

    def _decode(self, batch: TensorDict) -> tuple[list[str], torch.Tensor]:
        """Response texts and the length of each valid response (its last valid token is at ``length - 1``).

        Valid = non-padding (the response part of ``attention_mask``; ``response_mask`` without it), so
        tool tokens between model turns are decoded too.
        """
        responses, mask = batch["responses"], batch["response_mask"]
        valid = batch["attention_mask"][:, -responses.shape[1]:] if "attention_mask" in batch.keys() else mask
        valid = valid.long()
        # position of the last valid token + 1 (0 for an empty response)
        lengths = torch.where(valid.any(-1), valid.cumsum(-1).argmax(-1) + 1, torch.zeros_like(valid[:, 0]))
        texts = [
            self.tokenizer.decode(responses[i, : int(lengths[i])].tolist(), skip_special_tokens=True)
            for i in range(responses.shape[0])
        ]
        return texts, lengths

    def _safe(self, fn, *args) -> tuple[float, dict, bool]:
        try:
            result = fn(*args)
        except Exception:
            if not self._warned:
                log.warning("reward function raised; using reward.fallback_score=%s for such samples (shown once):\n%s",
                            self.config.fallback_score, traceback.format_exc())
                self._warned = True
            return self.config.fallback_score, {}, True
        extra = dict(result) if isinstance(result, dict) else {}
        score = float(extra.pop("score", 0.0)) if isinstance(result, dict) else float(result)
        if not math.isfinite(score):
            if not self._warned:
                log.warning("reward function returned %s; using reward.fallback_score=%s (shown once)", score,
                            self.config.fallback_score)
                self._warned = True
            return self.config.fallback_score, extra, True
        return score, extra, False

    def _scores(self, batch: TensorDict, texts: list[str]) -> tuple[list[float], dict[str, list], int]:
        sources = non_tensor(batch, "data_source", "")
        truths = non_tensor(batch, "ground_truth", None)
        infos = non_tensor(batch, "extra_info", None)
        scores, extras, failures = [], [], 0
        for i, text in enumerate(texts):
            score, extra, failed = self._safe(self.compute_score, sources[i], text, truths[i], infos[i] or {})
            scores.append(score)
            extras.append(extra)
            failures += failed
        return scores, _columns(extras, len(texts)), failures

    def __call__(self, batch: TensorDict) -> RewardOutput:
        texts, lengths = self._decode(batch)
        scores, extra, failures = self._scores(batch, texts)
        scores_t = torch.tensor(scores, dtype=torch.float32)
        token_scores = torch.zeros(batch["responses"].shape, dtype=torch.float32)
        rows = torch.arange(len(scores))
        last = (lengths - 1).clamp(min=0)
        token_scores[rows, last] = torch.where(lengths > 0, scores_t, torch.zeros_like(scores_t))
        extra["score"] = scores
        return RewardOutput(token_scores, extra, {"reward/failures": float(failures)})


class BatchRewardManager(NaiveRewardManager):
    """One call for the whole batch: ``compute_score(data_sources, solution_strs, ground_truths, extra_infos)``
    returning a list of floats or dicts (for batched or remote scoring)."""

    def _scores(self, batch: TensorDict, texts: list[str]) -> tuple[list[float], dict[str, list], int]:
        args = (non_tensor(batch, "data_source", ""), texts, non_tensor(batch, "ground_truth", None),
                non_tensor(batch, "extra_info", None))
        try:
            results = list(self.compute_score(*args))
        except Exception:
            if not self._warned:
                log.warning("batch reward function raised; every sample gets the fallback (shown once):\n%s",
                            traceback.format_exc())
                self._warned = True
            return [self.config.fallback_score] * len(texts), {}, len(texts)
        scores, extras, failures = [], [], 0
        for r in results:
            score, extra, failed = self._safe(lambda x: x, r)
            scores.append(score)
            extras.append(extra)
            failures += failed
        return scores, _columns(extras, len(texts)), failures


class DAPORewardManager(NaiveRewardManager):
    """``naive`` plus DAPO's overlong penalty: responses within ``overlong_buffer_len`` tokens of the
    budget lose up to ``overlong_penalty_factor``, linearly."""

    def __call__(self, batch: TensorDict) -> RewardOutput:
        out = super().__call__(batch)
        cfg = self.config
        if not cfg.overlong_buffer_enable:
            return out
        budget = cfg.max_response_length or batch["responses"].shape[1]
        expected = budget - cfg.overlong_buffer_len
        _, valid_lengths = self._decode(batch)
        lengths = valid_lengths.float()
        penalty = (-(lengths - expected) / cfg.overlong_buffer_len * cfg.overlong_penalty_factor).clamp(max=0)
        last = (valid_lengths - 1).clamp(min=0)
        out.token_level_scores[torch.arange(len(last)), last] += penalty
        out.extra["overlong_penalty"] = penalty.tolist()
        out.metrics["reward/overlong_penalty_mean"] = float(penalty.mean())
        return out


def _columns(extras: list[dict], n: int) -> dict[str, list]:
    keys = {k for e in extras for k in e}
    return {k: [e.get(k) for e in extras] for k in keys}
