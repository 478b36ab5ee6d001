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

from polyrl_diffusion.nft import DiffusionNFTConfig
from polyrl_engine_fsdp.config import FSDPConfig


@dataclass
class MixGRPOConfig:
    """MixGRPO: SDE on a window of ``window_size`` steps (ODE elsewhere) that moves by ``stride`` steps
    every ``shift_interval`` training steps, wrapping round at the last position."""

    enable: bool = False
    window_size: int = 4
    shift_interval: int = 10
    stride: int = 1


@dataclass
class DanceGRPOConfig:
    """DanceGRPO: one initial noise shared by the samples of a prompt group, a constant noise level, and a
    random ``timestep_fraction`` of the steps trained."""

    enable: bool = False
    noise_level: float = 0.3
    timestep_fraction: float = 0.6


@dataclass
class FlowGRPOConfig:
    """``trainer.flow_grpo``: how the rollout samples and what is trained (Flow-GRPO and its variants)."""

    #: Flow-GRPO's ``a``: the SDE's diffusion ``g = a sqrt(s / (1 - s))``; 0 makes every step ODE.
    noise_level: float = 0.7
    #: ``constant`` or ``linear`` (from ``noise_level`` to ``noise_level_min`` over the SDE steps).
    noise_schedule: str = "constant"
    noise_level_min: float = 0.0
    #: Sampler steps while training (Flow-GRPO trains with fewer steps than it evaluates with).
    train_steps: int = 10
    #: ODE sampler steps for validation images.
    eval_steps: int = 20
    #: Classifier-free guidance scale (1 disables CFG); the guided velocity is trained (``train_cfg``).
    cfg_scale: float = 1.0
    train_cfg: bool = True
    #: Guidance-distilled FLUX transformers (``guidance_embeds``, e.g. FLUX.1-dev): the value of their guidance
    #: embedding while sampling and training (diffusers' FluxPipeline ``guidance_scale``, default 3.5). Ignored by
    #: models without the embedding (SD3, FLUX.1-schnell, the tiny pipelines).
    embedded_guidance: float = 3.5
    #: The negative prompt for CFG where a row has none ("" is the unconditional prompt).
    negative_prompt: str = ""
    #: Fraction of the SDE steps of each image that is trained (a random subset, at least one).
    timestep_fraction: float = 1.0
    #: Flow-GRPO-Fast: SDE only on ``sde_window_size`` steps from ``sde_window_start`` (0: every step SDE).
    sde_window_size: int = 0
    sde_window_start: int = 0
    #: Draw the window's start uniformly in ``[0, sde_window_start]`` each training step.
    sde_window_random: bool = False
    #: KL to the reference on the step means, ``kl_coef * ||mu - mu_ref||^2 / (2 std_dev_t^2)`` (Flow-GRPO's beta).
    kl_coef: float = 0.0
    #: Image size in pixels (0: the model's default).
    height: int = 0
    width: int = 0
    #: The reward manager scoring the images (registered name; D2's ``image`` manager by default).
    reward_manager: str = "image"
    mix_grpo: MixGRPOConfig = field(default_factory=MixGRPOConfig)
    dance_grpo: DanceGRPOConfig = field(default_factory=DanceGRPOConfig)
    #: ``flow_grpo`` (the SDE-step PPO loss; with mix_grpo / dance_grpo / sde_window_size its variants) or
    #: ``diffusion_nft`` (forward-process loss on clean samples; options in ``nft``). docs/diffusion.md.
    algorithm: str = "flow_grpo"
    nft: DiffusionNFTConfig = field(default_factory=DiffusionNFTConfig)


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
    #: Filled in by the flow_grpo trainer; a rollout built directly gets the defaults.
    sampler: FlowGRPOConfig = field(default_factory=FlowGRPOConfig)


@dataclass
class DiffusersEngineConfig(FSDPConfig):
    """``actor.diffusers``: the FSDP2 options of engine-fsdp's ``fsdp`` block (the engine reuses that engine's
    machinery); ``shared_prompt`` does not apply to images."""
