"""polyrl hooks of the vLLM rollout plugin. vLLM itself is imported only when a run builds the rollout."""

from polyrl import hookimpl


@hookimpl
def register_rollouts(register):
    register("vllm", "polyrl_rollout_vllm.rollout:VLLMRollout", description="vLLM (sync batch or async engine)")


@hookimpl
def register_config_schemas(register):
    register("rollout.vllm", "polyrl_rollout_vllm.config:VLLMConfig")
