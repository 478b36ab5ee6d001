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
    register("shapes", "polyrl.rewards.functions:shapes_score", data_sources=["shapes"])
    # code data sets as in verl's default_compute_score: run the response's program against the row's tests
    register("code", "polyrl.rewards.code:code_score", data_sources=["codecontests", "apps", "codeforces", "taco"],
             description="the response's program against the row's tests, in reward.sandbox")
    # data sources as in verl's default_compute_score (verl.utils.reward_score)
    register("gsm8k", "polyrl.rewards.functions:gsm8k_score", data_sources=["openai/gsm8k", "gsm8k"])
    # checked before a run starts: a MATH data source without math-verify stops with the install line
    needs_math = {"requires_modules": ["math_verify"], "install": "pip install 'polyrl[math]'"}
    register("math", "polyrl.rewards.functions:math_score",
             data_sources=["lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500"],
             **needs_math)
    register("math_dapo", "polyrl.rewards.functions:math_dapo_score",
             data_sources=["math_dapo", "math", "math_dapo_reasoning"], data_source_prefixes=["aime"])
    register("geo3k", "polyrl.rewards.functions:geo3k_score", data_sources=["hiyouga/geometry3k"], **needs_math)
    register("search_r1", "polyrl.rewards.functions:search_r1_score",
             data_sources=["searchR1_nq", "searchR1_triviaqa", "searchR1_popqa", "searchR1_hotpotqa",
                           "searchR1_2wikimultihopqa", "searchR1_musique", "searchR1_bamboogle"])
