"""Registers the built-in reward managers and reward functions."""

from polyrl.hookspecs import hookimpl


@hookimpl
def register_reward_managers(register):
    register("naive", "polyrl.rewards.managers:NaiveRewardManager", description="one compute_score call per sample")
    register("batch", "polyrl.rewards.managers:BatchRewardManager", description="one call for the whole batch")
    register("dapo", "polyrl.rewards.managers:DAPORewardManager", description="naive + DAPO overlong penalty")


@hookimpl
def register_reward_functions(register):
    register("arithmetic", "polyrl.rewards.functions:arithmetic_score", data_sources=["arithmetic"])
    register("gsm8k", "polyrl.rewards.functions:gsm8k_score", data_sources=["openai/gsm8k", "gsm8k"])
    register("math", "polyrl.rewards.functions:math_score",
             data_sources=["lighteval/MATH", "math", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500"])
