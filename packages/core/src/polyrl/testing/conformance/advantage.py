"""Conformance suite for advantage estimators.

Provide an ``estimator`` fixture (the function) and, if it needs them,
``estimator_kwargs`` (e.g. ``{"values": ...}``; defaults to none).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch


class AdvantageEstimatorConformance:
    """What every estimator promises (verl's signature)."""

    @pytest.fixture
    def estimator_kwargs(self):
        return {}

    def _inputs(self, b=8, t=5, seed=0):
        g = torch.Generator().manual_seed(seed)
        rewards = torch.zeros(b, t)
        rewards[:, -1] = torch.randint(0, 2, (b,), generator=g).float()
        mask = torch.ones(b, t)
        mask[::3, 3:] = 0
        rewards = rewards * mask
        index = np.array([i // 4 for i in range(b)])
        return rewards, mask, index

    def _call(self, estimator, estimator_kwargs, rewards, mask, index):
        kwargs = {k: (v(rewards.shape) if callable(v) else v) for k, v in estimator_kwargs.items()}
        return estimator(token_level_rewards=rewards, response_mask=mask, index=index, config=None, **kwargs)

    def test_shapes_and_masking(self, estimator, estimator_kwargs):
        rewards, mask, index = self._inputs()
        adv, ret = self._call(estimator, estimator_kwargs, rewards, mask, index)
        assert adv.shape == rewards.shape and ret.shape == rewards.shape
        assert torch.all(adv[mask == 0] == 0)
        assert torch.isfinite(adv).all() and torch.isfinite(ret).all()

    def test_nan_rewards_raise_value_error(self, estimator, estimator_kwargs):
        rewards, mask, index = self._inputs()
        rewards[0, -1] = float("nan")
        with pytest.raises(ValueError):
            self._call(estimator, estimator_kwargs, rewards, mask, index)

    def test_no_gradient_required(self, estimator, estimator_kwargs):
        rewards, mask, index = self._inputs(seed=3)
        adv, _ = self._call(estimator, estimator_kwargs, rewards, mask, index)
        assert not adv.requires_grad
