"""Judge-output parsers: the score a generative reward model's verdict holds (kind ``judge_parser``).

A parser is a callable ``parse(text: str) -> float | None`` registered with ``register_judge_parsers``;
``reward_model.judge.parser`` picks one. ``None`` means the text holds no score: the sample gets
``reward_model.judge.fallback_score`` and counts in ``reward/<name>/failures`` (one warning names the parser).
Built in: ``score`` (the last ``Score: N``), ``boxed`` (the last ``\\boxed{N}``) and ``json`` (the ``score`` of the
last JSON object that has one). Each reads the *last* occurrence: a judge that reasons first states its
verdict at the end.
"""

from __future__ import annotations

import json
import math
import re

from polyrl.rewards.functions import last_boxed

_NUMBER = r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?"
_SCORE_LINE = re.compile(rf"\bscore\s*[:=]\s*\**\s*({_NUMBER})", re.IGNORECASE)
_FRACTION = re.compile(rf"^\s*({_NUMBER})\s*(?:/\s*({_NUMBER}))?\s*$")


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def parse_score_line(text: str) -> float | None:
    """The number of the last ``Score: N`` (or ``score = N``; any case, ``**`` allowed) in ``text``."""
    found = _SCORE_LINE.findall(text)
    return _finite(float(found[-1])) if found else None


def parse_boxed(text: str) -> float | None:
    """The number in the last ``\\boxed{...}`` (``\\boxed{7}``, ``\\boxed{0.5}``, ``\\boxed{3/4}``)."""
    inner = last_boxed(text)
    if inner is None:
        return None
    match = _FRACTION.match(inner.replace("\\", "").replace("{", "").replace("}", ""))
    if not match:
        return None
    value = float(match.group(1))
    if match.group(2) is not None:
        denominator = float(match.group(2))
        if denominator == 0:
            return None
        value /= denominator
    return _finite(value)


def parse_json(text: str) -> float | None:
    """The numeric ``score`` of the last JSON object in ``text`` that has one (``{"score": 4, "why": "..."}``)."""
    decoder = json.JSONDecoder()
    found: float | None = None
    start = text.find("{")
    while start >= 0:
        try:
            obj, end = decoder.raw_decode(text, start)
        except ValueError:
            start = text.find("{", start + 1)
            continue
        if isinstance(obj, dict):
            value = obj.get("score")
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(float(value)):
                found = float(value)
        start = text.find("{", end)
    return found
