"""Advantage estimators: hand-computed cases, verl's per-group recursion as a reference, invariants (hypothesis)."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from polyrl.algorithms import compute_advantage, get_adv_estimator_fn

GROUP_BASELINES = ["grpo", "rloo", "opo", "gpg", "grpo_passk", "reinforce_plus_plus_baseline"]


def outcome(scores, length=3, lengths=None):
    """Outcome rewards on the last token of each response; full-width masks unless ``lengths``."""
    n = len(scores)
    lengths = torch.tensor(lengths if lengths is not None else [length] * n)
    mask = (torch.arange(length)[None, :] < lengths[:, None]).float()
    r = torch.zeros(n, length)
    r[torch.arange(n), lengths - 1] = torch.tensor(scores, dtype=torch.float32)
    return r, mask


# ---------------------------------------------------------------- hand-computed


def test_grpo_hand_computed_with_a_singleton_group():
    r, m = outcome([1.0, 0.0, 1.0, 0.0])
    adv, ret = get_adv_estimator_fn("grpo")(r, m, index=np.array(["a", "a", "a", "b"], dtype=object))
    std = (1 / 3) ** 0.5  # unbiased std of (1, 0, 1)
    expected = [(1 / 3) / (std + 1e-6), (-2 / 3) / (std + 1e-6), (1 / 3) / (std + 1e-6), 0.0 / (1 + 1e-6)]
    assert torch.allclose(adv[:, 0], torch.tensor(expected), atol=1e-6)
    assert torch.equal(adv, ret)
    # a singleton group keeps its reward, divided by 1 + eps (verl: mean 0, std 1)
    r, m = outcome([0.7])
    assert float(get_adv_estimator_fn("grpo")(r, m, index=[0])[0][0, 0]) == pytest.approx(0.7 / (1 + 1e-6))


def test_dr_grpo_skips_the_std_from_config_or_keyword():
    r, m = outcome([1.0, 0.0, 0.0])
    for kwargs in ({"config": {"norm_adv_by_std_in_grpo": False}}, {"norm_adv_by_std_in_grpo": False}):
        adv, _ = get_adv_estimator_fn("grpo")(r, m, index=["u"] * 3, **kwargs)
        assert torch.allclose(adv[:, 0], torch.tensor([2 / 3, -1 / 3, -1 / 3]))


def test_grpo_passk_gives_only_the_best_the_gap():
    r, m = outcome([0.0, 1.0, 0.5, 0.5, 0.2, 0.9])
    adv, _ = get_adv_estimator_fn("grpo_passk")(r, m, index=[0, 0, 1, 1, 2, 2], config={"norm_adv_by_std_in_grpo": False})
    # group 1 ties: the first in batch order is "best" and gets a zero gap
    assert torch.allclose(adv[:, 0], torch.tensor([0.0, 1.0, 0.0, 0.0, 0.0, 0.7]))
    adv, _ = get_adv_estimator_fn("grpo_passk")(r[:2], m[:2], index=[0, 0])
    assert float(adv[1, 0]) == pytest.approx(1.0 / (0.5**0.5 + 1e-6))
    with pytest.raises(ValueError, match="at least 2 samples"):
        get_adv_estimator_fn("grpo_passk")(r[:3], m[:3], index=[0, 0, 1])


def test_rloo_leave_one_out_and_singletons():
    r, m = outcome([3.0, 1.0, 2.0, 5.0])
    adv, _ = get_adv_estimator_fn("rloo")(r, m, index=[0, 0, 0, 1])
    assert torch.allclose(adv[:, 0], torch.tensor([3 - 1.5, 1 - 2.5, 2 - 2.0, 5.0]))


def test_opo_uses_the_length_weighted_baseline():
    r, m = outcome([1.0, 0.0, 2.0], length=4, lengths=[1, 3, 2])
    adv, _ = get_adv_estimator_fn("opo")(r, m, index=[0, 0, 1])
    # group 0 baseline (1*1 + 3*0) / 4 = 0.25; group 1 is a singleton: no baseline
    assert torch.allclose(adv[0, :1], torch.tensor([0.75]))
    assert torch.allclose(adv[1, :3], torch.full((3,), -0.25))
    assert torch.allclose(adv[2, :2], torch.full((2,), 2.0))


def test_gpg_scales_by_batch_over_nonzero_rewards():
    r, m = outcome([1.0, 0.0, 1.0, 1.0])
    adv, _ = get_adv_estimator_fn("gpg")(r, m, index=["a", "a", "b", "b"])
    assert torch.allclose(adv[:, 0], torch.tensor([4 / 3 * 0.5, -4 / 3 * 0.5, 0.0, 0.0]))
    adv, _ = get_adv_estimator_fn("gpg")(r, m, index=["a", "a", "b", "b"], f_norm=2.0)
    assert float(adv[0, 0]) == pytest.approx(1 / 3)


def test_reinforce_pp_baseline_whitens_over_the_batch():
    r, m = outcome([1.0, 0.0], length=1)
    adv, _ = get_adv_estimator_fn("reinforce_plus_plus_baseline")(r, m, index=[0, 0])
    # centred (0.5, -0.5), unbiased var 0.5
    assert torch.allclose(adv[:, 0], torch.tensor([0.5, -0.5]) / (0.5 + 1e-8) ** 0.5)


def test_reinforce_pp_discounts_and_restarts_after_eos():
    r = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    m = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv, ret = get_adv_estimator_fn("reinforce_plus_plus")(r, m, config={"gamma": 0.5})
    assert torch.allclose(ret, torch.tensor([[0.25, 0.5, 1.0], [1.0, 2.0, 0.0]]))
    valid = ret[m.bool()]
    assert torch.allclose(adv[m.bool()], (valid - valid.mean()) / (valid.var() + 1e-8).sqrt(), atol=1e-6)
    assert torch.all(adv[~m.bool()] == 0)


def test_remax_subtracts_the_greedy_baseline():
    r, m = outcome([1.0, 0.0])
    with pytest.raises(ValueError, match="reward_baselines"):
        get_adv_estimator_fn("remax")(r, m)
    adv, ret = get_adv_estimator_fn("remax")(r, m, reward_baselines=torch.tensor([0.5, 0.5]))
    assert torch.allclose(adv, torch.tensor([[0.5] * 3, [-0.5] * 3]))
    assert torch.allclose(ret, torch.tensor([[1.0] * 3, [0.0] * 3]))
    with pytest.raises(ValueError, match="reward_baselines has 3 entries"):
        get_adv_estimator_fn("remax")(r, m, reward_baselines=torch.zeros(3))


def gae_reference(rewards, values, mask, gamma, lam):
    """GAE per sample over the valid tokens only (what verl's masked recursion amounts to)."""
    raw = torch.zeros_like(rewards)
    for i in range(rewards.shape[0]):
        pos = [t for t in range(rewards.shape[1]) if mask[i, t]]
        last, next_v = 0.0, 0.0
        for t in reversed(pos):
            delta = rewards[i, t] + gamma * next_v - values[i, t]
            last = delta + gamma * lam * last
            raw[i, t], next_v = last, values[i, t]
    return raw


def test_gae_matches_a_per_sample_reference_and_skips_masked_tokens_inside_a_response():
    torch.manual_seed(0)
    rewards, values = torch.randn(3, 6), torch.randn(3, 6)
    mask = torch.ones(3, 6)
    mask[1, 4:] = 0  # a short response
    mask[2, 2] = 0  # a tool-output token inside the response
    gamma, lam = 0.9, 0.8
    adv, ret = get_adv_estimator_fn("gae")(rewards * mask, response_mask=mask, values=values,
                                           config={"gamma": gamma, "lam": lam})
    # verl's positional order (token_level_rewards, values, response_mask, gamma, lam) gives the same
    adv2, ret2 = get_adv_estimator_fn("gae")(rewards * mask, values, mask, gamma, lam)
    assert torch.equal(adv, adv2) and torch.equal(ret, ret2)
    raw = gae_reference(rewards * mask, values, mask, gamma, lam)
    assert torch.allclose(ret, (raw + values) * mask, atol=1e-5)
    valid = raw[mask.bool()]
    assert torch.allclose(adv, (raw - valid.mean()) / torch.sqrt(valid.var() + 1e-8) * mask, atol=1e-5)
    with pytest.raises(ValueError, match="values"):
        get_adv_estimator_fn("gae")(rewards, response_mask=mask)


def test_compute_advantage_shortcut():
    r, m = outcome([1.0, 0.0])
    adv, _ = compute_advantage("rloo", token_level_rewards=r, response_mask=m, index=[0, 0])
    assert torch.allclose(adv[:, 0], torch.tensor([1.0, -1.0]))


# ---------------------------------------------------------------- verl's recursion as a reference


def verl_style_reference(name, scores, lengths, index, eps=1e-6):
    """A per-group Python loop written from verl's formulas (float32, as verl computes)."""
    groups = defaultdict(list)
    for i, uid in enumerate(index):
        groups[uid].append(i)
    out = torch.zeros_like(scores)
    alpha = len(scores) / max(int(torch.count_nonzero(scores)), 1)
    for members in groups.values():
        s = scores[members]
        n = len(members)
        mean = s.mean() if n > 1 else torch.tensor(0.0)
        std = s.std() if n > 1 else torch.tensor(1.0)
        for j, i in enumerate(members):
            if name == "grpo":
                out[i] = (s[j] - mean) / (std + eps)
            elif name == "rloo":
                out[i] = s[j] * n / (n - 1) - mean * n / (n - 1) if n > 1 else s[j]
            elif name == "opo":
                lens = lengths[members].float()
                out[i] = s[j] - ((lens * s).sum() / lens.sum() if n > 1 else 0.0)
            elif name == "gpg":
                out[i] = alpha * (s[j] - mean)
            elif name == "grpo_passk":
                top, arg = torch.topk(s, 2)
                out[i] = (top[0] - top[1]) / (std + eps) if j == int(arg[0]) else 0.0
    return out


@settings(max_examples=50, deadline=None)
@given(seed=st.integers(0, 10_000), name=st.sampled_from(["grpo", "rloo", "opo", "gpg", "grpo_passk"]),
       n_groups=st.integers(1, 6), singletons=st.booleans())
def test_matches_verls_per_group_recursion(seed, name, n_groups, singletons):
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(2, 6, (n_groups,), generator=g).tolist()
    if singletons and name != "grpo_passk":
        sizes[0] = 1
    index = np.array([f"p{k}" for k, size in enumerate(sizes) for _ in range(size)], dtype=object)
    index = index[torch.randperm(len(index), generator=g).numpy()]  # groups interleaved in the batch
    scores = torch.rand(len(index), generator=g) * 4 - 1  # continuous: no ties for passk
    lengths = torch.randint(1, 8, (len(index),), generator=g)
    r, m = outcome(scores.tolist(), length=8, lengths=lengths.tolist())
    adv, _ = get_adv_estimator_fn(name)(r, m, index=index)
    ref = verl_style_reference(name, scores, lengths, index)
    assert torch.allclose(adv[:, 0], ref, atol=1e-5)


# ---------------------------------------------------------------- invariants


scores_st = st.lists(st.floats(-5, 5, allow_nan=False, width=32), min_size=2, max_size=16)


@settings(max_examples=50, deadline=None)
@given(scores=scores_st, groups=st.integers(1, 4), seed=st.integers(0, 1000))
def test_grpo_advantages_have_zero_group_mean(scores, groups, seed):
    index = np.random.default_rng(seed).integers(0, groups, len(scores))
    r, m = outcome(scores)
    adv, _ = get_adv_estimator_fn("grpo")(r, m, index=index)
    for g in np.unique(index):
        sel = torch.as_tensor(index == g)
        if sel.sum() > 1:
            assert abs(float(adv[sel, 0].mean())) < 1e-4


@settings(max_examples=50, deadline=None)
@given(value=st.floats(-3, 3, allow_nan=False, width=32), n=st.integers(2, 8), name=st.sampled_from(GROUP_BASELINES))
def test_constant_reward_groups_get_exactly_zero(value, n, name):
    r, m = outcome([value] * n)
    adv, _ = get_adv_estimator_fn(name)(r, m, index=[7] * n)
    assert torch.all(adv == 0)


@settings(max_examples=50, deadline=None)
@given(scores=scores_st, a=st.floats(0.1, 10), b=st.floats(-5, 5),
       name=st.sampled_from(["grpo", "reinforce_plus_plus_baseline"]))
def test_normalised_advantages_ignore_a_positive_affine_change_of_rewards(scores, a, b, name):
    if np.std(scores) < 1e-2:
        return  # (near-)constant groups: covered by the test above
    r, m = outcome(scores)
    shifted, _ = outcome([x * a + b for x in scores])
    adv1, _ = get_adv_estimator_fn(name)(r, m, index=[0] * len(scores))
    adv2, _ = get_adv_estimator_fn(name)(shifted, m, index=[0] * len(scores))
    assert torch.allclose(adv1, adv2, atol=1e-3)


@settings(max_examples=50, deadline=None)
@given(scores=scores_st, b=st.floats(-5, 5), name=st.sampled_from(["rloo", "opo", "gpg"]))
def test_baseline_estimators_ignore_a_reward_shift_within_groups(scores, b, name):
    if name == "gpg":  # its batch scale counts nonzero rewards: keep that count fixed
        scores = [x if x != 0 else 1.0 for x in scores]
        b = 0.0
    r, m = outcome(scores, length=4, lengths=[1 + i % 4 for i in range(len(scores))])
    shifted, _ = outcome([x + b for x in scores], length=4, lengths=[1 + i % 4 for i in range(len(scores))])
    adv1, _ = get_adv_estimator_fn(name)(r, m, index=[0] * len(scores))
    adv2, _ = get_adv_estimator_fn(name)(shifted, m, index=[0] * len(scores))
    assert torch.allclose(adv1, adv2, atol=1e-3)


@settings(max_examples=30, deadline=None)
@given(scores=scores_st, name=st.sampled_from(GROUP_BASELINES + ["reinforce_plus_plus"]))
def test_masked_tokens_get_zero(scores, name):
    r, m = outcome(scores, length=4)
    m[:, 3] = 0
    m[0, 1:] = 0
    adv, _ = get_adv_estimator_fn(name)(r * m, m, index=[0] * len(scores))
    assert torch.all(adv[m == 0] == 0)


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_rewards_raise_naming_the_argument(bad):
    r, m = outcome([1.0, bad])
    with pytest.raises(ValueError, match="token_level_rewards holds 1 NaN/inf"):
        get_adv_estimator_fn("grpo")(r, m, index=[0, 0])


def test_non_finite_values_raise_for_gae():
    values = torch.zeros(2, 3)
    values[1, 1] = float("nan")
    with pytest.raises(ValueError, match="values holds"):
        get_adv_estimator_fn("gae")(torch.zeros(2, 3), values, torch.ones(2, 3))


def test_shape_mismatch_names_arguments():
    with pytest.raises(ValueError, match=r"token_level_rewards=\(2, 3\), response_mask=\(2, 4\)"):
        get_adv_estimator_fn("grpo")(torch.zeros(2, 3), torch.ones(2, 4), index=[0, 0])


@pytest.mark.parametrize("name", list(GROUP_BASELINES) + ["reinforce_plus_plus", "gae", "remax"])
def test_all_zero_mask_raises(name):
    kwargs = {"values": torch.zeros(2, 3), "reward_baselines": torch.zeros(2)}
    with pytest.raises(ValueError, match="response_mask is all zero"):
        get_adv_estimator_fn(name)(torch.zeros(2, 3), response_mask=torch.zeros(2, 3), index=[0, 0], **kwargs)


def test_index_errors():
    r, m = outcome([1.0, 0.0])
    with pytest.raises(ValueError, match="index is required"):
        get_adv_estimator_fn("grpo")(r, m)
    with pytest.raises(ValueError, match="index has 3 entries for a batch of 2"):
        get_adv_estimator_fn("grpo")(r, m, index=[0, 0, 1])


def test_unknown_estimator_lists_names():
    from polyrl.errors import RegistryError

    with pytest.raises(RegistryError, match="Did you mean 'grpo'"):
        get_adv_estimator_fn("grpoo")
