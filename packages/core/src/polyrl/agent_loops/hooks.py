"""Registers the built-in agent loops."""

from polyrl.hookspecs import hookimpl


@hookimpl
def register_agent_loops(register):
    register("single_turn", "polyrl.agent_loops.single_turn:SingleTurnAgentLoop", description="one generation")
    register("tool_agent", "polyrl.agent_loops.tool_agent:ToolAgentLoop",
             description="multi-turn generation with tool calls (agent.tools, agent.tool_parser)")
    register("stepwise", "polyrl.agent_loops.stepwise:StepwiseAgentLoop",
             description="plays a registered environment (extra_info.env), each step its own training sample")
    register("openai_agent", "polyrl.agent_loops.openai_agent:OpenAIAgentLoop",
             description="an agent program using the OpenAI API, through a local endpoint (agent.openai_agent)")


@hookimpl
def register_reward_functions(register):
    register("tool_arithmetic", "polyrl.agent_loops.arithmetic_task:compute_score", data_sources=["tool_arithmetic"],
             description="the final answer of the calculator task (quickstart-agent)")
    register("openai_agent", "polyrl.agent_loops.openai_agent:compute_score", data_sources=["openai_agent"],
             needs_ground_truth=False, description="0: the agent program's own reward is added (agent.openai_agent)")
