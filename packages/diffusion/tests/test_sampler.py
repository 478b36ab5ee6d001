"""The Flow-GRPO SDE step, its log-prob, and which steps are SDE / trained (MixGRPO, DanceGRPO, Fast)."""

from __future__ import annotations

import random

import pytest
import torch
from polyrl_diffusion.config import FlowGRPOConfig, MixGRPOConfig
from polyrl_diffusion.sampler import check_sampler_config, plan_steps, sde_step, sde_window, sigma_schedule

from polyrl.errors import ConfigError

pytestmark = pytest.mark.smoke  # also run on the package installed alone (make test-packages)


def test_step_log_prob_is_the_gaussian_density_averaged_over_latent_elements():
    g = torch.Generator().manual_seed(0)
    x, v = torch.randn(3, 2, 4, 4, generator=g), torch.randn(3, 2, 4, 4, generator=g)
    out = sde_step(x, v, torch.tensor([0.9, 0.5, 0.2]), torch.tensor([0.8, 0.4, 0.1]), 0.7, generator=g)
    for i in range(3):
        ref = torch.distributions.Normal(out.prev_sample_mean[i], out.std[i]).log_prob(out.prev_sample[i]).mean()
        assert out.log_prob[i] == pytest.approx(float(ref), abs=1e-5)
    # scoring a given sample reproduces the draw's log-prob (what the engine recomputes)
    again = sde_step(x, v, torch.tensor([0.9, 0.5, 0.2]), torch.tensor([0.8, 0.4, 0.1]), 0.7, prev_sample=out.prev_sample)
    assert torch.equal(again.log_prob, out.log_prob)


def test_noise_level_zero_is_the_euler_step():
    x, v = torch.randn(4, 3, 8, 8), torch.randn(4, 3, 8, 8)
    out = sde_step(x, v, 0.6, 0.45, 0.0)
    assert torch.allclose(out.prev_sample, x + (0.45 - 0.6) * v, atol=1e-6)
    assert torch.all(out.std == 0) and torch.all(out.log_prob == 0)


def test_the_sde_with_the_exact_velocity_keeps_the_gaussian_marginals():
    """x0 ~ N(m, s^2) per element: with the exact velocity E[eps - x0 | x_sigma] the SDE (noise level 0.7) must
    end at the data distribution, like the ODE. A wrong drift correction moves the mean/std visibly."""
    m, s = 1.5, 0.5
    torch.manual_seed(0)

    def velocity(x, sigma):
        var = (1 - sigma) ** 2 * s**2 + sigma**2
        return -m + (sigma - (1 - sigma) * s**2) / var * (x - (1 - sigma) * m)

    sigmas = sigma_schedule(200)
    results = {}
    for level in (0.0, 0.7):
        x = torch.randn(40_000, 1)
        for i in range(200):
            sig = float(sigmas[i])
            x = sde_step(x, velocity(x, sig), sigmas[i], sigmas[i + 1], level).prev_sample
        results[level] = (float(x.mean()), float(x.std()))
        assert x.mean() == pytest.approx(m, abs=0.03), level
        assert x.std() == pytest.approx(s, abs=0.03), level
    assert results[0.7] != results[0.0]  # the SDE really sampled differently


def test_mix_grpo_window_slides_as_configured():
    cfg = FlowGRPOConfig(train_steps=8, mix_grpo=MixGRPOConfig(enable=True, window_size=3, shift_interval=2, stride=1))
    starts = [sde_window(cfg, step)[0] for step in range(14)]
    assert starts == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 0, 0]  # 6 positions for a window of 3 in 8 steps
    plan = plan_steps(cfg, 5)
    assert plan.sde == tuple(2 <= i < 5 for i in range(8))
    assert plan.trained == plan.sde and plan.noise_levels[2] == pytest.approx(0.7) and plan.noise_levels[0] == 0


def test_flow_grpo_fast_window_and_timestep_fraction():
    cfg = FlowGRPOConfig(train_steps=10, sde_window_size=4, sde_window_start=3, timestep_fraction=0.2,
                         sde_window_random=False)
    plan = plan_steps(cfg, 0, rng=random.Random(0))
    assert [i for i, s in enumerate(plan.sde) if s] == [3, 4, 5, 6]
    assert plan.trained_indices == [3, 4]  # the first int(0.2 * 10) = 2 steps of the window
    assert plan_steps(cfg, 0, validate=True).sde == (False,) * cfg.eval_steps


@pytest.mark.parametrize("overrides, key", [
    ({"sde_window_size": 4, "sde_window_start": 8}, "sde_window_start"),
    ({"mix_grpo": MixGRPOConfig(enable=True, window_size=11)}, "mix_grpo.window_size"),
    ({"timestep_fraction": 0.0}, "timestep_fraction"),
    ({"cfg_scale": 0.5}, "cfg_scale"),
])
def test_bad_sampler_settings_name_the_key(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        check_sampler_config(FlowGRPOConfig(train_steps=10, **overrides))
