"""polyrl's diffusion algorithms against their official implementations, quantity by quantity.

Each ``ref_*`` function below is this test's own few lines of the reference's documented math (Flow-GRPO
``yifan123/flow_grpo``, DanceGRPO ``XueZeyue/DanceGRPO``, MixGRPO ``Tencent-Hunyuan/MixGRPO``, DiffusionNFT
``NVlabs/DiffusionNFT``; which file and function each one follows is named in its docstring), evaluated on fixed
tensors and compared with polyrl's code. Numbers worked out by hand are asserted too, so a wrong reference
function cannot agree with a wrong implementation. docs/diffusion.md has the table of every quantity.
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch
from polyrl_diffusion.config import DanceGRPOConfig, FlowGRPOConfig, MixGRPOConfig
from polyrl_diffusion.sampler import (
    plan_steps,
    sample_trajectory,
    sde_step,
    sde_type_code,
    sde_window,
    sigma_schedule,
    time_shift,
)

SDE, CPS, DANCE = sde_type_code("sde"), sde_type_code("cps"), sde_type_code("dance")


def shifted(steps: int, shift: float = 3.0) -> torch.Tensor:
    """``steps + 1`` sigmas ``linspace(1, 0)`` shifted by SD3's ``shift`` (DanceGRPO's / MixGRPO's ``sd3_time_shift``)."""
    return time_shift(torch.linspace(1.0, 0.0, steps + 1, dtype=torch.float64), shift).float()


def fixed(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------- the stochastic steps


def ref_dance_step(x, v, sigmas, i, eta, noise):
    """DanceGRPO ``flux_step(..., grpo=True, sde_solver=True)``: Euler step plus ``-eta^2 / 2 * score * dsigma``
    with the score ``-(x - (1 - s) x0_hat) / s^2``; std ``eta sqrt(s - s')``; log-prob averaged over elements."""
    s, s_next = float(sigmas[i]), float(sigmas[i + 1])
    dsigma = s_next - s
    x0_hat = x - s * v
    score = -(x - x0_hat * (1 - s)) / s**2
    mean = x + dsigma * v + (-0.5 * eta**2 * score) * dsigma
    std = eta * math.sqrt(s - s_next)
    prev = mean + std * noise
    logp = (-((prev - mean) ** 2) / (2 * std**2) - math.log(std) - 0.5 * math.log(2 * math.pi)).flatten(1).mean(1)
    return prev, mean, std, logp


def ref_flow_grpo_std_dev_t(sigmas, i, a):
    """Flow-GRPO ``sde_step_with_logprob`` (``sde``): ``a sqrt(s / (1 - s))``, ``sigma_max = sigmas[1]`` at ``s = 1``."""
    s = float(sigmas[i])
    return a * math.sqrt(s / (1 - (float(sigmas[1]) if s == 1 else s)))


def ref_cps_step(x, v, sigmas, i, a, noise):
    """Flow-GRPO ``sde_step_with_logprob(sde_type="cps")``: ``std = s' sin(a pi / 2)``, mean from the predicted x0
    and x1, and its constant-free log-prob ``-(x' - mean)^2`` averaged over elements."""
    s, s_next = float(sigmas[i]), float(sigmas[i + 1])
    std = s_next * math.sin(a * math.pi / 2)
    x0_hat, x1_hat = x - s * v, x + v * (1 - s)
    mean = x0_hat * (1 - s_next) + x1_hat * math.sqrt(s_next**2 - std**2)
    prev = mean + std * noise
    return prev, mean, std, (-((prev - mean) ** 2)).flatten(1).mean(1)


def test_dance_grpo_step_is_its_reference_constant_eta_sde():
    sig = shifted(16)  # DanceGRPO's recipe: 16 steps, shift 3, eta 0.3
    x, v = fixed((2, 3, 4, 4), 0), fixed((2, 3, 4, 4), 1)
    for i in (0, 5, 14):
        noise = fixed((2, 3, 4, 4), 10 + i)
        prev, mean, std, logp = ref_dance_step(x, v, sig, i, 0.3, noise)
        step = sde_step(x, v, sig[i], sig[i + 1], 0.3, noise=noise, sde_type=DANCE)
        assert torch.allclose(step.prev_sample_mean, mean, atol=1e-5), i
        assert torch.allclose(step.std, torch.full((2,), std), rtol=1e-5), i
        assert torch.allclose(step.prev_sample, prev, atol=1e-5) and torch.allclose(step.log_prob, logp, atol=1e-4)
    # by hand: sigma_1 = 3 (15/16) / (1 + 2 (15/16)) = 0.978261, so the first step's std is 0.3 sqrt(0.021739)
    assert float(sde_step(x, v, sig[0], sig[1], 0.3, noise=x, sde_type=DANCE).std[0]) == pytest.approx(0.044233, rel=1e-4)


def test_the_old_dance_noise_was_flow_grpos_form_6_8x_too_strong_at_the_start():
    """What polyrl did before: Flow-GRPO's ``a sqrt(s / (1 - s))`` with ``a = 0.3``. Per step it was
    ``sqrt(s / (1 - s))`` times DanceGRPO's noise: 6.8x on the first step, 0.45x on the last."""
    sig = shifted(16)
    x, v = fixed((1, 3, 4, 4), 0), fixed((1, 3, 4, 4), 1)
    ratios = [float(sde_step(x, v, sig[i], sig[i + 1], 0.3, noise=x, sde_type=SDE).std[0])
              / ref_dance_step(x, v, sig, i, 0.3, x)[2] for i in (0, 15)]
    assert ratios[0] == pytest.approx(math.sqrt(46), rel=1e-3)  # 1 / (1 - 0.978261) = 46: 6.78x
    assert ratios[1] == pytest.approx(math.sqrt(0.2), rel=1e-3)  # s = 1/6 at the last step: sqrt(0.2) = 0.447x
    plan = plan_steps(FlowGRPOConfig(train_steps=16, dance_grpo=DanceGRPOConfig(enable=True)), 0, rng=random.Random(0))
    assert plan.sde_type == DANCE and set(plan.noise_levels[:15]) == {0.3}


def test_flow_grpo_sde_and_cps_steps_are_their_references():
    sig = shifted(10)
    x, v = fixed((2, 4, 4, 4), 2), fixed((2, 4, 4, 4), 3)
    for i in (0, 4, 8):
        noise = fixed((2, 4, 4, 4), 20 + i)
        step = sde_step(x, v, sig[i], sig[i + 1], 0.7, noise=noise, sde_type=SDE)
        assert float(step.std_dev_t[0]) == pytest.approx(ref_flow_grpo_std_dev_t(sig, i, 0.7), rel=1e-5)
        prev, mean, std, logp = ref_cps_step(x, v, sig, i, 0.8, noise)  # the Fast no-CFG recipes: cps at 0.8
        cps = sde_step(x, v, sig[i], sig[i + 1], 0.8, noise=noise, sde_type=CPS)
        assert torch.allclose(cps.prev_sample_mean, mean, atol=1e-5) and float(cps.std[0]) == pytest.approx(std)
        assert torch.allclose(cps.log_prob, logp, atol=1e-5)
    # by hand, cps from s = 1 to s' = 0.5 at a = 1: std = 0.5, sqrt(s'^2 - std^2) = 0, so the mean is x0_hat / 2
    one = sde_step(x, v, torch.tensor(1.0), torch.tensor(0.5), 1.0, noise=noise, sde_type=CPS)
    assert torch.allclose(one.prev_sample_mean, (x - v) * 0.5, atol=1e-6) and float(one.std[0]) == pytest.approx(0.5)
    # noise level 0 is the Euler step for every type
    for kind in (SDE, CPS, DANCE):
        ode = sde_step(x, v, sig[3], sig[4], 0.0, noise=noise, sde_type=kind)
        assert torch.allclose(ode.prev_sample, x + (sig[4] - sig[3]) * v, atol=1e-6), kind


def test_dance_grpo_image_is_the_last_steps_prediction_of_x0():
    """DanceGRPO decodes ``pred_original`` of its last step (``x - s v``), not the last (noised) latent. polyrl's last
    step is an ODE step to sigma 0, whose result is exactly that prediction; with ``train_last_step`` (the old
    default) it was a noised sample."""
    seen = {}

    def velocity(x, sigma):
        seen["x"], seen["sigma"] = x.clone(), sigma.clone()
        return 0.5 * x + 0.1

    x0 = fixed((2, 3, 4, 4), 4)
    for last, same in ((False, True), (True, False)):
        cfg = FlowGRPOConfig(train_steps=6, train_last_step=last, dance_grpo=DanceGRPOConfig(enable=True))
        plan = plan_steps(cfg, 0, rng=random.Random(0))
        traj = sample_trajectory(velocity, x0, sigma_schedule(6), plan, [plan.trained_indices] * 2,
                                 generator=torch.Generator().manual_seed(0))
        pred_original = seen["x"] - seen["sigma"].reshape(-1, 1, 1, 1) * velocity(seen["x"], seen["sigma"])
        assert torch.allclose(traj.x0, pred_original, atol=1e-6) is same, last


# ---------------------------------------------------------------------------- which steps are SDE and trained


def ref_flow_grpo_trained(steps: int, fraction: float) -> list[int]:
    """Flow-GRPO ``train_sd3.py``: ``range(int(num_steps * timestep_fraction))``, in order (recipes: 0.99)."""
    return list(range(int(steps * fraction)))


def ref_fast_window(steps: int, size: int) -> tuple[int, int]:
    """Flow-GRPO-Fast with ``sde_window_size = 0``: ``(0, len(timesteps) - 1)``: the last step is not SDE."""
    return (0, steps - 1) if size == 0 else (-1, -1)


@pytest.mark.parametrize("steps", [4, 10, 16, 25])
def test_the_last_step_is_never_sde_nor_trained_by_default(steps):
    flow = plan_steps(FlowGRPOConfig(train_steps=steps), 0, rng=random.Random(0))
    assert flow.trained_indices == ref_flow_grpo_trained(steps, 0.99)  # the recipes' 0.99 = all but the last
    assert [i for i, s in enumerate(flow.sde) if s] == list(range(*ref_fast_window(steps, 0)))
    dance = plan_steps(FlowGRPOConfig(train_steps=steps, dance_grpo=DanceGRPOConfig(enable=True)), 0,
                       rng=random.Random(0))
    # DanceGRPO drops the last step, then trains int(0.6 * (steps - 1)) per image
    assert len(dance.trained_indices) == int(0.6 * (steps - 1)) and max(dance.trained_indices) < steps - 1
    mix = FlowGRPOConfig(train_steps=steps, mix_grpo=MixGRPOConfig(enable=True, window_size=2, shift_interval=1))
    assert max(max(plan_steps(mix, k).trained_indices) for k in range(3 * steps)) == steps - 3
    for plan in (flow, dance):
        assert not plan.sde[-1] and plan.noise_levels[-1] == 0.0 and not plan.trained[-1]
    old = plan_steps(FlowGRPOConfig(train_steps=steps, train_last_step=True), 0)  # the old default, still an option
    assert old.trained_indices == list(range(steps)) and old.sde[-1]


def test_flow_grpo_timestep_fraction_trains_its_first_steps():
    for fraction in (0.3, 0.5, 0.99):
        plan = plan_steps(FlowGRPOConfig(train_steps=10, timestep_fraction=fraction), 0)
        assert plan.trained_indices == ref_flow_grpo_trained(10, fraction), fraction
    assert ref_flow_grpo_trained(10, 0.5) == [0, 1, 2, 3, 4]


class RefMixStates:
    """MixGRPO ``GRPOTrainingStates`` with ``sample_strategy="progressive"``, ``prog_overlap=True``,
    ``roll_back=True`` and ``max_timesteps = sampling_steps - 2`` (its recipe)."""

    def __init__(self, steps: int, size: int, interval: int, stride: int) -> None:
        self.size, self.interval, self.stride, self.max = size, interval, stride, steps - 2
        self.cur = self.it = 0

    def window(self) -> list[int]:
        return list(range(self.cur, min(self.cur + self.size, self.max)))

    def update(self) -> None:
        self.it += 1
        if self.it >= self.interval:
            self.it = 0
            self.cur += self.stride
        if self.cur > self.max:
            self.cur, self.it = 0, 0


@pytest.mark.parametrize("steps, size, interval, stride", [(25, 4, 25, 1), (8, 3, 2, 1), (9, 2, 3, 2), (6, 4, 1, 1)])
def test_mix_grpo_windows_follow_its_reference_schedule(steps, size, interval, stride):
    ref = RefMixStates(steps, size, interval, stride)
    windows = []
    for _ in range(interval * 3 * steps):
        windows.append(ref.window())
        ref.update()
    # the reference also trains an empty window (the start at max_timesteps) for `interval` steps: polyrl skips it
    nonempty = [w for w in windows if w]
    cfg = FlowGRPOConfig(train_steps=steps, mix_grpo=MixGRPOConfig(enable=True, window_size=size,
                                                                   shift_interval=interval, stride=stride))
    ours = [list(range(*sde_window(cfg, k))) for k in range(len(nonempty))]
    assert ours == nonempty
    assert [plan_steps(cfg, k).trained_indices for k in range(len(nonempty))] == nonempty
    if (steps, size, interval) == (25, 4, 25):  # the recipe: 25 training steps per window position
        assert ours[0] == ours[24] == [0, 1, 2, 3] and ours[25] == [1, 2, 3, 4]
        assert ours[22 * 25] == [22] and ours[23 * 25] == [0, 1, 2, 3]  # clipped at step 23, then back to 0
        assert MixGRPOConfig().shift_interval == 25 and MixGRPOConfig().window_size == 4


def test_flow_grpo_fast_window_start_is_drawn_as_its_reference():
    """Flow-GRPO-Fast draws ``start = randint(lo, hi - size)`` every sampling call: its recipe's window of 3 in
    ``(0, num_steps // 2)`` is polyrl's ``sde_window_start=2`` with ``sde_window_random`` (the default)."""
    cfg = FlowGRPOConfig(train_steps=10, sde_window_size=3, sde_window_start=2)
    rng = random.Random(0)
    starts = {sde_window(cfg, 0, rng)[0] for _ in range(200)}
    assert starts == {0, 1, 2}


# ---------------------------------------------------------------------------- advantages


def ref_flow_grpo_advantages(prompts, rewards, global_std=True):
    """Flow-GRPO ``PerPromptStatTracker.update``: per-prompt mean, ``np.std`` (population) of the batch (or the
    prompt's) plus 1e-4."""
    prompts, rewards = np.array(prompts), np.array(rewards, dtype=np.float64)
    out = np.zeros_like(rewards)
    for p in np.unique(prompts):
        group = rewards[prompts == p]
        std = (np.std(rewards) if global_std else np.std(group)) + 1e-4
        out[prompts == p] = (group - group.mean()) / std
    return out


def ref_dance_advantages(rewards, n):
    """DanceGRPO / MixGRPO ``train_one_step``: groups of ``num_generations``, ``torch.std`` (unbiased) + 1e-8."""
    r = torch.tensor(rewards, dtype=torch.float64)
    out = torch.zeros_like(r)
    for i in range(0, len(r), n):
        g = r[i:i + n]
        out[i:i + n] = (g - g.mean()) / (g.std() + 1e-8)
    return out.numpy()


def test_advantages_use_each_references_std():
    from polyrl_diffusion.algorithms import compute_flow_grpo_outcome_advantage
    from polyrl_diffusion.trainer import advantage_defaults

    prompts = ["a", "a", "a", "b", "b", "b", "c", "c", "c"]
    rewards = [0.1, 0.5, 0.3, 2.0, 2.5, 1.0, 0.0, 0.0, 0.9]

    def ours(cfg: FlowGRPOConfig) -> np.ndarray:
        r = torch.zeros(9, 2)
        r[:, -1] = torch.tensor(rewards)
        adv, _ = compute_flow_grpo_outcome_advantage(r, torch.ones(9, 2), index=np.array(prompts),
                                                     **advantage_defaults(cfg))
        return adv[:, 0].double().numpy()

    assert np.allclose(ours(FlowGRPOConfig()), ref_flow_grpo_advantages(prompts, rewards), atol=1e-5)
    assert np.allclose(ours(FlowGRPOConfig(algorithm="diffusion_nft")), ref_flow_grpo_advantages(prompts, rewards),
                       atol=1e-5)  # DiffusionNFT's tracker is the same
    for cfg in (FlowGRPOConfig(dance_grpo=DanceGRPOConfig(enable=True)), FlowGRPOConfig(mix_grpo=MixGRPOConfig(enable=True))):
        assert np.allclose(ours(cfg), ref_dance_advantages(rewards, 3), atol=1e-5)
    # by hand: the batch's population std is sqrt(6.4889 / 9) = 0.8491, so image 0 gets -0.2 / 0.8492 = -0.2355
    assert ours(FlowGRPOConfig())[0] == pytest.approx(-0.2355, abs=1e-4)
    # before: polyrl took the group's unbiased std for Flow-GRPO too: 0.2 for group a, so -0.2 / 0.2001 = -0.9995
    r = torch.zeros(9, 1)
    r[:, 0] = torch.tensor(rewards)
    old, _ = compute_flow_grpo_outcome_advantage(r, torch.ones(9, 1), index=np.array(prompts), global_std=False,
                                                 std_unbiased=True)
    assert float(old[0, 0]) == pytest.approx(-0.9995, abs=1e-4)


# ---------------------------------------------------------------------------- KL to the reference


def ref_flow_grpo_kl(mean, mean_ref, std_dev_t):
    """Flow-GRPO ``train_sd3.py``: ``((mean - mean_ref)^2).mean(dim=(1, 2, 3)) / (2 std_dev_t^2)``, averaged."""
    return float((((mean - mean_ref) ** 2).mean(dim=(1, 2, 3)) / (2 * std_dev_t**2)).mean())


def test_kl_coef_is_flow_grpos_beta():
    from polyrl_diffusion.worker import _with_mean_kl
    from tensordict import TensorDict

    b, t = 3, 2
    mean, mean_ref = fixed((b, t, 2, 4, 4), 5), fixed((b, t, 2, 4, 4), 6)
    sig = shifted(10)
    sigmas, next_sigmas = sig[[1, 6]].expand(b, t), sig[[2, 7]].expand(b, t)
    std_dev_t = torch.tensor([ref_flow_grpo_std_dev_t(sig, i, 0.7) for i in (1, 6)]).expand(b, t)
    mb = TensorDict({"ref_prev_sample_mean": mean_ref, "response_mask": torch.ones(b, t), "sigmas": sigmas.clone(),
                     "next_sigmas": next_sigmas.clone()}, batch_size=[b])
    out = {"prev_sample_mean": mean, "std_dev_t": std_dev_t}

    def zero(o, m, s):
        return torch.zeros(()), {}

    expected = float(np.mean([ref_flow_grpo_kl(mean[:, j], mean_ref[:, j], std_dev_t[0, j]) for j in range(t)]))
    for coef in (0.04, 0.004):  # the OCR / GenEval recipes' beta, and the Wan recipe's
        value, metrics = _with_mean_kl(zero, coef, "token-mean")(out, mb, None)
        assert float(value) == pytest.approx(coef * expected, rel=1e-5)
        assert metrics["actor/kl_mean_loss"] == pytest.approx(expected, rel=1e-5)
    # the old meaning (kl_form=exact): the exact KL of the two Gaussian steps, Flow-GRPO's divided by dt per step
    exact, _ = _with_mean_kl(zero, 1.0, "token-mean", "exact")(out, mb, None)
    dt = (sigmas - next_sigmas)[0]
    per_step = [ref_flow_grpo_kl(mean[:, j], mean_ref[:, j], std_dev_t[0, j]) / float(dt[j]) for j in range(t)]
    assert float(exact) == pytest.approx(float(np.mean(per_step)), rel=1e-5)


def test_the_old_kl_was_1_over_dt_times_flow_grpos_per_step():
    """The factor a recipe's beta picked up under the old (exact) meaning: ``1 / (sigma - sigma_next)`` of each
    trained step. SD3's shift-3 schedule (the last step, never trained, left out): 5.6x-28x at 10 steps (the SD3
    recipes' sampling steps) and 15.4x-118x at 40."""
    for steps, low, high in ((10, 5.6, 28.0), (40, 15.4, 118.0)):
        sig = shifted(steps)
        factors = 1 / (sig[:-2] - sig[1:-1])  # trained steps: all but the last
        assert float(factors.min()) == pytest.approx(low, rel=0.01) and float(factors.max()) == pytest.approx(high, rel=0.01)


# ---------------------------------------------------------------------------- DiffusionNFT


def ref_nft_loss(x0, eps, t, v_theta, v_old, v_ref, adv, beta=1.0, adv_clip_max=5.0, kl_beta=1e-4):
    """DiffusionNFT ``train_nft_sd3.py``: r from the clipped advantage; x0-space losses of the implicit positive and
    negative policies, each divided by its detached mean |x0 error|; ``(r pos + (1 - r) neg) / beta`` times
    ``adv_clip_max``, averaged; plus ``train.beta * ||v - v_ref||^2``."""
    tt = t.reshape(-1, 1, 1, 1)
    xt = (1 - tt) * x0 + tt * eps
    r = ((adv.clamp(-adv_clip_max, adv_clip_max) / adv_clip_max) / 2 + 0.5).clamp(0, 1)
    pos_v, neg_v = beta * v_theta + (1 - beta) * v_old, (1 + beta) * v_old - beta * v_theta
    losses = []
    for pred in (pos_v, neg_v):
        x0_pred = xt - tt * pred
        w = (x0_pred.double() - x0.double()).abs().mean(dim=(1, 2, 3), keepdim=True).clip(min=1e-5)
        losses.append(((x0_pred - x0) ** 2 / w).mean(dim=(1, 2, 3)))
    policy = ((r * losses[0] / beta + (1 - r) * losses[1] / beta) * adv_clip_max).mean()
    return float(policy + kl_beta * ((v_theta - v_ref) ** 2).mean(dim=(1, 2, 3)).mean())


def test_nft_loss_is_the_references_with_its_defaults():
    from polyrl_diffusion.nft import DiffusionNFTConfig, make_nft_loss
    from tensordict import TensorDict

    b = 6
    x0, eps = fixed((b, 3, 4, 4), 7), fixed((b, 3, 4, 4), 8)
    t = torch.tensor([0.9, 0.75, 0.6, 0.45, 0.3, 0.15])
    v_theta, v_old, v_ref = (fixed((b, 3, 4, 4), s) * 0.3 + (eps - x0) for s in (9, 10, 11))
    adv = torch.tensor([6.0, 2.5, 0.4, 0.0, -1.5, -7.0])
    cfg = DiffusionNFTConfig()
    from polyrl_diffusion.algorithms import optimality_probability

    data = TensorDict({
        "sigmas": t[:, None], "nft_target": (eps - x0)[:, None], "nft_old_velocity": v_old[:, None],
        "nft_ref_velocity": v_ref[:, None], "nft_reward_prob": optimality_probability(adv, cfg.adv_clip_max),
        "response_mask": torch.ones(b, 1)}, batch_size=[b])
    ours, _ = make_nft_loss(cfg)({"velocity": v_theta[:, None]}, data, None)
    assert float(ours) == pytest.approx(ref_nft_loss(x0, eps, t, v_theta, v_old, v_ref, adv), rel=1e-5)
    assert (cfg.beta, cfg.adv_clip_max, cfg.adaptive_weight, cfg.kl_coef) == (1.0, 5.0, True, 1e-4)
    # by hand: r = 1/2 + 1/2 clip(A / 5, -1, 1) for A = 6, 2.5, 0: 1, 0.75, 0.5
    assert optimality_probability(adv, 5.0)[[0, 1, 3]].tolist() == [1.0, 0.75, 0.5]


def test_nft_trains_on_the_samplers_times():
    """DiffusionNFT shuffles the sampler's ``num_steps`` timesteps per image and trains the first
    ``int(num_steps * 0.99)``: distinct sigmas of the schedule (sigma 1 included, 0 never)."""
    from polyrl_diffusion.nft import DiffusionNFTConfig, nft_batch
    from tensordict import TensorDict

    sched = shifted(10)
    b = 5
    batch = TensorDict({"x0": fixed((b, 3, 4, 4), 12), "advantages": torch.zeros(b, 1),
                        "schedule_sigmas": sched.expand(b, 11).clone()}, batch_size=[b])
    data = nft_batch(batch, DiffusionNFTConfig(), generator=torch.Generator().manual_seed(0))
    times = data["sigmas"]
    assert times.shape == (b, 9)  # int(10 * 0.99)
    allowed = set(sched[:-1].tolist())
    for row in times.tolist():
        assert len(set(row)) == 9 and set(row) <= allowed
    assert len({tuple(r) for r in times.tolist()}) > 1, "each image draws its own order"


def ref_return_decay(step: int, decay_type: int) -> float:
    """DiffusionNFT ``return_decay``."""
    flat, uprate, uphold = {0: (0, 0.0, 0.0), 1: (0, 0.001, 0.5), 2: (75, 0.0075, 0.999)}[decay_type]
    return 0.0 if step < flat else min((step - flat) * uprate, uphold)


def test_nft_old_policy_decay_is_its_reference_schedule():
    from polyrl_diffusion.nft import DiffusionNFTConfig
    from polyrl_diffusion.weight_copies import old_policy_decay

    cfg = DiffusionNFTConfig()
    for step in (0, 1, 10, 74, 75, 100, 499, 500, 1000, 5000):
        assert old_policy_decay(step, cfg.old_decay_start, cfg.old_decay_rate, cfg.old_decay_max) == \
            pytest.approx(ref_return_decay(step, 1)), step  # the default is its decay_type 1
        assert old_policy_decay(step, 75, 0.0075, 0.999) == pytest.approx(ref_return_decay(step, 2)), step
    assert old_policy_decay(300, 0, 0.001, 0.5) == pytest.approx(0.3)  # by hand


# ---------------------------------------------------------------------------- EMA


class RefEMA:
    """Flow-GRPO / DiffusionNFT ``EMAModuleWrapper.step(parameters, optimization_step)``."""

    def __init__(self, params, decay, interval):
        self.ema = [p.clone() for p in params]
        self.decay, self.interval = decay, interval

    def step(self, params, k):
        one_minus = 1 - min((1 + k) / (10 + k), self.decay)
        if (k + 1) % self.interval == 0:
            for e, p in zip(self.ema, params):
                e.add_(one_minus * (p - e))


def test_engine_ema_is_the_references(tmp_path):
    from polyrl_diffusion.config import DiffusersRolloutConfig
    from polyrl_diffusion.engine import DiffusersEngine
    from polyrl_diffusion.models import make_tiny_pipeline
    from polyrl_diffusion.rollout import DiffusersRollout
    from polyrl_diffusion.worker import collate_images

    from polyrl.config.roles import EngineRoleConfig, ModelConfig, OptimConfig, RolloutConfig
    from polyrl.platforms import CPUPlatform
    from polyrl.protocols import GenerationRequest, SamplingParams

    model = make_tiny_pipeline(tmp_path / "m", family="sd3", seed=0)
    rollout = DiffusersRollout(RolloutConfig(name="diffusers", plugin_config=DiffusersRolloutConfig(
        sampler=FlowGRPOConfig(train_steps=3))), model_path=str(model))
    reqs = [GenerationRequest([], SamplingParams(n=1, seed=0), request_id=f"u{i}", multi_modal={"prompt": "a red house"})
            for i in range(2)]
    rows = collate_images([type("O", (), {"extra": r.extra})() for r in rollout.generate(reqs)])
    batch = rows.select("latents", "sigmas", "prompt_embeds", "pooled_prompt_embeds", "response_mask")
    engine = DiffusersEngine(EngineRoleConfig(engine="diffusers", model=ModelConfig(path=str(model)),
                                              optim=OptimConfig(lr=1e-2)), role="actor", model_type="diffusion",
                             platform=CPUPlatform())
    engine.add_weight_copy("ema", ema=(0.9, 2))
    params = [p for _, p in engine.trainable_parameters()]
    ref = RefEMA([p.detach() for p in params], 0.9, 2)

    def loss(out, mb, scale):
        return (out["velocity"] ** 2).mean(), {}

    for _ in range(5):
        engine.train_batch(batch, loss)
        ref.step([p.detach() for p in params], engine.step)
    ema = engine.weight_copies["ema"].tensors
    names = [n for n, _ in engine.trainable_parameters()]
    assert all(torch.allclose(ema[n], e, atol=1e-6) for n, e in zip(names, ref.ema))
    assert any(not torch.allclose(ema[n], p.detach()) for n, p in zip(names, params)), "EMA equals the weights"
    # by hand: updates after steps 1, 3, 5 with 1 - decay = 1 - 2/11, 1 - 4/13, 1 - 6/15
    assert 1 - min(2 / 11, 0.9) == pytest.approx(0.8182, abs=1e-4)
