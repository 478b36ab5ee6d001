"""Flow-GRPO advantage / policy loss and the DiffusionNFT loss against their formulas on fixed inputs."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from polyrl_diffusion.algorithms import (
    compute_diffusion_nft_loss,
    compute_flow_grpo_outcome_advantage,
    compute_policy_loss_flow_grpo,
    flow_grpo_kl,
    optimality_probability,
)

from polyrl.testing.conformance.advantage import AdvantageEstimatorConformance
from polyrl.testing.conformance.policy_loss import PolicyLossConformance


class TestFlowGRPOAdvantageConformance(AdvantageEstimatorConformance):
    @pytest.fixture
    def estimator(self):
        return compute_flow_grpo_outcome_advantage


class TestFlowGRPOLossConformance(PolicyLossConformance):
    @pytest.fixture
    def policy_loss(self):
        return compute_policy_loss_flow_grpo


def outcome(scores: list[float], t: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rewards on the last of ``t`` trained steps (the reward manager's layout) and an all-ones mask."""
    rewards = torch.zeros(len(scores), t)
    rewards[:, -1] = torch.tensor(scores)
    return rewards, torch.ones(len(scores), t)


def adv_of(scores, index, t=3, **kw) -> torch.Tensor:
    rewards, mask = outcome(scores, t)
    adv, ret = compute_flow_grpo_outcome_advantage(rewards, mask, index=np.array(index), **kw)
    assert torch.equal(adv, ret)
    assert torch.allclose(adv, adv[:, :1].expand_as(adv)), "every trained step of an image gets its advantage"
    return adv[:, 0]


# ------------------------------------------------------------------ advantage invariants


def test_group_formula_on_fixed_inputs():
    scores = [1.0, 2.0, 4.0, 10.0, 10.0, 13.0]
    group = adv_of(scores, [0, 0, 0, 1, 1, 1], global_std=False, std_unbiased=True)  # DanceGRPO / MixGRPO's std
    population = adv_of(scores, [0, 0, 0, 1, 1, 1], global_std=False)
    for g in (slice(0, 3), slice(3, 6)):
        s = torch.tensor(scores[g], dtype=torch.float64)
        expected = (s - s.mean()) / (s.std() + 1e-4)  # unbiased std over the group's samples
        assert torch.allclose(group[g].double(), expected, atol=1e-6)
        expected = (s - s.mean()) / (s.std(unbiased=False) + 1e-4)  # numpy's std, Flow-GRPO's
        assert torch.allclose(population[g].double(), expected, atol=1e-6)


def test_zero_group_mean_constant_and_single_groups_zero():
    scores = [0.3, 0.9, 0.1, 0.5, 0.5, 0.5, 7.0]
    index = ["a", "a", "a", "b", "b", "b", "c"]
    for use_global in (False, True):
        adv = adv_of(scores, index, global_std=use_global)
        assert abs(float(adv[:3].sum())) < 1e-6
        assert torch.all(adv[3:6] == 0), "a constant group has nothing to prefer"
        assert float(adv[6]) == 0.0, "a single-sample group has no baseline: 0"


def test_affine_invariance():
    g = torch.Generator().manual_seed(0)
    scores = torch.rand(8, generator=g).tolist()
    index = [0, 0, 0, 0, 1, 1, 1, 1]
    base = adv_of(scores, index, adv_clip_max=0)
    for a, b in ((3.0, -2.0), (0.5, 5.0)):
        moved = adv_of([a * s + b for s in scores], index, adv_clip_max=0)
        # epsilon in the denominator: equal up to eps / std
        assert torch.allclose(base, moved, atol=2e-3), (a, b)


def test_global_std_is_the_batch_std_over_samples():
    scores = [1.0, 3.0, 10.0, 30.0]
    adv = adv_of(scores, [0, 0, 1, 1])  # the default: Flow-GRPO's global population std
    std = torch.tensor(scores, dtype=torch.float64).std(unbiased=False)
    assert torch.allclose(adv.double(), torch.tensor([-1.0, 1.0, -10.0, 10.0], dtype=torch.float64) / (std + 1e-4),
                          atol=1e-6)


def test_clipping_and_dr_grpo():
    scores = [0.0] * 30 + [1.0]
    adv = adv_of(scores, [0] * 31)
    assert float(adv.max()) == pytest.approx(5.0), "Flow-GRPO clips advantages at adv_clip_max=5"
    unclipped = adv_of(scores, [0] * 31, adv_clip_max=0)
    assert float(unclipped.max()) > 5.0
    dr = adv_of([1.0, 3.0], [0, 0], norm_adv_by_std_in_grpo=False)
    assert dr.tolist() == [-1.0, 1.0]
    from_config = adv_of([1.0, 3.0], [0, 0], config={"extra": {"norm_adv_by_std_in_grpo": False}})
    assert torch.equal(from_config, dr)


def test_std_over_samples_not_over_the_timestep_expansion():
    """The seeds' review dispute, settled: verl's Flow-GRPO estimator takes torch.std of the reward expanded
    to [B, T]; its unbiased std then divides by N*T - 1, not N - 1, so the advantages depend on how many
    steps are trained. polyrl's do not."""
    scores = [0.0, 1.0, 0.0, 1.0]  # N = 4 samples, one group
    index = [0, 0, 0, 0]
    per_t = [adv_of(scores, index, t=t, global_std=True, std_unbiased=True, adv_clip_max=0) for t in (1, 2, 10)]
    assert torch.allclose(per_t[0], per_t[1]) and torch.allclose(per_t[0], per_t[2])
    sample_std = torch.tensor(scores).std()
    expanded_std = torch.tensor(scores).unsqueeze(-1).expand(4, 10).std()  # what the reviewed code computes
    n, t = 4, 10
    assert float(expanded_std / sample_std) == pytest.approx(math.sqrt(t * (n - 1) / (n * t - 1)), rel=1e-5)
    assert float(expanded_std) < float(sample_std), "the expanded std underestimates: advantages inflated"
    assert float(per_t[2].abs().max()) == pytest.approx(0.5 / (float(sample_std) + 1e-4), rel=1e-5)


def test_index_required():
    rewards, mask = outcome([1.0, 2.0], 2)
    with pytest.raises(ValueError, match="index"):
        compute_flow_grpo_outcome_advantage(rewards, mask)


# ------------------------------------------------------------------ policy loss


def test_policy_loss_formula_on_fixed_inputs():
    old = torch.tensor([[-1.0, -2.0], [-0.5, -0.5]])
    new = torch.tensor([[-0.7, -2.5], [-0.5, -0.2]], requires_grad=True)
    adv = torch.tensor([[1.0, 1.0], [-2.0, -2.0]])
    mask = torch.ones(2, 2)
    loss, metrics = compute_policy_loss_flow_grpo(old, new, adv, mask, "token-mean", {"clip_ratio": 0.2})
    ratio = (new.detach() - old).exp()
    expected = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2)).mean()
    assert float(loss.detach()) == pytest.approx(float(expected), abs=1e-6)
    assert 0.0 < metrics["pg_clipfrac"] < 1.0
    loss.backward()
    assert new.grad is not None and torch.isfinite(new.grad).all()


def test_policy_loss_ratio_one_on_policy():
    old = torch.randn(3, 4)
    _, metrics = compute_policy_loss_flow_grpo(old, old.clone().requires_grad_(True), torch.randn(3, 4),
                                               torch.ones(3, 4), "token-mean", {"clip_ratio": 1e-4})
    assert metrics["ratio_mean"] == pytest.approx(1.0) and metrics["pg_clipfrac"] == 0.0


def test_kl_on_step_means_formula():
    g = torch.Generator().manual_seed(1)
    mean = torch.randn(2, 3, 4, 5, 5, generator=g, requires_grad=True)
    ref = torch.randn(2, 3, 4, 5, 5, generator=g)
    std_dev_t = torch.rand(2, 3, generator=g) + 0.5
    dt = torch.full((2, 3), 0.1)
    kl = flow_grpo_kl(mean, ref, std_dev_t)
    expected = ((mean.detach() - ref) ** 2).flatten(2).mean(-1) / (2 * std_dev_t**2)
    assert torch.allclose(kl, expected)
    exact = flow_grpo_kl(mean, ref, std_dev_t, dt)
    assert torch.allclose(exact, expected / 0.1, rtol=1e-5)
    # equals the KL of the two Gaussian transitions, averaged over latent elements
    s = (std_dev_t * dt.sqrt())[..., None, None, None].expand_as(ref)
    p = torch.distributions.Normal(mean.detach(), s)
    q = torch.distributions.Normal(ref, s)
    assert torch.allclose(exact, torch.distributions.kl_divergence(p, q).flatten(2).mean(-1), rtol=1e-5)
    with pytest.raises(ValueError, match="std_dev_t"):
        flow_grpo_kl(mean, ref, torch.zeros(2, 3))


def test_policy_loss_adds_kl_term():
    old = torch.zeros(2, 3)
    new = torch.zeros(2, 3, requires_grad=True)
    adv = torch.ones(2, 3)
    mask = torch.ones(2, 3)
    mean = torch.ones(2, 3, 4, requires_grad=True)
    ref = torch.zeros(2, 3, 4)
    std = torch.ones(2, 3)
    plain, _ = compute_policy_loss_flow_grpo(old, new, adv, mask, "token-mean", {})
    with_kl, metrics = compute_policy_loss_flow_grpo(old, new, adv, mask, "token-mean", {}, prev_sample_mean=mean,
                                                     ref_prev_sample_mean=ref, std_dev_t=std, kl_coef=0.04)
    assert metrics["kl_loss"] == pytest.approx(0.5)
    assert float((with_kl - plain).detach()) == pytest.approx(0.04 * 0.5)
    with_kl.backward()
    assert torch.allclose(mean.grad, torch.full_like(mean, 0.04 * 1.0 / (6 * 4)))
    cfg = {"use_kl_loss": True, "kl_loss_coef": 0.04}
    with pytest.raises(ValueError, match="prev_sample_mean"):
        compute_policy_loss_flow_grpo(old, new, adv, mask, "token-mean", cfg)


# ------------------------------------------------------------------ DiffusionNFT


def nft_inputs(seed=0, b=4):
    g = torch.Generator().manual_seed(seed)
    v_theta = torch.randn(b, 2, 3, 3, generator=g, requires_grad=True)
    v_old = torch.randn(b, 2, 3, 3, generator=g)
    v_target = torch.randn(b, 2, 3, 3, generator=g)
    return v_theta, v_old, v_target


def test_nft_loss_formula_on_fixed_inputs():
    v_theta, v_old, v_target = nft_inputs()
    r = torch.tensor([0.0, 0.25, 0.5, 1.0])
    beta = 0.3
    loss, metrics = compute_diffusion_nft_loss(v_theta, v_old, v_target, r, beta=beta)
    vt = v_theta.detach()
    pos = (((1 - beta) * v_old + beta * vt - v_target) ** 2).flatten(1).mean(-1)
    neg = (((1 + beta) * v_old - beta * vt - v_target) ** 2).flatten(1).mean(-1)
    expected = ((r * pos + (1 - r) * neg) / beta).mean()
    assert float(loss.detach()) == pytest.approx(float(expected), rel=1e-6)
    assert metrics["nft/r_mean"] == pytest.approx(0.4375)


def test_nft_reduces_to_flow_matching_when_all_samples_positive():
    v_theta, v_old, v_target = nft_inputs(seed=1)
    ones = torch.ones(4)
    loss, _ = compute_diffusion_nft_loss(v_theta, v_old, v_target, ones, beta=1.0)
    fm = ((v_theta - v_target) ** 2).mean()
    assert float(loss.detach()) == pytest.approx(float(fm.detach()), rel=1e-6)
    (g_nft,) = torch.autograd.grad(loss, v_theta)
    (g_fm,) = torch.autograd.grad(fm, v_theta)
    assert torch.allclose(g_nft, g_fm, atol=1e-7)
    # any beta: at v_theta = v_old (the first step on fresh samples) the gradient is flow matching's
    at_old = v_old.clone().requires_grad_(True)
    for beta in (0.1, 1.0, 2.0):
        loss_b, _ = compute_diffusion_nft_loss(at_old, v_old, v_target, ones, beta=beta)
        (g_b,) = torch.autograd.grad(loss_b, at_old)
        (g_ref,) = torch.autograd.grad(((at_old - v_target) ** 2).mean(), at_old)
        assert torch.allclose(g_b, g_ref, atol=1e-6), beta


def test_nft_optimum_and_neutral_reward():
    """Per sample the loss is minimised by v_old + (2r - 1)(v - v_old) / beta; r = 1/2 keeps v_old."""
    _, v_old, v_target = nft_inputs(seed=2, b=3)
    r = torch.tensor([0.5, 0.8, 0.1])
    beta = 0.5
    v = v_old.clone().requires_grad_(True)
    opt = torch.optim.LBFGS([v], lr=1, max_iter=200, tolerance_grad=1e-10, tolerance_change=1e-12)

    def closure():
        opt.zero_grad()
        loss, _ = compute_diffusion_nft_loss(v, v_old, v_target, r, beta=beta)
        loss.backward()
        return loss

    opt.step(closure)
    optimum = v_old + (2 * r - 1).view(3, 1, 1, 1) * (v_target - v_old) / beta
    assert torch.allclose(v.detach(), optimum, atol=1e-4)


def test_nft_adaptive_weight_kl_and_bad_input():
    v_theta, v_old, v_target = nft_inputs(seed=3)
    r = torch.full((4,), 0.7)
    t = torch.tensor([0.2, 0.4, 0.6, 0.8])
    loss, _ = compute_diffusion_nft_loss(v_theta, v_old, v_target, r, adaptive_weight=True, t=t)
    assert torch.isfinite(loss)
    plain, _ = compute_diffusion_nft_loss(v_theta, v_old, v_target, r)
    with_kl, metrics = compute_diffusion_nft_loss(v_theta, v_old, v_target, r, v_ref=v_old, kl_coef=0.1)
    assert float((with_kl - plain).detach()) == pytest.approx(0.1 * metrics["nft/kl_loss"], rel=1e-5)
    with pytest.raises(ValueError, match="t"):
        compute_diffusion_nft_loss(v_theta, v_old, v_target, r, adaptive_weight=True)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        compute_diffusion_nft_loss(v_theta, v_old, v_target, torch.full((4,), 1.5))
    with pytest.raises(ValueError, match="reward_prob"):
        compute_diffusion_nft_loss(v_theta, v_old, v_target, torch.ones(3))


def test_optimality_probability():
    adv = torch.tensor([-10.0, -2.5, 0.0, 2.5, 10.0])
    assert optimality_probability(adv, 5.0).tolist() == [0.0, 0.25, 0.5, 0.75, 1.0]
