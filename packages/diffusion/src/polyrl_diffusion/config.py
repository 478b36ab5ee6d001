"""Config blocks of the diffusion plugin: ``trainer.flow_grpo``, ``rollout.diffusers``, ``actor.diffusers``.

```yaml
trainer:
  name: flow_grpo
  flow_grpo: {noise_level: 0.7, train_steps: 10, eval_steps: 20, cfg_scale: 4.5, sde_window_size: 2}
```
Every key with its meaning: docs/diffusion.md, "Config".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from polyrl_diffusion.nft import DiffusionNFTConfig
from polyrl_engine_fsdp.config import FSDPConfig


@dataclass
class MixGRPOConfig:
    """MixGRPO: SDE on a window of ``window_size`` steps (ODE elsewhere) that moves by ``stride`` steps every
    ``shift_interval`` training steps and rolls back to the first step past the last start (the reference's
    ``progressive`` schedule with ``prog_overlap``; its recipe: window 4, every 25 steps, stride 1)."""

    enable: bool = False
    window_size: int = 4
    shift_interval: int = 25
    stride: int = 1


@dataclass
class DanceGRPOConfig:
    """DanceGRPO: one initial noise shared by the samples of a prompt group, a constant noise level ``eta``
    (its SDE's diffusion coefficient: each step's std is ``eta sqrt(sigma - sigma_next)``), and a random
    ``timestep_fraction`` of the steps trained per image (its recipe: eta 0.3, fraction 0.6)."""

    enable: bool = False
    noise_level: float = 0.3
    timestep_fraction: float = 0.6


@dataclass
class EMAConfig:
    """An exponential moving average of the trained weights, used for validation samples and exported by
    ``polyrl export`` (as Flow-GRPO and DiffusionNFT use theirs for evaluation and checkpoints). After optimizer
    step ``k`` (counted from 1) with ``(k + 1) % update_interval == 0``:
    ``ema += (1 - min((1 + k) / (10 + k), decay)) * (w - ema)``."""

    #: ``null``: the algorithm's reference default (Flow-GRPO: off, its recipes turn it on; DiffusionNFT: on).
    enable: bool | None = None
    decay: float = 0.9
    #: ``null``: Flow-GRPO's 8, DiffusionNFT's 1.
    update_interval: int | None = None


@dataclass
class FlowGRPOConfig:
    """``trainer.flow_grpo``: how the rollout samples and what is trained (Flow-GRPO and its variants)."""

    #: Flow-GRPO's ``a``: the SDE's diffusion ``g = a sqrt(s / (1 - s))`` (``cps``: ``std = s' sin(a pi / 2)``).
    noise_level: float = 0.7
    #: ``sde`` (Flow-GRPO's SDE) or ``cps`` (its coefficient-preserving sampler). DanceGRPO uses its own.
    sde_type: str = "sde"
    #: ``constant`` or ``linear`` (from ``noise_level`` to ``noise_level_min`` over the SDE steps).
    noise_schedule: str = "constant"
    noise_level_min: float = 0.0
    #: Sampler steps while training (Flow-GRPO trains with fewer steps than it evaluates with).
    train_steps: int = 10
    #: ODE sampler steps for validation images.
    eval_steps: int = 20
    #: Make the last step (to sigma 0) an SDE step that can be trained. Off, as in every reference: the last step
    #: is an ODE step (the image is the model's clean prediction) and is never trained.
    train_last_step: bool = False
    #: Classifier-free guidance scale (1 disables CFG); the guided velocity is trained (``train_cfg``).
    cfg_scale: float = 1.0
    train_cfg: bool = True
    #: Guidance-distilled FLUX transformers (``guidance_embeds``, e.g. FLUX.1-dev): the value of their guidance
    #: embedding while sampling and training (diffusers' FluxPipeline ``guidance_scale``, default 3.5). Ignored by
    #: models without the embedding (SD3, FLUX.1-schnell, the tiny pipelines).
    embedded_guidance: float = 3.5
    #: The negative prompt for CFG where a row has none ("" is the unconditional prompt).
    negative_prompt: str = ""
    #: Flow-GRPO's ``timestep_fraction``: the first ``int(timestep_fraction * train_steps)`` SDE steps are trained.
    timestep_fraction: float = 1.0
    #: Flow-GRPO-Fast: SDE only on ``sde_window_size`` steps from ``sde_window_start`` (0: every trainable step).
    sde_window_size: int = 0
    sde_window_start: int = 0
    #: Draw the window's start uniformly in ``[0, sde_window_start]`` each training step (as the reference).
    sde_window_random: bool = True
    #: The samples of a prompt group start from one initial noise (Flow-GRPO's ``same_latent``, DanceGRPO's and
    #: MixGRPO's ``init_same_noise``). ``null``: on for DanceGRPO and MixGRPO (their recipes), off otherwise.
    same_initial_noise: bool | None = None
    #: KL to the reference on the step means, ``kl_coef * mean_t ||mu - mu_ref||^2 / (2 std_dev_t^2)``: with
    #: ``kl_form: flow_grpo`` (default) ``kl_coef`` is Flow-GRPO's ``beta``; ``exact`` divides by the transition's
    #: variance instead (the exact KL of the two Gaussian steps: ``flow_grpo``'s divided by ``sigma - sigma_next``).
    kl_coef: float = 0.0
    kl_form: str = "flow_grpo"
    #: Image size in pixels (0: the model's default).
    height: int = 0
    width: int = 0
    #: The reward manager scoring the images (registered name; D2's ``image`` manager by default).
    reward_manager: str = "image"
    mix_grpo: MixGRPOConfig = field(default_factory=MixGRPOConfig)
    dance_grpo: DanceGRPOConfig = field(default_factory=DanceGRPOConfig)
    ema: EMAConfig = field(default_factory=EMAConfig)
    #: ``flow_grpo`` (the SDE-step PPO loss; with mix_grpo / dance_grpo / sde_window_size its variants) or
    #: ``diffusion_nft`` (forward-process loss on clean samples; options in ``nft``). docs/diffusion.md.
    algorithm: str = "flow_grpo"
    nft: DiffusionNFTConfig = field(default_factory=DiffusionNFTConfig)

    def shares_initial_noise(self) -> bool:
        """Whether the samples of a prompt group start from one noise (``same_initial_noise`` resolved)."""
        if self.same_initial_noise is not None:
            return bool(self.same_initial_noise)
        return bool(self.dance_grpo.enable or self.mix_grpo.enable)

    def ema_settings(self) -> tuple[bool, float, int]:
        """``(enabled, decay, update_interval)`` with the algorithm's defaults filled in."""
        nft = self.algorithm == "diffusion_nft"
        enabled = self.ema.enable if self.ema.enable is not None else nft
        interval = self.ema.update_interval if self.ema.update_interval is not None else (1 if nft else 8)
        return bool(enabled), float(self.ema.decay), int(interval)


@dataclass
class DiffusersRolloutConfig:
    """``rollout.diffusers``: rollout options (the sampler settings live in ``trainer.flow_grpo`` and are copied
    here by the trainer)."""

    #: Images generated per forward pass (rows of a request batch are cut into chunks of this size).
    max_batch_size: int = 64
    #: Text embeddings kept per distinct prompt string (LRU; 0 keeps none across calls). Each call encodes every
    #: distinct prompt once; the text encoder is frozen (only the transformer trains), so entries never go stale.
    #: Memory: one entry is ``L x D`` floats (SD3.5 333 x 4096: 5.5 MB on the rollout device).
    text_cache_size: int = 64
    #: Models whose prompts have their own lengths (QwenImage): the text embeddings of every image are right-padded
    #: to this many tokens (with a mask), so batches from different calls and ranks line up. 0: the flow_grpo
    #: trainer sets it to the longest prompt or negative prompt of the data (a rollout built directly pads each
    #: call to its longest prompt). A longer prompt is an error naming this key.
    text_length: int = 0
    #: Filled in by the flow_grpo trainer; a rollout built directly gets the defaults.
    sampler: FlowGRPOConfig = field(default_factory=FlowGRPOConfig)


@dataclass
class VllmOmniRolloutConfig(DiffusersRolloutConfig):
    """``rollout.vllm_omni``: the ``diffusers`` rollout's options (``max_batch_size``: rows per vllm-omni request;
    ``text_length``; ``text_cache_size`` is unused: vllm-omni's worker encodes the prompts) and ``engine_kwargs``,
    vllm-omni's engine arguments passed to its ``Omni(...)`` (e.g. ``{enforce_eager: true}``). The sampler
    settings are ``trainer.flow_grpo``'s, as for ``diffusers``. docs/diffusion.md, "Rollouts"."""

    #: Keyword arguments for ``vllm_omni.entrypoints.omni.Omni`` (its engine arguments). ``model``,
    #: ``custom_pipeline_args`` and ``worker_extension_cls`` are the rollout's own and refused here.
    engine_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class DiffusersEngineConfig(FSDPConfig):
    """``actor.diffusers``: the FSDP2 options of engine-fsdp's ``fsdp`` block (the engine reuses that engine's
    machinery); ``shared_prompt`` does not apply to images."""


# ---------------------------------------------------------------------------- numbers checked at start-up

#: ``key -> (low, high, low_open, high_open)`` for the numeric keys of the diffusion blocks (``None``: unbounded).
RANGES: dict[str, tuple[float | None, float | None, bool, bool]] = {
    "noise_level": (0, None, False, False),
    "noise_level_min": (0, None, False, False),
    "train_steps": (1, None, False, False),
    "eval_steps": (1, None, False, False),
    "cfg_scale": (1, None, False, False),
    "embedded_guidance": (0, None, False, False),
    "timestep_fraction": (0, 1, True, False),
    "sde_window_size": (0, None, False, False),
    "sde_window_start": (0, None, False, False),
    "kl_coef": (0, None, False, False),
    "height": (0, None, False, False),
    "width": (0, None, False, False),
    "mix_grpo.window_size": (1, None, False, False),
    "mix_grpo.shift_interval": (1, None, False, False),
    "mix_grpo.stride": (0, None, False, False),
    "dance_grpo.noise_level": (0, None, False, False),
    "dance_grpo.timestep_fraction": (0, 1, True, False),
    "ema.decay": (0, 1, False, True),
    "ema.update_interval": (1, None, False, False),
    "nft.beta": (0, None, True, False),
    "nft.timestep_fraction": (0, 1, True, False),
    "nft.num_timesteps": (1, None, False, False),
    "nft.t_min": (0, 1, True, True),
    "nft.t_max": (0, 1, True, True),
    "nft.adv_clip_max": (0, None, True, False),
    "nft.kl_coef": (0, None, False, False),
    "nft.old_decay_start": (0, None, False, False),
    "nft.old_decay_rate": (0, None, False, False),
    "nft.old_decay_max": (0, 1, False, True),
    # rollout.diffusers / actor.diffusers
    "max_batch_size": (1, None, False, False),
    "text_cache_size": (0, None, False, False),
    "text_length": (0, None, False, False),
}


def _numbers(obj: Any, prefix: str = "", skip: tuple[str, ...] = ()) -> list[tuple[str, Any]]:
    """``(dotted key, value)`` of every int / float field of a dataclass config, nested blocks included."""
    import dataclasses

    out: list[tuple[str, Any]] = []
    for f in dataclasses.fields(obj):
        if f.name in skip:
            continue
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            out.extend(_numbers(value, f"{prefix}{f.name}."))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out.append((f"{prefix}{f.name}", value))
    return out


def check_numbers(cfg: Any, key: str, skip: tuple[str, ...] = (), prefix: str = "") -> None:
    """A one-line :class:`~polyrl.errors.ConfigError` naming ``key.<field>`` for a number that is NaN or infinite
    or outside its range (:data:`RANGES`), for every numeric field of the block ``cfg`` (a dataclass; the fields
    named in ``skip`` left out; ``prefix``: the block's place in :data:`RANGES`, e.g. ``nft.``)."""
    import math

    from polyrl.errors import ConfigError

    for name, value in _numbers(cfg, skip=skip):
        full = f"{key}.{name}"
        if not math.isfinite(float(value)):
            raise ConfigError(f"{full}={value} must be a finite number")
        bounds = RANGES.get(prefix + name)
        if bounds is None:
            continue
        low, high, low_open, high_open = bounds
        too_low = low is not None and (value <= low if low_open else value < low)
        too_high = high is not None and (value >= high if high_open else value > high)
        if too_low or too_high:
            lo = "" if low is None else ("(" if low_open else "[") + f"{low:g}"
            hi = "" if high is None else f"{high:g}" + (")" if high_open else "]")
            where = f"in {lo}, {hi}" if low is not None and high is not None else (
                f"{'>' if low_open else '>='} {low:g}" if low is not None else f"{'<' if high_open else '<='} {high:g}")
            raise ConfigError(f"{full}={value} must be {where}")
