"""Flow-GRPO sampling: the SDE step with its log-prob, and which steps are SDE / trained.

Flow matching as in diffusers' SD3 / FLUX pipelines: ``x_s = (1 - s) x0 + s eps`` with ``s`` (sigma)
going from 1 (noise) to 0 (data); the model predicts the velocity ``v = eps - x0``; the ODE (Euler) step
is ``x' = x + (s' - s) v`` with ``s' < s``.

Three stochastic steps (``sde_type``, the batch field of the same name holds :data:`SDE_TYPES`' index):

- ``sde`` (Flow-GRPO, Liu et al. 2025): the SDE with the ODE's marginals,
  ``dx = [v + g^2 / (2 s) (x + (1 - s) v)] ds + g dw`` with ``g = a sqrt(s / (1 - s))`` (``a`` the noise
  level). Its Euler-Maruyama step over ``ds = s' - s < 0`` is the Gaussian transition::

      mean = x (1 + g^2 ds / (2 s)) + v (1 + g^2 (1 - s) / (2 s)) ds
      std  = g sqrt(-ds)

  At ``s = 1`` (``1 - s = 0``) ``g`` uses the next sigma in the denominator, as the Flow-GRPO reference does.
- ``dance`` (DanceGRPO): the same SDE with a constant ``g = eta`` (its ``flux_step`` with the score
  ``-(x - (1 - s) x0_hat) / s^2``, ``x0_hat = x - s v``, is this drift), so ``std = eta sqrt(-ds)``.
- ``cps`` (Flow-GRPO's coefficient-preserving sampler, ``sde_type="cps"``): ``std = s' sin(a pi / 2)`` and
  ``mean = x0_hat (1 - s') + x1_hat sqrt(s'^2 - std^2)`` with ``x0_hat = x - s v``, ``x1_hat = x + (1 - s) v``.

The log-prob of an ``sde`` / ``dance`` step is the exact Gaussian density averaged over the latent elements;
a ``cps`` step's is the reference's constant-free ``-(x' - mean)^2`` (averaged likewise). A noise level of 0
gives the Euler step for every type.

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
    "SDE_TYPES",
    "SDEStep",
    "StepPlan",
    "gaussian_log_prob",
    "noise_std",
    "plan_steps",
    "sde_step",
    "sde_step_mean",
    "sde_type_code",
    "sigma_schedule",
    "step_coefficients",
    "step_log_prob",
    "time_shift",
    "transition_std",
]


_HALF_LOG_2PI = 0.5 * math.log(2 * math.pi)

#: The stochastic step kinds, by their code in the batch field ``sde_type``.
SDE_TYPES = ("sde", "cps", "dance")


def sde_type_code(name: str) -> int:
    """The code of ``name`` in :data:`SDE_TYPES`."""
    return SDE_TYPES.index(name)


@dataclass
class SDEStep:
    """One transition: the sample, its log-prob ``[B]`` (mean over latent elements), the Gaussian's mean,
    the step's ``std_dev_t`` ``[B]`` (the reference implementations' name: Flow-GRPO's ``g``, DanceGRPO's
    ``eta``, CPS's transition std) and the transition std ``[B]``."""

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
              sigma_max: torch.Tensor | None = None, sde_type: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(std_dev_t, transition std)`` for steps ``sigma -> sigma_next`` (tensors of one shape).

    ``sde``: ``std_dev_t = a * sqrt(sigma / (1 - sigma))``; where ``sigma == 1`` the denominator uses
    ``sigma_max`` (default: ``sigma_next``), the Flow-GRPO reference's choice for the first step; the
    transition std is ``std_dev_t * sqrt(sigma - sigma_next)``. ``dance``: ``std_dev_t = a`` (constant).
    ``cps``: ``std_dev_t = sigma_next * sin(a pi / 2)``, which is also the transition std.
    """
    sigma, sigma_next, level = sigma.float(), sigma_next.float(), noise_level.float()
    if sde_type == 1:  # cps
        std_dev_t = sigma_next * torch.sin(level * (math.pi / 2))
        return std_dev_t, std_dev_t
    if sde_type == 2:  # dance: a constant diffusion coefficient
        std_dev_t = level * torch.ones_like(sigma)
    else:
        ref = sigma_next if sigma_max is None else sigma_max.float()
        denom = 1 - torch.where(sigma >= 1, ref, sigma)
        std_dev_t = level * torch.sqrt(sigma / denom.clamp(min=1e-12))
    return std_dev_t, std_dev_t * torch.sqrt((sigma - sigma_next).clamp(min=0))


def transition_std(std_dev_t: torch.Tensor, dt: torch.Tensor, sde_type: int = 0) -> torch.Tensor:
    """The transition's std from the step's ``std_dev_t`` and ``dt = sigma - sigma_next``: ``std_dev_t sqrt(dt)``
    (``sde``, ``dance``), ``std_dev_t`` itself (``cps``)."""
    return std_dev_t if sde_type == 1 else std_dev_t * dt.clamp(min=0).sqrt()


def _coefficients(s: torch.Tensor, s_next: torch.Tensor, level: torch.Tensor, sde_type: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(coef_x, coef_v, dt, std_dev_t, std)`` with ``mean = x * coef_x + v * coef_v * dt`` (float32, same shape).

    One definition for the rollout (all steps at once) and the engine (per row), so both compute the same
    float32 numbers. A step at noise level 0 is the Euler step (``coef_x = coef_v = 1``) for every type.
    """
    std_dev_t, std = noise_std(s, s_next, level, sde_type=sde_type)
    dt = s_next - s
    if sde_type == 1:  # cps: x0_hat (1 - s') + x1_hat c = x (1 - s' + c) + v (-s (1 - s') + (1 - s) c)
        c = torch.sqrt((s_next**2 - std_dev_t**2).clamp(min=0))
        coef_x = (1 - s_next) + c
        coef_v = (-s * (1 - s_next) + (1 - s) * c) / dt
        euler = level == 0
        one = torch.ones_like(coef_x)
        return torch.where(euler, one, coef_x), torch.where(euler, one, coef_v), dt, std_dev_t, std
    g2 = std_dev_t**2
    return 1 + g2 / (2 * s) * dt, 1 + g2 * (1 - s) / (2 * s), dt, std_dev_t, std


def sde_step_mean(x: torch.Tensor, v: torch.Tensor, sigma: Any, sigma_next: Any, noise_level: Any,
                  sde_type: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The transition's ``(mean, std_dev_t [B], std [B])`` (see the module docstring); differentiable in ``v``."""
    s, s_next, a = _per_row(sigma, x), _per_row(sigma_next, x), _per_row(noise_level, x)
    coef_x, coef_v, dt, std_dev_t, std = _coefficients(s.float(), s_next.float(), a.float(), sde_type)
    mean = x * coef_x.to(x.dtype) + v * coef_v.to(x.dtype) * dt.to(x.dtype)
    return mean, std_dev_t.reshape(-1), std.reshape(-1)


def step_coefficients(sigmas: torch.Tensor, noise_levels: Sequence[float], sde_type: int = 0
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(coef_x, coef_v, dt, std)`` ``[S]`` of the steps ``sigmas[k] -> sigmas[k + 1]`` at ``noise_levels[k]``,
    so that :func:`sde_step_mean`'s mean is ``x * coef_x + v * coef_v * dt`` with transition std ``std``.

    The same float32 operations as :func:`sde_step_mean` (elementwise, so a trajectory sampled with these is
    bit-identical to one stepped with :func:`sde_step`), for all steps at once.
    """
    s, s_next = sigmas[:-1].float(), sigmas[1:].float()
    a = torch.as_tensor(list(noise_levels), dtype=torch.float32)
    coef_x, coef_v, dt, _, std = _coefficients(s, s_next, a, sde_type)
    return coef_x, coef_v, dt, std


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


def step_log_prob(x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor, sde_type: int = 0) -> torch.Tensor:
    """The step's log-prob ``[B]``: :func:`gaussian_log_prob` (``sde``, ``dance``), or for ``cps`` the Flow-GRPO
    reference's constant-free ``-(x - mean)^2`` averaged over the latent elements (0 where ``std == 0``)."""
    if sde_type != 1:
        return gaussian_log_prob(x, mean, std)
    lp = (-((x.float() - mean.float()) ** 2)).flatten(1).mean(-1)
    return torch.where(_per_row(std, x).float().reshape(-1) > 0, lp, torch.zeros_like(lp))


def sde_step(x: torch.Tensor, v: torch.Tensor, sigma: Any, sigma_next: Any, noise_level: Any, *,
             prev_sample: torch.Tensor | None = None, noise: torch.Tensor | None = None,
             generator: torch.Generator | None = None, sde_type: int = 0) -> SDEStep:
    """One step from ``x`` (at ``sigma``) with velocity ``v`` to ``sigma_next`` (``sde_type``: an index of
    :data:`SDE_TYPES`).

    With ``prev_sample`` given, scores that sample instead of drawing one (the engine's recomputation).
    ``noise`` (standard normal, shaped like ``x``) or ``generator`` choose the draw.
    """
    mean, std_dev_t, std = sde_step_mean(x, v, sigma, sigma_next, noise_level, sde_type)
    if prev_sample is None:
        if noise is None:
            noise = torch.randn(x.shape, generator=generator, dtype=x.dtype, device=x.device)
        prev_sample = mean + _per_row(std, x) * noise
    return SDEStep(prev_sample, step_log_prob(prev_sample, mean, std, sde_type), mean, std_dev_t, std)


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
    """Per sampler step: whether it is an SDE step, whether it is kept for training, its noise level; the
    stochastic step's kind (an index of :data:`SDE_TYPES`) and whether each image draws its own random subset
    of ``len(trained_indices)`` SDE steps to train (DanceGRPO) instead of training ``trained_indices``."""

    sde: tuple[bool, ...]
    trained: tuple[bool, ...]
    noise_levels: tuple[float, ...]
    sde_type: int = 0
    random_subset: bool = False

    @property
    def num_steps(self) -> int:
        """The sampler's step count."""
        return len(self.sde)

    @property
    def trained_indices(self) -> list[int]:
        """Indices of the trained steps."""
        return [i for i, t in enumerate(self.trained) if t]


def trainable_steps(cfg: Any) -> int:
    """How many of the ``train_steps`` sampler steps may be SDE and trained: all but the last, as Flow-GRPO
    (``timestep_fraction`` 0.99, Flow-GRPO-Fast's window ``(0, T - 1)``), DanceGRPO and MixGRPO do (the last
    step ends at sigma 0, where the Gaussian is sharpest), or all of them with ``train_last_step``."""
    steps = int(cfg.train_steps)
    return steps if cfg.train_last_step else steps - 1


def mix_grpo_window(cfg: Any, train_step: int) -> tuple[int, int]:
    """MixGRPO's ``[start, end)`` at training step ``train_step`` (its ``GRPOTrainingStates``, ``progressive``
    with ``prog_overlap`` and ``roll_back``): the start moves by ``stride`` every ``shift_interval`` steps and rolls
    back to 0 past the last start; windows are clipped at ``train_steps - 2`` (the reference's ``max_timesteps``,
    an exclusive bound, so neither of the last two steps is trained; ``train_last_step``: at ``train_steps``).

    The reference also visits the start at the bound itself, whose window is empty (an update with nothing
    trained); polyrl skips that position."""
    mix = cfg.mix_grpo
    steps = int(cfg.train_steps)
    end = steps if cfg.train_last_step else steps - 2
    size, interval, stride = int(mix.window_size), int(mix.shift_interval), int(mix.stride)
    if end < 1:
        raise ConfigError(f"trainer.flow_grpo.train_steps={steps}: MixGRPO trains windows below step train_steps - 2 "
                          "(as its reference); use train_steps >= 3 (or trainer.flow_grpo.train_last_step=true)")
    count = 1 if stride == 0 else -(-end // stride)  # starts 0, stride, 2 stride, ... below `end`
    start = (int(train_step) // interval % count) * stride
    return start, min(start + size, end)


def sde_window(cfg: Any, train_step: int, rng: random.Random | None = None) -> tuple[int, int]:
    """``[start, end)`` of the SDE steps among ``cfg.train_steps`` at training step ``train_step``.

    - MixGRPO (``mix_grpo.enable``): :func:`mix_grpo_window`.
    - Flow-GRPO-Fast (``sde_window_size > 0``): ``sde_window_size`` steps from ``sde_window_start``, or with
      ``sde_window_random`` (the default, as the reference) from a start drawn uniformly in
      ``[0, sde_window_start]``.
    - otherwise every trainable step (:func:`trainable_steps`): Flow-GRPO, DanceGRPO.
    Raises :class:`ConfigError` naming the key for a window outside the trainable steps.
    """
    steps = int(cfg.train_steps)
    trainable = trainable_steps(cfg)
    mix = cfg.mix_grpo
    if mix.enable:
        size = int(mix.window_size)
        if not 1 <= size <= steps:
            raise ConfigError(f"trainer.flow_grpo.mix_grpo.window_size={size} must be in [1, train_steps={steps}]")
        if mix.shift_interval < 1 or mix.stride < 0:
            raise ConfigError("trainer.flow_grpo.mix_grpo.shift_interval must be >= 1 and stride >= 0 "
                              f"(got {mix.shift_interval}, {mix.stride})")
        return mix_grpo_window(cfg, train_step)
    size = int(cfg.sde_window_size)
    if size <= 0:
        return 0, trainable
    start = int(cfg.sde_window_start)
    if size > trainable or start < 0 or start + size > trainable:
        last = "" if cfg.train_last_step else " (the last step is never SDE: trainer.flow_grpo.train_last_step=false)"
        raise ConfigError(f"trainer.flow_grpo.sde_window_start={start} + sde_window_size={size} lies outside the "
                          f"sampler's {trainable} trainable steps of trainer.flow_grpo.train_steps={steps}{last}: "
                          f"choose start + size <= {trainable}")
    if cfg.sde_window_random:
        start = (rng or random).randint(0, start)
    return start, start + size


def plan_steps(cfg: Any, train_step: int, *, validate: bool = False, rng: random.Random | None = None) -> StepPlan:
    """Which of the sampler's steps are SDE and trained, and each step's noise level.

    Validation samples with ``cfg.eval_steps`` ODE steps (nothing trained). Training uses
    ``cfg.train_steps``: SDE on the window (:func:`sde_window`), ODE elsewhere (the last step always, unless
    ``train_last_step``). Trained steps: Flow-GRPO's first ``int(timestep_fraction * train_steps)`` steps of the
    window (its ``range(num_train_timesteps)``; all of a Fast or MixGRPO window at fraction 1); DanceGRPO's
    random ``int(dance_grpo.timestep_fraction * window)`` steps per image (at least one either way).
    The noise level is ``noise_level`` (DanceGRPO: its constant ``dance_grpo.noise_level``, eta), or with
    ``noise_schedule: linear`` decays from ``noise_level`` to ``noise_level_min`` over the SDE steps.
    DiffusionNFT (``algorithm: diffusion_nft``) keeps one step (it carries the reward; the update uses the clean
    samples) and with ``nft.deterministic`` samples every step with the ODE.
    """
    if validate:
        n = int(cfg.eval_steps)
        return StepPlan((False,) * n, (False,) * n, (0.0,) * n)
    rng = rng or random.Random()
    steps = int(cfg.train_steps)
    start, end = sde_window(cfg, train_step, rng)
    dance = cfg.dance_grpo.enable
    window = list(range(start, end))
    nft = getattr(cfg, "algorithm", "flow_grpo") == "diffusion_nft"
    if nft:  # DiffusionNFT trains on the clean samples: one step only carries the image's reward
        trained = {start}
    elif dance:
        keep = max(1, int(float(cfg.dance_grpo.timestep_fraction) * len(window)))
        trained = set(rng.sample(window, keep))  # each image redraws its own subset (StepPlan.random_subset)
    else:
        keep = max(1, min(len(window), int(float(cfg.timestep_fraction) * steps)))
        trained = set(window[:keep])
    level = float(cfg.dance_grpo.noise_level if dance else cfg.noise_level)
    if nft and cfg.nft.deterministic:  # DiffusionNFT's reference samples with a deterministic solver
        level = 0.0
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
    kind = sde_type_code("dance") if dance else sde_type_code(str(cfg.sde_type))
    return StepPlan(sde, tuple(i in trained for i in range(steps)), tuple(levels), kind,
                    random_subset=dance and not nft)


def check_sampler_config(cfg: Any) -> None:
    """ConfigErrors naming the ``trainer.flow_grpo`` key, before any worker starts (every number finite and in
    range: :func:`polyrl_diffusion.config.check_numbers`; then the choices and the window)."""
    from polyrl_diffusion.config import check_numbers

    key = "trainer.flow_grpo"
    check_numbers(cfg, key)
    if cfg.noise_schedule not in ("constant", "linear"):
        raise ConfigError(f"{key}.noise_schedule={cfg.noise_schedule!r}: choose 'constant' or 'linear'")
    if cfg.sde_type not in ("sde", "cps"):
        raise ConfigError(f"{key}.sde_type={cfg.sde_type!r}: choose 'sde' (Flow-GRPO) or 'cps' (coefficient-preserving)")
    if cfg.sde_type == "cps" and not 0 <= cfg.noise_level <= 1:
        raise ConfigError(f"{key}.noise_level={cfg.noise_level} with sde_type=cps must be in [0, 1] "
                          "(the step's std is sigma_next * sin(noise_level * pi / 2))")
    if cfg.kl_form not in ("flow_grpo", "exact"):
        raise ConfigError(f"{key}.kl_form={cfg.kl_form!r}: choose 'flow_grpo' (Flow-GRPO's beta) or 'exact'")
    if cfg.mix_grpo.enable and cfg.sde_window_size > 0:
        raise ConfigError(f"{key}.mix_grpo.enable and {key}.sde_window_size both set an SDE window: keep one")
    if cfg.mix_grpo.enable and cfg.dance_grpo.enable:
        raise ConfigError(f"{key}.mix_grpo.enable and {key}.dance_grpo.enable: choose one variant")
    if cfg.dance_grpo.enable and cfg.sde_type != "sde":
        raise ConfigError(f"{key}.dance_grpo.enable samples with DanceGRPO's own SDE: leave {key}.sde_type=sde")
    if trainable_steps(cfg) < 1:
        raise ConfigError(f"{key}.train_steps={cfg.train_steps} leaves no step to train (the last step is ODE and "
                          f"never trained, as in the references): use train_steps >= 2, or {key}.train_last_step=true")
    level = cfg.dance_grpo.noise_level if cfg.dance_grpo.enable else cfg.noise_level
    if cfg.algorithm == "flow_grpo" and level == 0:
        which = "dance_grpo.noise_level" if cfg.dance_grpo.enable else "noise_level"
        raise ConfigError(f"{key}.{which}=0 makes every step an ODE step: the Flow-GRPO loss would have nothing to "
                          f"train. Use a noise level > 0, or {key}.algorithm=diffusion_nft for ODE sampling")
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
    coef_x, coef_v, dts, stds = (c.to(x.device).reshape(shape)
                                 for c in step_coefficients(sigmas, step_levels, plan.sde_type))
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
            if step_std[step] > 0:  # step_log_prob's operations, its per-row std a scalar here
                if plan.sde_type == 1:  # cps: the reference's constant-free log-prob
                    lp = (-((prev[r] - mean[r]) ** 2)).flatten(1).mean(-1)
                else:
                    lp = (-((prev[r] - mean[r]) ** 2) / lp_den[step] - lp_log[step] - _HALF_LOG_2PI).flatten(1).mean(-1)
                logps[r, j] = lp.cpu()  # an ODE step (std 0) keeps log-prob 0, as step_log_prob gives
        x = prev
    return Trajectory(lat, nxt, sig, sig_next, levels, logps, index, x.cpu(), initial_noise.cpu())
