"""A synthetic arithmetic task in verl's row format, for the quickstart, tests and benchmarks."""

from __future__ import annotations

import json
import random
from collections.abc import Iterable
from pathlib import Path


def make_arithmetic_rows(n: int, *, seed: int = 0, max_operand: int = 20, ops: str = "+") -> list[dict]:
    """``n`` rows like ``{"prompt": [{"role": "user", "content": "12+7="}], "reward_model": {"ground_truth": "19"}}``.

    ``data_source`` is ``arithmetic`` (scored by the built-in ``arithmetic`` reward function).
    """
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        a, b, op = rng.randint(0, max_operand), rng.randint(0, max_operand), rng.choice(ops)
        if op == "-" and b > a:
            a, b = b, a
        answer = {"+": a + b, "-": a - b, "*": a * b}[op]
        rows.append({
            "prompt": [{"role": "user", "content": f"{a}{op}{b}="}],
            "data_source": "arithmetic",
            "reward_model": {"style": "rule", "ground_truth": str(answer)},
            "extra_info": {"index": i, "a": a, "b": b, "op": op},
        })
    return rows


def write_jsonl(rows: Iterable[dict], path: str | Path) -> Path:
    """Write rows as JSON lines."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path
