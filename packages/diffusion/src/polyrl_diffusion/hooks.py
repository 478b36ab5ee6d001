"""polyrl hooks of polyrl-diffusion. Imports nothing heavy: diffusers loads when a run selects a component."""

from polyrl import hookimpl


@hookimpl
def register_engines(register):
    register("diffusers", "polyrl_diffusion.engine:DiffusersEngine",
             description="FSDP2 over a diffusers flow-matching transformer (model type 'diffusion'; LoRA via peft)")


@hookimpl
def register_rollouts(register):
    register("diffusers", "polyrl_diffusion.rollout:DiffusersRollout",
             description="text-to-image sampling with Flow-GRPO's SDE and per-step log-probs")
    register("vllm_omni", "polyrl_diffusion.vllm_omni:VllmOmniRollout", requires_modules=["vllm_omni"],
             install="pip install vllm-omni",
             description="QwenImage sampled in vllm-omni's engine with polyrl's SDE sampler (GPU; needs vllm-omni)")


@hookimpl
def register_trainers(register):
    register("flow_grpo", "polyrl_diffusion.trainer:FlowGRPOTrainer",
             description="Flow-GRPO / -Fast / MixGRPO / DanceGRPO on the PPO loop (trainer.flow_grpo block)")


@hookimpl
def register_agent_loops(register):
    register("diffusion", "polyrl_diffusion.agent_loop:DiffusionAgentLoop",
             description="one text-to-image generation per sample (prompt sent as text)")


@hookimpl
def register_config_schemas(register):
    register("trainer.flow_grpo", "polyrl_diffusion.config:FlowGRPOConfig")
    register("rollout.diffusers", "polyrl_diffusion.config:DiffusersRolloutConfig")
    register("rollout.vllm_omni", "polyrl_diffusion.config:VllmOmniRolloutConfig")
    register("engine.diffusers", "polyrl_diffusion.config:DiffusersEngineConfig")


# ---- D2's components (algorithms.py, rewards.py): D2 owns the lines below


@hookimpl
def register_advantage_estimators(register):
    register("flow_grpo", "polyrl_diffusion.algorithms:compute_flow_grpo_outcome_advantage",
             description="Flow-GRPO: per-prompt-group normalised image reward on every trained step")


@hookimpl
def register_policy_losses(register):
    register("flow_grpo", "polyrl_diffusion.algorithms:compute_policy_loss_flow_grpo",
             description="Flow-GRPO clipped ratio per trained denoising step")


@hookimpl
def register_reward_managers(register):
    register("image", "polyrl_diffusion.rewards:ImageRewardManager", description="scores generated images")


@hookimpl
def register_reward_functions(register):
    for name in ("brightness", "colourfulness", "jpeg_compressibility", "jpeg_incompressibility", "ocr"):
        register(name, f"polyrl_diffusion.rewards:{name}", kind="image", data_sources=[name])


@hookimpl
def register_datasets(register):
    register("prompt_lines", "polyrl_diffusion.data:load_prompt_lines", suffixes=[".txt"],
             description="Flow-GRPO's prompt files: one prompt a line; data_source = the folder's name")
