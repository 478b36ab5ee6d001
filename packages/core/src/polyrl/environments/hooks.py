"""Registers the built-in environments (kind ``environment``) and the reward function of environment rows."""

from polyrl.hookspecs import hookimpl


@hookimpl
def register_environments(register):
    register("gridworld", "polyrl.environments.gridworld:make_gridworld",
             description="FrozenLake-like lake, seeded (size, holes); reward 1 at the goal")
    register("sokoban", "polyrl.environments.sokoban:make_sokoban",
             description="seeded generated Sokoban levels (height, width, boxes); gym-sokoban's rewards")
    register("search", "polyrl.environments.search:make_search",
             description="Search-R1 QA: <search> a local corpus (BM25, polyrl[search]), <answer> scored by search_r1")
    register("openenv", "polyrl.environments.openenv:make_openenv",
             description="an OpenEnv-style environment class named by env_kwargs.class (reset/step of observation "
                         "objects), taken as it is")


@hookimpl
def register_reward_functions(register):
    # the environment's reward reaches the batch through the stepwise loop (agent.tool_reward), not compute_score
    register("environment", "polyrl.environments:environment_score", data_source_prefixes=["env/"],
             description="0 for rows of data_source env/*: their reward is the environment's (stepwise loop)")
