"""Conformance suite for advantage estimators (verl's signature).

Subclass it and provide an ``estimator`` fixture (the function). If the estimator
needs more keyword arguments, override ``estimator_kwargs``: a dict whose values
are the arguments or callables ``(batch, response_length) -> value`` (e.g.
``{"values": lambda b, r: torch.randn(b, r)}`` for GAE); tensors whose first
dimension is the batch are permuted with it in the permutation test::

    class TestMyEstimator(AdvantageEstimatorConformance):
        @pytest.fixture
        def estimator(self):
            return my_estimator
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

B, R, GROUP = 12, 6, 4


def make_batch(seed: int = 0, continuous: bool = False) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
    """``(token_level_rewards, response_mask, index)``: 3 groups of 4, ragged lengths, outcome rewards."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, R + 1, (B,), generator=g)
    lengths[0] = 1  # a one-token response
    lengths[1] = R  # a full-width one
    mask = (torch.arange(R)[None, :] < lengths[:, None]).float()
    scores = torch.rand(B, generator=g) * 4 - 2 if continuous else torch.randint(0, 2, (B,), generator=g).float()
    rewards = torch.zeros(B, R)
    rewards[torch.arange(B), lengths - 1] = scores
    index = np.array([f"uid-{i // GROUP}" for i in range(B)], dtype=object)
    return rewards, mask, index


class AdvantageEstimatorConformance:
    """What every advantage estimator promises: ``fn(token_level_rewards, response_mask, index, config, **kw)``."""

    @pytest.fixture
    def estimator_kwargs(self) -> dict[str, Any]:
        """Extra keyword arguments; values may be callables ``(batch, response_length) -> value``."""
        return {}

    def _kwargs(self, estimator_kwargs: dict[str, Any], b: int = B, r: int = R) -> dict[str, Any]:
        torch.manual_seed(1234)
        return {k: (v(b, r) if callable(v) else v) for k, v in estimator_kwargs.items()}

    def _call(self, estimator, rewards, mask, index, kwargs, config=None):
        return estimator(token_level_rewards=rewards, response_mask=mask, index=index, config=config, **kwargs)

    def test_returns_advantages_and_returns_of_the_reward_shape(self, estimator, estimator_kwargs):
        rewards, mask, index = make_batch()
        adv, ret = self._call(estimator, rewards, mask, index, self._kwargs(estimator_kwargs))
        assert isinstance(adv, torch.Tensor) and isinstance(ret, torch.Tensor)
        assert adv.shape == rewards.shape and ret.shape == rewards.shape
        assert adv.dtype == rewards.dtype, "advantages must keep the rewards' dtype"
        assert torch.isfinite(adv).all() and torch.isfinite(ret).all()

    def test_masked_tokens_get_zero_advantage(self, estimator, estimator_kwargs):
        rewards, mask, index = make_batch(seed=1, continuous=True)
        adv, _ = self._call(estimator, rewards, mask, index, self._kwargs(estimator_kwargs))
        assert torch.all(adv[mask == 0] == 0)

    def test_advantages_carry_no_gradient(self, estimator, estimator_kwargs):
        rewards, mask, index = make_batch(seed=2)
        adv, ret = self._call(estimator, rewards, mask, index, self._kwargs(estimator_kwargs))
        assert not adv.requires_grad and not ret.requires_grad

    def test_inputs_are_not_modified(self, estimator, estimator_kwargs):
        rewards, mask, index = make_batch(seed=3, continuous=True)
        kwargs = self._kwargs(estimator_kwargs)
        before = (rewards.clone(), mask.clone(), index.copy(),
                  {k: v.clone() for k, v in kwargs.items() if isinstance(v, torch.Tensor)})
        self._call(estimator, rewards, mask, index, kwargs)
        assert torch.equal(rewards, before[0]) and torch.equal(mask, before[1])
        assert (index == before[2]).all()
        assert all(torch.equal(kwargs[k], v) for k, v in before[3].items())

    @pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
    def test_non_finite_rewards_raise_value_error_naming_them(self, estimator, estimator_kwargs, bad):
        rewards, mask, index = make_batch()
        rewards[2, 0] = bad
        with pytest.raises(ValueError, match="token_level_rewards"):
            self._call(estimator, rewards, mask, index, self._kwargs(estimator_kwargs))

    def test_mismatched_shapes_raise_value_error_naming_the_arguments(self, estimator, estimator_kwargs):
        rewards, mask, index = make_batch()
        with pytest.raises(ValueError, match="token_level_rewards|response_mask"):
            self._call(estimator, rewards, mask[:, :-1], index, self._kwargs(estimator_kwargs))

    def test_index_may_be_strings_ints_a_list_or_a_tensor(self, estimator, estimator_kwargs):
        rewards, mask, _ = make_batch(seed=4, continuous=True)
        groups = [i // GROUP for i in range(B)]
        forms = [np.array([f"uid-{k}" for k in groups], dtype=object), np.array(groups), list(groups),
                 [f"uid-{k}" for k in groups], torch.tensor(groups)]
        results = [self._call(estimator, rewards, mask, form, self._kwargs(estimator_kwargs))[0] for form in forms]
        for form, result in zip(forms[1:], results[1:]):
            assert torch.allclose(result, results[0], atol=1e-6), f"index as {type(form).__name__} differs"

    def test_permuting_the_batch_permutes_the_advantages(self, estimator, estimator_kwargs):
        rewards, mask, index = make_batch(seed=5, continuous=True)
        kwargs = self._kwargs(estimator_kwargs)
        adv, ret = self._call(estimator, rewards, mask, index, kwargs)
        perm = torch.randperm(B, generator=torch.Generator().manual_seed(5))
        permuted = {k: (v[perm] if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == B else v)
                    for k, v in kwargs.items()}
        adv_p, ret_p = self._call(estimator, rewards[perm], mask[perm], index[perm.numpy()], permuted)
        assert torch.allclose(adv_p, adv[perm], atol=1e-5)
        assert torch.allclose(ret_p, ret[perm], atol=1e-5)

    def test_nan_in_padding_changes_nothing(self, estimator, estimator_kwargs):
        rewards, mask, index = make_batch(seed=7, continuous=True)
        kwargs = self._kwargs(estimator_kwargs)
        adv, ret = self._call(estimator, rewards, mask, index, kwargs)
        junk = mask == 0

        def poison(t: Any) -> Any:
            if isinstance(t, torch.Tensor) and t.shape == mask.shape:
                return torch.where(junk, torch.full_like(t, float("nan")), t)
            return t

        adv2, ret2 = self._call(estimator, poison(rewards), mask, index, {k: poison(v) for k, v in kwargs.items()})
        assert torch.isfinite(adv2).all() and torch.isfinite(ret2).all()
        assert torch.allclose(adv2[~junk], adv[~junk], atol=1e-6) and torch.allclose(ret2[~junk], ret[~junk], atol=1e-6)

    def test_config_may_be_a_mapping_or_an_object(self, estimator, estimator_kwargs):
        rewards, mask, index = make_batch(seed=6, continuous=True)
        kwargs = self._kwargs(estimator_kwargs)
        as_none = self._call(estimator, rewards, mask, index, kwargs)[0]
        as_dict = self._call(estimator, rewards, mask, index, kwargs, config={})[0]
        as_obj = self._call(estimator, rewards, mask, index, kwargs, config=SimpleNamespace())[0]
        assert torch.allclose(as_none, as_dict) and torch.allclose(as_none, as_obj)
