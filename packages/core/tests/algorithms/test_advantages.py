"""Advantage estimators: hand-computed cases and invariants (hypothesis)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from polyrl.algorithms import get_adv_estimator_fn

GROUP_BASED = ["grpo", "rloo", "opo", "gpg", "reinforce_plus_plus_baseline"]


def outcome(scores, length=3):
    r = torch.zeros(len(scores), length)
    r[:, -1] = torch.tensor(scores, dtype=torch.float32)
    return r, torch.ones(len(scores), length)


def test_grpo_hand_computed():
    r, m = outcome([1.0, 0.0, 1.0, 0.0])
    adv, ret = get_adv_estimator_fn("grpo")(r, m, index=np.array(["a", "a", "a", "b"]))
    # group a: mean 2/3, unbiased std sqrt(1/3); group b: a singleton -> mean 0, std 1
    std = (1 / 3) ** 0.5
    expected = torch.tensor([(1 - 2 / 3) / (std + 1e-6), (0 - 2 / 3) / (std + 1e-6), (1 - 2 / 3) / (std + 1e-6), 0.0])
    assert torch.allclose(adv[:, 0], expected, atol=1e-5)
    assert torch.equal(adv, ret)


def test_dr_grpo_skips_std():
    r, m = outcome([1.0, 0.0, 0.0])
    adv, _ = get_adv_estimator_fn("grpo")(r, m, index=["u"] * 3, config={"norm_adv_by_std_in_grpo": False})
    assert torch.allclose(adv[:, 0], torch.tensor([2 / 3, -1 / 3, -1 / 3]))


def test_rloo_leave_one_out():
    r, m = outcome([3.0, 1.0, 2.0])
    adv, _ = get_adv_estimator_fn("rloo")(r, m, index=[0, 0, 0])
    assert torch.allclose(adv[:, 0], torch.tensor([3 - 1.5, 1 - 2.5, 2 - 2.0]))


def test_grpo_passk_rewards_only_the_best():
    r, m = outcome([0.0, 1.0, 0.5, 0.5])
    adv, _ = get_adv_estimator_fn("grpo_passk")(r, m, index=[0, 0, 1, 1], config={"norm_adv_by_std_in_grpo": False})
    assert torch.allclose(adv[:, 0], torch.tensor([0.0, 1.0, 0.0, 0.0]))


def test_gae_matches_a_reference_loop():
    torch.manual_seed(0)
    rewards, values = torch.randn(3, 5), torch.randn(3, 5)
    mask = torch.ones(3, 5)
    mask[1, 3:] = 0
    gamma, lam = 0.9, 0.8
    adv, ret = get_adv_estimator_fn("gae")(rewards * mask, mask, values=values, config={"gamma": gamma, "lam": lam})
    raw = torch.zeros(3, 5)
    for i in range(3):
        n = int(mask[i].sum())
        last = 0.0
        for t in reversed(range(n)):
            nv = values[i, t + 1] if t + 1 < n else 0.0
            delta = rewards[i, t] + gamma * nv - values[i, t]
            last = delta + gamma * lam * last
            raw[i, t] = last
    assert torch.allclose(ret, (raw + values) * mask, atol=1e-5)
    valid = raw[mask.bool()]
    whitened = (raw - valid.mean()) / torch.sqrt(valid.var() + 1e-8) * mask
    assert torch.allclose(adv, whitened, atol=1e-4)


def test_reinforce_pp_discounts():
    r = torch.tensor([[0.0, 0.0, 1.0]])
    _, ret = get_adv_estimator_fn("reinforce_plus_plus")(r, torch.ones(1, 3), config={"gamma": 0.5})
    assert torch.allclose(ret, torch.tensor([[0.25, 0.5, 1.0]]))


def test_remax_needs_baseline_and_subtracts_it():
    r, m = outcome([1.0, 0.0])
    with pytest.raises(ValueError, match="reward_baselines"):
        get_adv_estimator_fn("remax")(r, m)
    adv, _ = get_adv_estimator_fn("remax")(r, m, reward_baselines=torch.tensor([0.5, 0.5]))
    assert torch.allclose(adv[:, 0], torch.tensor([0.5, -0.5]))


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_rewards_raise_naming_the_argument(bad):
    r, m = outcome([1.0, bad])
    with pytest.raises(ValueError, match="token_level_rewards"):
        get_adv_estimator_fn("grpo")(r, m, index=[0, 0])


def test_shape_mismatch_names_arguments():
    with pytest.raises(ValueError, match="token_level_rewards=.*response_mask="):
        get_adv_estimator_fn("grpo")(torch.zeros(2, 3), torch.ones(2, 4), index=[0, 0])


def test_unknown_estimator_lists_names():
    from polyrl.errors import RegistryError

    with pytest.raises(RegistryError, match="Did you mean 'grpo'"):
        get_adv_estimator_fn("grpoo")


scores_st = st.lists(st.floats(-5, 5, allow_nan=False, width=32), min_size=2, max_size=16)


@settings(max_examples=50, deadline=None)
@given(scores=scores_st, groups=st.integers(1, 4), seed=st.integers(0, 1000))
def test_grpo_group_mean_is_zero(scores, groups, seed):
    rng = np.random.default_rng(seed)
    index = rng.integers(0, groups, len(scores))
    r, m = outcome(scores)
    adv, _ = get_adv_estimator_fn("grpo")(r, m, index=index)
    for g in np.unique(index):
        sel = torch.as_tensor(index == g)
        if sel.sum() > 1:
            assert abs(float(adv[sel, 0].mean())) < 1e-3


@settings(max_examples=50, deadline=None)
@given(value=st.floats(-3, 3, allow_nan=False, width=32), n=st.integers(2, 8), name=st.sampled_from(GROUP_BASED[:3]))
def test_constant_reward_groups_get_zero(value, n, name):
    r, m = outcome([value] * n)
    adv, _ = get_adv_estimator_fn(name)(r, m, index=[7] * n)
    assert torch.allclose(adv, torch.zeros_like(adv), atol=1e-4)


@settings(max_examples=50, deadline=None)
@given(scores=scores_st, a=st.floats(0.1, 10), b=st.floats(-5, 5))
def test_grpo_invariant_to_positive_affine_rewards(scores, a, b):
    if np.std(scores) < 1e-2:
        return
    r, m = outcome(scores)
    shifted, _ = outcome([x * a + b for x in scores])
    adv1, _ = get_adv_estimator_fn("grpo")(r, m, index=[0] * len(scores))
    adv2, _ = get_adv_estimator_fn("grpo")(shifted, m, index=[0] * len(scores))
    assert torch.allclose(adv1, adv2, atol=1e-3)


@settings(max_examples=30, deadline=None)
@given(scores=scores_st, name=st.sampled_from(GROUP_BASED + ["reinforce_plus_plus"]))
def test_masked_tokens_get_zero(scores, name):
    r, m = outcome(scores, length=4)
    m[:, 3] = 0
    m[0, :] = 0
    adv, _ = get_adv_estimator_fn(name)(r * m, m, index=[0] * len(scores))
    assert torch.all(adv[m == 0] == 0)
