"""An ordinary agent program written against the OpenAI API: a calculator agent in a plain loop.

Nothing in it knows about polyrl. It takes an OpenAI ``base_url`` and ``api_key`` (``client_kwargs``) and a task
row, talks to the model with the ``openai`` client, runs the ``calculator`` tool when the model calls it, and
asks again ("Number only.") when an answer holds no number, and returns a reward: 1.0 for the right number,
0.1 for answering with some number, 0.0 otherwise. polyrl's
``openai_agent`` loop calls ``run`` once per sample with the address of its local endpoint
(``agent.openai_agent.run=examples/openai_agent/calculator_agent.py:run``); the same function runs against any
OpenAI-compatible server (``polyrl serve``, vLLM, the OpenAI API) to evaluate a model.
"""

from __future__ import annotations

import ast
import json
import operator
import re

import openai

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression with + - * / and parentheses.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]},
    },
}
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.USub: operator.neg}


def calculate(expression: str) -> str:
    """The tool: arithmetic over numbers, by walking the syntax tree (never ``eval``)."""
    def value(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.operand))
        raise ValueError("only numbers, + - * / and parentheses")

    try:
        result = value(ast.parse(expression, mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError) as exc:
        return f"Error: {exc}"
    return str(int(result)) if float(result).is_integer() else str(result)


def run(client_kwargs: dict, row: dict, *, max_turns: int = 3) -> float:
    """Solve ``row`` with the model behind ``client_kwargs``; the reward."""
    client = openai.OpenAI(**client_kwargs, max_retries=0)
    messages = list(row["prompt"])
    answer = ""
    for _ in range(max_turns):
        try:
            response = client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR],
                                                      max_tokens=12)
        except openai.BadRequestError:  # e.g. the conversation outgrew the model's budget: stop here
            break
        message = response.choices[0].message
        messages.append(message)
        if not message.tool_calls:
            answer = message.content or ""
            if re.search(r"\d", answer):
                break
            messages.append({"role": "user", "content": "Number only."})  # no number yet: ask once more
            continue
        for call in message.tool_calls:
            try:
                expression = json.loads(call.function.arguments).get("expression", "")
            except (ValueError, AttributeError):
                expression = ""
            messages.append({"role": "tool", "tool_call_id": call.id, "content": calculate(str(expression))})
    numbers = re.findall(r"-?\d+", answer)
    if numbers and numbers[-1] == str(row["extra_info"]["answer"]):
        return 1.0
    return 0.1 if numbers else 0.0
