"""A multi-turn task a tiny model can only solve with the ``calculator`` tool (quickstart-agent, tests).

Rows ask for the product of two numbers too long to memorise (``"123*456="``); a
right answer needs a ``calculator`` call (hermes format) and the tool's result
copied into the final turn. ``compute_score`` (registered as the reward function
of data source ``tool_arithmetic``) reads the model's final answer.
"""

from __future__ import annotations

import json
import random
import re
from typing import Any

DATA_SOURCE = "tool_arithmetic"
_INT = re.compile(r"-?\d+")


def make_tool_arithmetic_rows(n: int, *, seed: int = 0, digits: int = 3, agent_name: str = "tool_agent",
                              tools: tuple[str, ...] = ("calculator",)) -> list[dict]:
    """``n`` verl-format rows ``{"prompt": [{"role": "user", "content": "123*456="}], ...}`` routed to
    ``agent_name`` with ``extra_info.tools`` listing the tools the row may use."""
    rng = random.Random(seed)
    lo, hi = 10 ** (digits - 1), 10 ** digits - 1
    rows = []
    for i in range(n):
        a, b = rng.randint(lo, hi), rng.randint(lo, hi)
        rows.append({
            "prompt": [{"role": "user", "content": f"{a}*{b}="}],
            "data_source": DATA_SOURCE,
            "agent_name": agent_name,
            "reward_model": {"style": "rule", "ground_truth": str(a * b)},
            "extra_info": {"index": i, "a": a, "b": b, "tools": list(tools)},
        })
    return rows


def tool_call_text(expression: str, name: str = "calculator") -> str:
    """The hermes call the model should make for ``expression``."""
    return "<tool_call>" + json.dumps({"name": name, "arguments": {"expression": expression}}) + "</tool_call>"


def transcript_messages(row: dict, *, use_tool: bool = True, rng: random.Random | None = None) -> list[dict]:
    """A chat transcript for ``row``: with the tool (call, result, answer) or a direct (usually wrong) guess."""
    a, b = row["extra_info"]["a"], row["extra_info"]["b"]
    answer = str(a * b)
    messages = list(row["prompt"])
    if use_tool:
        return messages + [{"role": "assistant", "content": tool_call_text(f"{a}*{b}")},
                           {"role": "tool", "content": answer},
                           {"role": "assistant", "content": answer}]
    rng = rng or random.Random(a * 1000 + b)
    guess = str(rng.randint(10 ** (len(answer) - 1), 10 ** len(answer) - 1))
    return messages + [{"role": "assistant", "content": guess}]


def sft_response_text(row: dict, tokenizer: Any, *, use_tool: bool = True) -> str:
    """The text after the prompt (``polyrl sft``'s ``response``) of a transcript, rendered by the chat
    template, without the final end-of-turn token (``polyrl sft`` appends EOS)."""
    messages = transcript_messages(row, use_tool=use_tool)
    prompt = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False)
    full = tokenizer.apply_chat_template(messages, tokenize=False)
    text = full[len(prompt):].rstrip("\n")
    eos = tokenizer.eos_token or ""
    return text[: -len(eos)] if eos and text.endswith(eos) else text


def compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> dict:
    """Correct when the last integer of the response (the model's final turn; tool output never ends a
    trajectory) is the product. ``tool_call`` says whether the response called a tool."""
    numbers = _INT.findall(solution_str)
    correct = bool(numbers) and numbers[-1] == str(ground_truth).strip() and not solution_str.rstrip().endswith(
        "</tool_call>")
    return {"score": float(correct), "acc": float(correct), "tool_call": float("<tool_call>" in solution_str)}
