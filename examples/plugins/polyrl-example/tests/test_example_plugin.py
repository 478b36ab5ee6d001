"""The example plugin, tested the way a plugin author would: polyrl.testing and its conformance suites."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import polyrl_example.hooks
from polyrl.agent_loops import collate
from polyrl.batch import set_non_tensor
from polyrl.protocols import AgentLoopOutput
from polyrl.testing import (
    AdvantageEstimatorConformance,
    RewardFunctionConformance,
    RewardManagerConformance,
)
from polyrl_example.estimators import sign_advantage
from polyrl_example.rewards import ClippedRewardManager, concise_score

pytest_plugins = ["polyrl.testing"]


class TestSignAdvantage(AdvantageEstimatorConformance):
    @pytest.fixture
    def estimator(self):
        return sign_advantage


class TestConciseScore(RewardFunctionConformance):
    @pytest.fixture
    def compute_score(self):
        return concise_score

    @pytest.fixture
    def cases(self):
        return [("example/concise", "42", "42", 1.0), ("example/concise", "42 because", "42", 0.92),
                ("example/concise", "41", "42", 0.0)]


@pytest.fixture
def reward_batch(tiny_tokenizer):
    texts = ["42", "41", "42 and so on"]
    outs = [AgentLoopOutput([1, 2], tiny_tokenizer(t, add_special_tokens=False)["input_ids"],
                            [1] * len(tiny_tokenizer(t, add_special_tokens=False)["input_ids"])) for t in texts]
    batch = collate(outs, pad_token_id=tiny_tokenizer.pad_token_id, max_prompt_length=4, max_response_length=16)
    set_non_tensor(batch, "data_source", ["example/concise"] * 3)
    set_non_tensor(batch, "ground_truth", ["42"] * 3)
    set_non_tensor(batch, "extra_info", [{}] * 3)
    return batch


class TestClippedManager(RewardManagerConformance):
    @pytest.fixture
    def reward_manager(self, tiny_tokenizer):
        return ClippedRewardManager(tokenizer=tiny_tokenizer, compute_score=lambda *a: 5.0 * concise_score(*a)["score"])


def test_sign_values():
    r = torch.zeros(4, 2)
    r[:, -1] = torch.tensor([1.0, 0.0, 0.5, 0.5])
    adv, _ = sign_advantage(r, torch.ones(4, 2), index=np.array(["a", "a", "b", "b"]))
    assert adv[:, 0].tolist() == [1.0, -1.0, 0.0, 0.0]


def test_registered_names_resolve_through_polyrl(polyrl_plugins):
    polyrl_plugins.register(polyrl_example.hooks, name="example")
    from polyrl.algorithms import get_adv_estimator_fn
    from polyrl.rewards import default_compute_score

    assert get_adv_estimator_fn("sign") is sign_advantage
    assert polyrl_plugins.get("reward_manager", "clipped") is ClippedRewardManager
    assert default_compute_score("example/concise", "42", "42")["score"] == 1.0


def test_clipping(reward_batch, tiny_tokenizer):
    out = ClippedRewardManager(tokenizer=tiny_tokenizer, compute_score=lambda *a: 5.0)(reward_batch)
    assert out.token_level_scores.max() == 1.0
