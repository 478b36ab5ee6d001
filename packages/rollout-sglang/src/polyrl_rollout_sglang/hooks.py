"""polyrl hooks of the SGLang rollout plugin. SGLang itself is imported only when a run builds the rollout."""

from polyrl import hookimpl


@hookimpl
def register_rollouts(register):
    register("sglang", "polyrl_rollout_sglang.rollout:SGLangRollout", description="SGLang offline engine")


@hookimpl
def register_config_schemas(register):
    register("rollout.sglang", "polyrl_rollout_sglang.config:SGLangConfig")
