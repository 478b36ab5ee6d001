"""The plugin's hooks: what it adds to polyrl. Keep this module light; point at the code by import string."""

from polyrl import hookimpl


@hookimpl
def register_advantage_estimators(register):
    register("sign", "polyrl_example.estimators:sign_advantage",
             description="+1 / -1 / 0 by whether a sample beats its group's mean")


@hookimpl
def register_reward_functions(register):
    register("concise", "polyrl_example.rewards:concise_score", data_sources=["example/concise"],
             description="correct answers score more when short")


@hookimpl
def register_reward_managers(register):
    register("clipped", "polyrl_example.rewards:ClippedRewardManager",
             description="one compute_score call per sample, scores clipped to [-1, 1]")
