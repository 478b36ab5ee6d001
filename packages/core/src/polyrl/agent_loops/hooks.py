"""Registers the built-in agent loops."""

from polyrl.hookspecs import hookimpl


@hookimpl
def register_agent_loops(register):
    register("single_turn", "polyrl.agent_loops.single_turn:SingleTurnAgentLoop", description="one generation")
