"""The ``image`` reward manager passes the core's reward-manager conformance suite (its non-token mode: one
score per image on its last trained step, scores shaped like ``response_mask``)."""

from __future__ import annotations

import pytest
import torch
from polyrl_diffusion.rewards import ImageRewardManager
from tensordict import TensorDict

from polyrl.batch import set_non_tensor
from polyrl.rewards.config import RewardConfig
from polyrl.testing import RewardManagerConformance


def _batch() -> TensorDict:
    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (4, 3, 8, 8), generator=g, dtype=torch.uint8)
    images[1] = 255  # a white image: brightness 1
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [0, 1, 1], [1, 0, 0]])  # the last trained step differs per row
    batch = TensorDict({"images": images, "response_mask": mask}, batch_size=[4])
    set_non_tensor(batch, "prompt", ["a red house", "a white wall", "a dark sky", "a cat"])
    set_non_tensor(batch, "data_source", ["brightness", "brightness", "colourfulness", "colourfulness"])
    set_non_tensor(batch, "ground_truth", [None] * 4)
    set_non_tensor(batch, "extra_info", [{}] * 4)
    return batch


class TestImageRewardManagerByName(RewardManagerConformance):
    token_model = False

    @pytest.fixture
    def reward_manager(self):
        return ImageRewardManager(config=RewardConfig(function="brightness=1.0,colourfulness=0.5"))

    @pytest.fixture
    def reward_batch(self):
        return _batch()


class TestImageRewardManagerByDataSource(RewardManagerConformance):
    token_model = False

    @pytest.fixture
    def reward_manager(self):
        from polyrl.rewards import default_compute_score

        return ImageRewardManager(compute_score=default_compute_score, config=RewardConfig())

    @pytest.fixture
    def reward_batch(self):
        return _batch()


def test_each_score_sits_on_the_last_trained_step():
    batch = _batch()
    out = ImageRewardManager(compute_score="brightness", config=RewardConfig())(batch)
    scores = out.token_level_scores
    assert scores[1, 1] == pytest.approx(1.0) and scores[1].sum() == scores[1, 1]  # white image, last step 1
    assert [int(row.nonzero().max()) for row in scores] == [2, 1, 2, 0]
