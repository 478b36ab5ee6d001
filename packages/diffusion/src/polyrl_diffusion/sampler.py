"""Flow-GRPO sampling: the SDE step with its exact Gaussian log-prob, and which steps are SDE / trained.

Flow matching as in diffusers' SD3 / FLUX pipelines: ``x_s = (1 - s) x0 + s eps`` with ``s`` (sigma)
going from 1 (noise) to 0 (data); the model predicts the velocity ``v = eps - x0``; the ODE (Euler) step
is ``x' = x + (s' - s) v`` with ``s' < s``.

Flow-GRPO (Liu et al. 2025) replaces the ODE by the SDE with the same marginals,
``dx = [v + g^2 / (2 s) (x + (1 - s) v)] ds + g dw``, ``g = a sqrt(s / (1 - s))`` (``a`` the noise
level). Its Euler-Maruyama step over ``ds = s' - s < 0`` is a Gaussian transition::

    mean = x (1 + g^2 ds / (2 s)) + v (1 + g^2 (1 - s) / (2 s)) ds
    std  = g sqrt(-ds)

so the log-density of the sampled ``x'`` is exact. ``a = 0`` gives back the Euler step. At ``s = 1``
(``1 - s = 0``) ``g`` uses the next sigma in the denominator, as the Flow-GRPO reference does.

Pure torch: no diffusers import, so the algorithm tests and the engine share this one definition.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from polyrl.errors import ConfigError

__all__ = [
    "SDEStep",
    "StepPlan",
    "gaussian_log_prob",
    "noise_std",
    "plan_steps",
    "sde_step",
    "sde_step_mean",
    "sigma_schedule",
    "step_coefficients",
    "time_shift",
]


_HALF_LOG_2PI = 0.5 * math.log(2 * math.pi)


@dataclass
class SDEStep:
    """One transition: the sample, its log-prob ``[B]`` (mean over latent elements), the Gaussian's mean,
    Flow-GRPO's ``std_dev_t`` ``[B]`` and the transition std ``[B]``."""

    prev_sample: torch.Tensor
    log_prob: torch.Tensor
    prev_sample_mean: torch.Tensor
    std_dev_t: torch.Tensor
    std: torch.Tensor


def _per_row(value: Any, x: torch.Tensor) -> torch.Tensor:
    """A scalar or ``[B]`` value as a ``[B, 1, 1, ...]`` tensor broadcastable against ``x``."""
    t = torch.as_tensor(value, dtype=torch.float32, device=x.device)
    if t.dim() == 0:
        t = t.expand(x.shape[0])
    return t.reshape(-1, *([1] * (x.dim() - 1))).to(x.dtype)


def noise_std(sigma: torch.Tensor, sigma_next: torch.Tensor, noise_level: torch.Tensor,
              sigma_max: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(std_dev_t, transition std)`` for steps ``sigma -> sigma_next`` (tensors of one shape).

    ``std_dev_t = a * sqrt(sigma / (1 - sigma))``; where ``sigma == 1`` the denominator uses ``sigma_max``
    (default: ``sigma_next``), the Flow-GRPO reference's choice for the first step.
    """
    sigma, sigma_next = sigma.float(), sigma_next.float()
    ref = sigma_next if sigma_max is None else sigma_max.float()
    denom = 1 - torch.where(sigma >= 1, ref, sigma)
    std_dev_t = noise_level.float() * torch.sqrt(sigma / denom.clamp(min=1e-12))
    return std_dev_t, std_dev_t * torch.sqrt((sigma - sigma_next).clamp(min=0))


def sde_step_mean(x: torch.Tensor, v: torch.Tensor, sigma: Any, sigma_next: Any, noise_level: Any
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The transition's ``(mean, std_dev_t [B], std [B])`` (see the module docstring); differentiable in ``v``."""
    s, s_next, a = _per_row(sigma, x), _per_row(sigma_next, x), _per_row(noise_level, x)
    std_dev_t, std = noise_std(s, s_next, a)
    dt = s_next - s
    g2 = std_dev_t.to(x.dtype) ** 2
    mean = x * (1 + g2 / (2 * s) * dt) + v * (1 + g2 * (1 - s) / (2 * s)) * dt
    return mean, std_dev_t.reshape(-1), std.reshape(-1)


def step_coefficients(sigmas: torch.Tensor, noise_levels: Sequence[float]
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(coef_x, coef_v, dt, std)`` ``[S]`` of the steps ``sigmas[k] -> sigmas[k + 1]`` at ``noise_levels[k]``,
    so that :func:`sde_step_mean`'s mean is ``x * coef_x + v * coef_v * dt`` with transition std ``std``.

    The same float32 operations in the same order as :func:`sde_step_mean` (elementwise, so a trajectory
    sampled with these is bit-identical to one stepped with :func:`sde_step`), for all steps at once.
    """
    s, s_next = sigmas[:-1].float(), sigmas[1:].float()
    a = torch.as_tensor(list(noise_levels), dtype=torch.float32)
    std_dev_t, std = noise_std(s, s_next, a)
    dt = s_next - s
    g2 = std_dev_t**2
    return 1 + g2 / (2 * s) * dt, 1 + g2 * (1 - s) / (2 * s), dt, std


def gaussian_log_prob(x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """``log N(x; mean, std^2)`` per element, averaged over every dim but the first: ``[B]``.

    ``std`` is ``[B]`` (one std per row). The mean over latent elements is Flow-GRPO's reduction; the
    policy loss treats it as the log-prob of the step. A row with ``std == 0`` (an ODE step) gets 0.
    """
    s = _per_row(std, x).float()
    safe = torch.where(s > 0, s, torch.ones_like(s))
    lp = -((x.float() - mean.float()) ** 2) / (2 * safe**2) - torch.log(safe) - _HALF_LOG_2PI
    lp = lp.flatten(1).mean(-1)
    return torch.where(s.reshape(-1) > 0, lp, torch.zeros_like(lp))


def sde_step(x: torch.Tensor, v: torch.Tensor, sigma: Any, sigma_next: Any, noise_level: Any, *,
             prev_sample: torch.Tensor | None = None, noise: torch.Tensor | None = None,
             generator: torch.Generator | None = None) -> SDEStep:
    """One Flow-GRPO step from ``x`` (at ``sigma``) with velocity ``v`` to ``sigma_next``.

    With ``prev_sample`` given, scores that sample instead of drawing one (the engine's recomputation).
    ``noise`` (standard normal, shaped like ``x``) or ``generator`` choose the draw.
    """
    mean, std_dev_t, std = sde_step_mean(x, v, sigma, sigma_next, noise_level)
    if prev_sample is None:
        if noise is None:
            noise = torch.randn(x.shape, generator=generator, dtype=x.dtype, device=x.device)
        prev_sample = mean + _per_row(std, x) * noise
    return SDEStep(prev_sample, gaussian_log_prob(prev_sample, mean, std), mean, std_dev_t, std)


def time_shift(sigmas: torch.Tensor, shift: float) -> torch.Tensor:
    """SD3's static shift ``shift * s / (1 + (shift - 1) s)`` (``shift = 1``: unchanged)."""
    return shift * sigmas / (1 + (shift - 1) * sigmas)


def sigma_schedule(num_steps: int, shift: float = 1.0) -> torch.Tensor:
    """``num_steps + 1`` sigmas from 1 to 0 (uniform in time, then shifted), float32."""
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    return time_shift(torch.linspace(1.0, 0.0, num_steps + 1), shift).float()


# ---------------------------------------------------------------------------- which steps are SDE / trained


@dataclass(frozen=True)
class StepPlan:
    """Per sampler step: whether it is an SDE step, whether it is kept for training, its noise level."""

    sde: tuple[bool, ...]
    trained: tuple[bool, ...]
    noise_levels: tuple[float, ...]

    @property
    def num_steps(self) -> int:
        """The sampler's step count."""
        return len(self.sde)

    @property
    def trained_indices(self) -> list[int]:
        """Indices of the trained steps."""
        return [i for i, t in enumerate(self.trained) if t]


def sde_window(cfg: Any, train_step: int, rng: random.Random | None = None) -> tuple[int, int]:
    """``[start, end)`` of the SDE steps among ``cfg.train_steps`` at training step ``train_step``.

    - MixGRPO (``mix_grpo.enable``): a window of ``mix_grpo.window_size`` that moves by
      ``mix_grpo.stride`` steps every ``mix_grpo.shift_interval`` training steps, wrapping round.
    - Flow-GRPO-Fast (``sde_window_size > 0``): ``sde_window_size`` steps from ``sde_window_start``,
      or from a start drawn uniformly in ``[0, sde_window_start]`` with ``sde_window_random``.
    - otherwise every step is SDE (Flow-GRPO).
    Raises :class:`ConfigError` naming the key for a window outside the sampler's steps.
    """
    steps = int(cfg.train_steps)
    mix = cfg.mix_grpo
    if mix.enable:
        size = int(mix.window_size)
        if not 1 <= size <= steps:
            raise ConfigError(f"trainer.flow_grpo.mix_grpo.window_size={size} must be in [1, train_steps={steps}]")
        if mix.shift_interval < 1 or mix.stride < 0:
            raise ConfigError("trainer.flow_grpo.mix_grpo.shift_interval must be >= 1 and stride >= 0 "
                              f"(got {mix.shift_interval}, {mix.stride})")
        positions = steps - size + 1
        start = (int(train_step) // int(mix.shift_interval) * int(mix.stride)) % positions
        return start, start + size
    size = int(cfg.sde_window_size)
    if size <= 0:
        return 0, steps
    start = int(cfg.sde_window_start)
    if size > steps or start < 0 or start + size > steps:
        raise ConfigError(f"trainer.flow_grpo.sde_window_start={start} + sde_window_size={size} lies outside the "
                          f"sampler's trainer.flow_grpo.train_steps={steps} steps: choose start + size <= {steps}")
    if cfg.sde_window_random:
        start = (rng or random).randint(0, start)
    return start, start + size


def plan_steps(cfg: Any, train_step: int, *, validate: bool = False, rng: random.Random | None = None) -> StepPlan:
    """Which of the sampler's steps are SDE and trained, and each step's noise level.

    Validation samples with ``cfg.eval_steps`` ODE steps (nothing trained). Training uses
    ``cfg.train_steps``: SDE on the window (:func:`sde_window`), ODE elsewhere; of the window's steps a
    random ``timestep_fraction`` (DanceGRPO: ``dance_grpo.timestep_fraction``) is trained, at least one.
    The noise level is ``noise_level`` (DanceGRPO: ``dance_grpo.noise_level``, constant), or with
    ``noise_schedule: linear`` decays from ``noise_level`` to ``noise_level_min`` over the SDE steps.
    """
    if validate:
        n = int(cfg.eval_steps)
        return StepPlan((False,) * n, (False,) * n, (0.0,) * n)
    rng = rng or random.Random()
    steps = int(cfg.train_steps)
    start, end = sde_window(cfg, train_step, rng)
    dance = cfg.dance_grpo.enable
    fraction = float(cfg.dance_grpo.timestep_fraction if dance else cfg.timestep_fraction)
    window = list(range(start, end))
    keep = max(1, round(fraction * len(window)))
    trained = set(sorted(rng.sample(window, keep))) if keep < len(window) else set(window)
    level = float(cfg.dance_grpo.noise_level if dance else cfg.noise_level)
    levels = []
    for i in range(steps):
        if not start <= i < end:
            levels.append(0.0)
        elif cfg.noise_schedule == "linear" and not dance and end - start > 1:
            frac = (i - start) / (end - start - 1)
            levels.append(level + (float(cfg.noise_level_min) - level) * frac)
        else:
            levels.append(level)
    sde = tuple(start <= i < end for i in range(steps))
    return StepPlan(sde, tuple(i in trained for i in range(steps)), tuple(levels))


def check_sampler_config(cfg: Any) -> None:
    """ConfigErrors naming the ``trainer.flow_grpo`` key, before any worker starts."""
    key = "trainer.flow_grpo"
    for name in ("train_steps", "eval_steps"):
        if int(getattr(cfg, name)) < 1:
            raise ConfigError(f"{key}.{name}={getattr(cfg, name)} must be >= 1")
    if cfg.noise_level < 0 or cfg.noise_level_min < 0 or cfg.dance_grpo.noise_level < 0:
        raise ConfigError(f"{key}.noise_level / noise_level_min / dance_grpo.noise_level must be >= 0")
    if cfg.noise_schedule not in ("constant", "linear"):
        raise ConfigError(f"{key}.noise_schedule={cfg.noise_schedule!r}: choose 'constant' or 'linear'")
    for name, value in (("timestep_fraction", cfg.timestep_fraction),
                        ("dance_grpo.timestep_fraction", cfg.dance_grpo.timestep_fraction)):
        if not 0 < float(value) <= 1:
            raise ConfigError(f"{key}.{name}={value} must be in (0, 1]")
    if cfg.mix_grpo.enable and cfg.sde_window_size > 0:
        raise ConfigError(f"{key}.mix_grpo.enable and {key}.sde_window_size both set an SDE window: keep one")
    if cfg.mix_grpo.enable and cfg.dance_grpo.enable:
        raise ConfigError(f"{key}.mix_grpo.enable and {key}.dance_grpo.enable: choose one variant")
    if cfg.cfg_scale < 1:
        raise ConfigError(f"{key}.cfg_scale={cfg.cfg_scale} must be >= 1 (1 disables classifier-free guidance)")
    if not math.isfinite(float(cfg.embedded_guidance)) or cfg.embedded_guidance < 0:
        raise ConfigError(f"{key}.embedded_guidance={cfg.embedded_guidance} must be a number >= 0 (FLUX.1-dev's "
                          "recipe: 3.5)")
    sde_window(cfg, 0, random.Random(0))  # raises for a window outside the steps


def group_seed(base: int, group: str) -> int:
    """A stable 63-bit seed for a prompt group (DanceGRPO's shared initial noise)."""
    import hashlib

    digest = hashlib.sha256(f"{base}:{group}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def trained_subset(plan: StepPlan) -> Sequence[int]:
    """The trained step indices of ``plan`` (alias of :attr:`StepPlan.trained_indices`)."""
    return plan.trained_indices


# ---------------------------------------------------------------------------- a whole trajectory


@dataclass
class Trajectory:
    """What sampling ``N`` images kept: per trained step ``latents``/``next_latents`` ``[N, T, C, H, W]``,
    ``sigmas``/``next_sigmas``/``noise_levels``/``log_probs`` ``[N, T]``, ``step_index`` ``[N, T]``; and
    ``x0`` (final latents) and ``initial_noise`` ``[N, C, H, W]``."""

    latents: torch.Tensor
    next_latents: torch.Tensor
    sigmas: torch.Tensor
    next_sigmas: torch.Tensor
    noise_levels: torch.Tensor
    log_probs: torch.Tensor
    step_index: torch.Tensor
    x0: torch.Tensor
    initial_noise: torch.Tensor


def guided(velocity_fn: Any, x: torch.Tensor, sigma: torch.Tensor, cond: Any, uncond: Any, scale: float,
           concat: Any) -> torch.Tensor:
    """Classifier-free guidance ``v_u + scale (v_c - v_u)``: one call on ``[x; x]`` with both conditionings
    (``concat(cond, uncond)`` stacks them); ``scale == 1`` or ``uncond is None``: ``velocity_fn(x, sigma, cond)``."""
    if uncond is None or scale == 1.0:
        return velocity_fn(x, sigma, cond)
    v = velocity_fn(torch.cat([x, x]), torch.cat([sigma, sigma]), concat(cond, uncond))
    v_c, v_u = v.chunk(2)
    return v_u + scale * (v_c - v_u)


@torch.no_grad()
def sample_trajectory(velocity_fn: Any, initial_noise: torch.Tensor, sigmas: torch.Tensor, plan: StepPlan,
                      trained: Sequence[Sequence[int]], *, generator: torch.Generator | None = None) -> Trajectory:
    """Integrate from ``initial_noise`` (``[N, C, H, W]`` at ``sigmas[0] = 1``) over ``plan``'s steps.

    ``velocity_fn(x, sigma [N]) -> v`` (conditioning and CFG bound in). SDE steps draw from ``generator``;
    ODE steps are Euler steps. ``trained[i]`` lists the step indices kept for row ``i`` (equal lengths).
    """
    x = initial_noise.float()
    n = x.shape[0]
    keep = [list(t) for t in trained]
    width = len(keep[0]) if keep else 0
    if any(len(t) != width for t in keep):
        raise ValueError("every row must keep the same number of trained steps")
    lat = torch.zeros(n, width, *x.shape[1:])
    nxt = torch.zeros_like(lat)
    logps = torch.zeros(n, width)
    # per step: the rows that train it and the slot each puts it in (one indexed copy per step, no row loop)
    where: dict[int, tuple[list[int], list[int]]] = {}
    for i, row in enumerate(keep):
        for j, st in enumerate(row):
            rows_, slots_ = where.setdefault(st, ([], []))
            rows_.append(i)
            slots_.append(j)
    # every row keeps the step in one slot (Flow-GRPO, a fixed window): a slice; else an indexed copy
    index_of: dict[int, Any] = {
        st: ((slice(None), j[0]) if r == list(range(n)) and len(set(j)) == 1 else (torch.tensor(r), torch.tensor(j)))
        for st, (r, j) in where.items()}
    step_levels = [plan.noise_levels[k] if plan.sde[k] else 0.0 for k in range(plan.num_steps)]
    # every (row, slot) names one step: its sigmas and noise level are looked up once, not written per step
    index = torch.tensor(keep, dtype=torch.long).reshape(n, width)
    sigmas32 = sigmas.float().cpu()
    sig, sig_next = sigmas32[index], sigmas32[index + 1]
    levels = torch.tensor(step_levels, dtype=torch.float32)[index]
    # per-step scalars shaped to broadcast against x: one indexing op each per step
    shape = (plan.num_steps, *((1,) * x.dim()))
    coef_x, coef_v, dts, stds = (c.to(x.device).reshape(shape) for c in step_coefficients(sigmas, step_levels))
    safe = torch.where(stds > 0, stds, torch.ones_like(stds))
    lp_den, lp_log, step_std = 2 * safe**2, torch.log(safe), stds.flatten().tolist()
    for step in range(plan.num_steps):
        v = velocity_fn(x, sigmas[step].expand(n).to(x.device)).float()
        # sde_step's draw, with the log-prob computed only where a row trains the step; every step draws its
        # noise (ODE steps too, times 0), so a plan's SDE steps see the same stream whatever is trained
        mean = x * coef_x[step] + v * coef_v[step] * dts[step]
        noise = torch.randn(x.shape, generator=generator, dtype=x.dtype, device=x.device)
        prev = mean + stds[step] * noise
        if step in index_of:
            r, j = index_of[step]
            lat[r, j], nxt[r, j] = x[r].cpu(), prev[r].cpu()
            if step_std[step] > 0:  # gaussian_log_prob's operations, its per-row std a scalar here
                lp = (-((prev[r] - mean[r]) ** 2) / lp_den[step] - lp_log[step] - _HALF_LOG_2PI).flatten(1).mean(-1)
                logps[r, j] = lp.cpu()  # an ODE step (std 0) keeps log-prob 0, as gaussian_log_prob gives
        x = prev
    return Trajectory(lat, nxt, sig, sig_next, levels, logps, index, x.cpu(), initial_noise.cpu())
