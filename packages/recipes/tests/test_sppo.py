"""SPPO's win-rate targets and squared loss against their formulas (brute force over pairs, no shared code),
verl's ``softmean`` variant against numbers computed from its formula, and the conformance suites."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from polyrl_recipes.sppo import compute_policy_loss_sppo, compute_sppo_advantage

from polyrl.protocols import LossScale
from polyrl.testing import AdvantageEstimatorConformance, PolicyLossConformance

#: also run on polyrl-recipes installed alone from its wheel (make test-packages)
pytestmark = pytest.mark.smoke


def _scores_batch():
    scores = [1.0, 0.0, 0.0, 1.0, 0.5, 0.2, 0.9, 0.2, 3.0]  # groups of 4, 4 and a singleton
    index = np.array(["a"] * 4 + ["b"] * 4 + ["c"], dtype=object)
    mask = torch.ones(9, 3)
    mask[2, 2] = 0
    rewards = torch.zeros(9, 3)
    rewards[torch.arange(9), mask.sum(-1).long() - 1] = torch.tensor(scores)
    return scores, index, rewards, mask


def _win_rate(scores, index, i, temperature):
    others = [j for j in range(len(scores)) if j != i and index[j] == index[i]]
    if not others:
        return 0.5

    def pref(a, b):
        if temperature > 0:
            return 1 / (1 + math.exp(-(a - b) / temperature))
        return 1.0 if a > b else 0.5 if a == b else 0.0

    return sum(pref(scores[i], scores[j]) for j in others) / len(others)


@pytest.mark.parametrize("temperature", [0.0, 0.5])
def test_pairwise_targets_are_eta_times_the_win_rate_minus_a_half(temperature):
    scores, index, rewards, mask = _scores_batch()
    adv, ret = compute_sppo_advantage(rewards, mask, index, eta=2.0, win_rate="pairwise",
                                      preference_temperature=temperature)
    for i in range(9):
        expected = 2.0 * (_win_rate(scores, index, i, temperature) - 0.5)
        n = int(mask[i].sum())
        assert adv[i, :n].tolist() == pytest.approx([expected] * n, abs=1e-6)
        assert not adv[i, n:].any()
    assert torch.equal(adv, ret)


def test_softmean_targets_are_verls():
    """verl's recipe: ``eta * (r - SoftMean_eta(r))`` over the whole batch, ``SoftMean_b(x) = log(mean(exp(b x))) / b``."""
    scores, index, rewards, mask = _scores_batch()
    eta = 1.5
    soft = math.log(sum(math.exp(eta * s) for s in scores) / len(scores)) / eta
    adv, _ = compute_sppo_advantage(rewards, mask, index, eta=eta, win_rate="softmean")
    assert adv[:, 0].tolist() == pytest.approx([eta * (s - soft) for s in scores], abs=1e-5)


def test_the_loss_is_the_squared_gap_of_the_summed_log_ratio():
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(5, 4, generator=g)
    new = (old + 0.2 * torch.randn(5, 4, generator=g)).requires_grad_(True)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0]], dtype=torch.float32)
    target = torch.tensor([0.5, -1.0, 0.25, 0.0, 2.0])
    adv = target[:, None] * mask
    loss, metrics = compute_policy_loss_sppo(old, new, adv, mask)
    expected = 0.0
    for i in range(4):  # the empty row is no sequence
        ratio = sum(float(new[i, t].detach() - old[i, t]) for t in range(4) if mask[i, t])
        expected += (ratio - float(target[i])) ** 2
    assert float(loss.detach()) == pytest.approx(expected / 4, rel=1e-5)
    # on-policy (new == old) the gradient is -2 target / B on each of the row's tokens: a policy gradient
    on = old.clone().requires_grad_(True)
    compute_policy_loss_sppo(old, on, adv, mask)[0].backward()
    assert torch.allclose(on.grad, -2 * target[:, None] * mask / 4, atol=1e-6)


def test_global_sequence_count_normalises_micro_batches():
    g = torch.Generator().manual_seed(1)
    old = -torch.rand(6, 3, generator=g)
    new = old + 0.1 * torch.randn(6, 3, generator=g)
    mask = torch.ones(6, 3)
    adv = torch.randn(6, 1, generator=g).expand(6, 3).contiguous()
    whole = compute_policy_loss_sppo(old, new, adv, mask)[0]
    scale = LossScale(dp_size=1, batch_num_tokens=18, global_batch_size=6)
    parts = sum(compute_policy_loss_sppo(old[s], new[s], adv[s], mask[s], loss_scale=scale)[0]
                for s in (slice(0, 2), slice(2, 6)))
    assert float(parts) == pytest.approx(float(whole), rel=1e-6)


class TestSPPOEstimatorConformance(AdvantageEstimatorConformance):
    @pytest.fixture
    def estimator(self):
        return compute_sppo_advantage


class TestSPPOLossConformance(PolicyLossConformance):
    #: the gradient at ratio 1 is SPPO's (2 x target per sequence), not agg_loss(-A log pi)'s
    on_policy_agg_mode = None

    @pytest.fixture
    def policy_loss(self):
        return compute_policy_loss_sppo
