"""Conformance suites for reward functions and reward managers."""

from __future__ import annotations

import math

import torch

from polyrl.protocols import RewardOutput


class RewardFunctionConformance:
    """Provide ``compute_score`` and ``cases``: a list of
    ``(data_source, solution_str, ground_truth, expected_score)``."""

    def _score(self, result):
        return float(result["score"]) if isinstance(result, dict) else float(result)

    def test_verl_signature_and_cases(self, compute_score, cases):
        for source, text, truth, expected in cases:
            assert self._score(compute_score(source, text, truth, None)) == expected, (source, text, truth)
            assert self._score(compute_score(source, text, truth, extra_info={})) == expected

    def test_returns_finite_float_or_dict_with_score(self, compute_score, cases):
        for source, text, truth, _ in cases:
            result = compute_score(source, text, truth)
            assert isinstance(result, (float, int, dict))
            if isinstance(result, dict):
                assert "score" in result
            assert math.isfinite(self._score(result))

    def test_garbage_input_does_not_crash(self, compute_score, cases):
        source, _, truth, _ = cases[0]
        for text in ("", "\x00", "9" * 5000, "\\boxed{"):
            assert math.isfinite(self._score(compute_score(source, text, truth)))


class RewardManagerConformance:
    """Provide ``reward_manager`` and ``reward_batch`` (a collated batch with ``data_source``,
    ``ground_truth`` and ``extra_info`` non-tensor fields)."""

    #: ``False`` for a manager whose batch has no ``responses`` tokens (the image manager: one score per image,
    #: on its trained steps); the scores then take the shape of ``response_mask``.
    token_model = True

    def test_scores_shape_and_position(self, reward_manager, reward_batch):
        out = reward_manager(reward_batch)
        assert isinstance(out, RewardOutput)
        shaped_like = reward_batch["responses"] if self.token_model else reward_batch["response_mask"]
        assert out.token_level_scores.shape == shaped_like.shape
        mask = reward_batch["response_mask"]
        assert torch.all(out.token_level_scores[mask == 0] == 0)
        assert torch.isfinite(out.token_level_scores).all()

    def test_extra_lists_match_the_batch(self, reward_manager, reward_batch):
        out = reward_manager(reward_batch)
        for key, values in out.extra.items():
            assert len(values) == reward_batch.batch_size[0], key

    def test_metrics_are_floats(self, reward_manager, reward_batch):
        out = reward_manager(reward_batch)
        assert all(isinstance(v, float) for v in out.metrics.values())
