"""polyrl-diffusion: Flow-GRPO for flow-matching text-to-image models (diffusers) on polyrl's one trainer.

Registers the rollout ``diffusers``, the engine ``diffusers`` (model type ``diffusion``), the trainer
``flow_grpo``, the agent loop ``diffusion`` and the config schema ``trainer.flow_grpo``. See docs/diffusion.md.
"""

from polyrl_diffusion.__about__ import __version__

__all__ = ["__version__"]
