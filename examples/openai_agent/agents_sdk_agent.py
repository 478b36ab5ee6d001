"""The calculator agent written with a real agent framework: the OpenAI Agents SDK (``pip install openai-agents``).

Why this framework: it is a plain Python package (no CUDA build, no model download; it installs beside polyrl),
and it talks to any OpenAI-compatible server through ``OpenAIChatCompletionsModel`` with an ``AsyncOpenAI``
client, which is exactly what polyrl's ``openai_agent`` endpoint serves. The agent below is what its docs show:
an ``Agent`` with a ``@function_tool``, run by ``Runner``; nothing in it knows about polyrl. Tracing is turned
off (it would upload traces to OpenAI).

``agent.openai_agent.run=examples/openai_agent/agents_sdk_agent.py:run``
"""

from __future__ import annotations

import re

from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
from agents.exceptions import AgentsException
from openai import APIStatusError, AsyncOpenAI

try:  # next to calculator_agent.py, as a module or as a file
    from calculator_agent import calculate
except ImportError:  # loaded by path (agent.openai_agent.run=.../agents_sdk_agent.py:run)
    import importlib.util
    from pathlib import Path

    _spec = importlib.util.spec_from_file_location("calculator_agent", Path(__file__).with_name("calculator_agent.py"))
    _module = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_module)
    calculate = _module.calculate

set_tracing_disabled(True)


@function_tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression with + - * / and parentheses.

    Args:
        expression: the expression, e.g. "3+4*2".
    """
    return calculate(expression)


async def run(client_kwargs: dict, row: dict) -> float:
    """Solve ``row`` with an Agents SDK agent on the model behind ``client_kwargs``; the reward."""
    model = OpenAIChatCompletionsModel(model="policy", openai_client=AsyncOpenAI(**client_kwargs, max_retries=0))
    system = next((m["content"] for m in row["prompt"] if m["role"] == "system"), "Use the calculator.")
    question = next(m["content"] for m in row["prompt"] if m["role"] == "user")
    agent = Agent(name="calculator", instructions=system, model=model, tools=[calculator],
                  model_settings=ModelSettings(max_tokens=96))
    try:
        result = await Runner.run(agent, question, max_turns=3)
        answer = str(result.final_output or "")
    except (AgentsException, APIStatusError):  # out of turns, or the conversation outgrew the budget
        answer = ""
    numbers = re.findall(r"-?\d+", answer)
    if numbers and numbers[-1] == str(row["extra_info"]["answer"]):
        return 1.0
    return 0.1 if numbers else 0.0
