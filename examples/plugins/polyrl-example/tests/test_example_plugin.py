"""The example plugin, tested the way a plugin author would: polyrl.testing and its conformance suites.

``tests/conftest.py`` enables the test kit with ``pytest_plugins = ["polyrl.testing"]``.
"""

from __future__ import annotations

import importlib.metadata
import logging

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

# ---------------------------------------------------------------------- the conformance suites


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


def make_batch(tokenizer, texts, masks=None):
    """A collated batch as the trainer hands it to a reward manager."""
    outs = []
    for i, text in enumerate(texts):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        outs.append(AgentLoopOutput([1, 2], ids, masks[i] if masks else [1] * len(ids)))
    batch = collate(outs, pad_token_id=tokenizer.pad_token_id, max_prompt_length=4, max_response_length=16)
    set_non_tensor(batch, "data_source", ["example/concise"] * len(texts))
    set_non_tensor(batch, "ground_truth", ["42"] * len(texts))
    set_non_tensor(batch, "extra_info", [{}] * len(texts))
    return batch


class TestClippedManager(RewardManagerConformance):
    @pytest.fixture
    def reward_manager(self, tiny_tokenizer):
        return ClippedRewardManager(tokenizer=tiny_tokenizer, compute_score=lambda *a: 5.0 * concise_score(*a)["score"])

    @pytest.fixture
    def reward_batch(self, tiny_tokenizer):
        return make_batch(tiny_tokenizer, ["42", "41", "42 and so on", ""])


# ---------------------------------------------------------------------- behaviour of our own


def test_sign_values_per_group():
    r = torch.zeros(4, 2)
    r[:, -1] = torch.tensor([1.0, 0.0, 0.5, 0.5])
    adv, ret = sign_advantage(r, torch.ones(4, 2), index=np.array(["a", "a", "b", "b"]))
    assert adv[:, 0].tolist() == [1.0, -1.0, 0.0, 0.0] and torch.equal(adv, ret)
    alone, _ = sign_advantage(r, torch.ones(4, 2))  # no index: one group, mean 0.5
    assert alone[:, 1].tolist() == [1.0, -1.0, 0.0, 0.0]


def test_sign_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match=r"differ in shape"):
        sign_advantage(torch.zeros(2, 3), torch.ones(2, 4))


def test_concise_score_prefers_short_correct_answers():
    assert concise_score("s", "42", "42") == {"score": 1.0, "acc": 1.0}
    assert concise_score("s", "42" + "!" * 200, "42") == {"score": 0.0, "acc": 1.0}
    assert concise_score("s", "4", "42")["acc"] == 0.0
    assert concise_score("s", "anything", "")["score"] == 0.0  # empty ground truth never matches


def test_manager_places_clips_and_reports(tiny_tokenizer):
    batch = make_batch(tiny_tokenizer, ["42", "42 ok", "7"])
    out = ClippedRewardManager(tokenizer=tiny_tokenizer, compute_score=lambda s, t, g, e: 3.0 if t == "42" else -0.5,
                               low=-1.0, high=1.0)(batch)
    lengths = batch["response_mask"].sum(-1).tolist()
    assert lengths == [2, 5, 1]
    expected = torch.zeros(3, 16)
    for row, (n, score) in enumerate(zip(lengths, [1.0, -0.5, -0.5], strict=True)):
        expected[row, n - 1] = score
    assert torch.equal(out.token_level_scores, expected)
    assert out.extra["raw_score"] == [3.0, -0.5, -0.5] and out.extra["score"] == [1.0, -0.5, -0.5]
    assert out.metrics == {"reward/failures": 0.0, "reward/clipped_fraction": pytest.approx(1 / 3)}


def test_manager_scores_on_the_last_model_token(tiny_tokenizer):
    # the response ends with 2 tool tokens (mask 0): the score sits on the last model token
    batch = make_batch(tiny_tokenizer, ["42xy"], masks=[[1, 1, 0, 0]])
    seen = []
    out = ClippedRewardManager(tokenizer=tiny_tokenizer, compute_score=lambda s, t, g, e: seen.append(t) or 0.5)(batch)
    assert seen == ["42xy"]  # the decoded text includes tool output
    assert out.token_level_scores[0].tolist()[:4] == [0.0, 0.5, 0.0, 0.0]


def test_failing_reward_function_uses_the_fallback(tiny_tokenizer, caplog):
    from polyrl.rewards import RewardConfig

    def flaky(source, text, truth, info):
        if text == "41":
            raise ZeroDivisionError("bad grader")
        return float("nan") if text == "4" else 1.0

    manager = ClippedRewardManager(tokenizer=tiny_tokenizer, compute_score=flaky, config=RewardConfig(fallback_score=-1.0))
    with caplog.at_level(logging.WARNING):
        out = manager(make_batch(tiny_tokenizer, ["42", "41", "4"]))
    assert out.extra["score"] == [1.0, -1.0, -1.0] and out.extra["raw_score"] == [1.0, None, None]
    assert out.metrics["reward/failures"] == 2.0
    assert len([r for r in caplog.records if "fallback_score=-1.0" in r.getMessage()]) == 1  # warned once


def test_bad_bounds_are_an_error(tiny_tokenizer):
    with pytest.raises(ValueError, match="low=1.0 is above high=0.0"):
        ClippedRewardManager(tokenizer=tiny_tokenizer, compute_score=concise_score, low=1.0, high=0.0)


# ---------------------------------------------------------------------- found through polyrl


def test_registered_names_resolve_through_polyrl(polyrl_plugins):
    polyrl_plugins.register(polyrl_example.hooks, name="example")
    from polyrl.algorithms import get_adv_estimator_fn
    from polyrl.rewards import default_compute_score

    assert get_adv_estimator_fn("sign") is sign_advantage
    assert polyrl_plugins.get("reward_manager", "clipped") is ClippedRewardManager
    assert polyrl_plugins.get("reward_function", "concise") is concise_score
    assert default_compute_score("example/concise", "42", "42")["score"] == 1.0  # default for its data source


def test_installed_entry_point_loads_through_a_manifest(tmp_path):
    try:
        version = importlib.metadata.version("polyrl-example")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("polyrl-example is not installed: pip install -e examples/plugins/polyrl-example")
    from polyrl.manifest import Manifest
    from polyrl.plugins import PluginManager

    manifest = tmp_path / "polyrl.toml"
    manifest.write_text('[plugins]\nrequire = ["polyrl-example>=0.1,<0.2"]\n')
    pm = PluginManager(Manifest.load(manifest))
    assert pm.plugins["example"].distribution == "polyrl-example" and pm.plugins["example"].version == version
    assert pm.entry("advantage_estimator", "sign").plugin.name == "example"
    assert pm.get("reward_manager", "clipped") is ClippedRewardManager
