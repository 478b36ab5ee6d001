"""Built-in reward functions with verl's ``compute_score`` signature.

Each returns ``{"score": float, "acc": float}``: ``acc`` (1.0 correct / 0.0 not)
feeds accuracy metrics and validation.
"""

from __future__ import annotations

import re
from typing import Any

_INT = re.compile(r"-?\d+")


def arithmetic_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> dict:
    """Correct when the first integer in the response equals the ground truth (an integer).

    Leading whitespace and an optional ``answer:`` or ``=`` are allowed before it.
    """
    text = solution_str.strip()
    text = re.sub(r"^(answer\s*:|=)\s*", "", text, flags=re.IGNORECASE)
    match = _INT.match(text)
    correct = match is not None and int(match.group()) == int(str(ground_truth).strip())
    return {"score": float(correct), "acc": float(correct)}


def _gsm8k_extract(text: str, method: str) -> str | None:
    if method == "strict":
        found = re.findall(r"#### (\-?[0-9\.\,]+)", text)
        return found[-1].replace(",", "").replace("$", "") if found else None
    numbers = [n for n in re.findall(r"(\-?[0-9\.\,]+)", text) if n not in ("", ".")]
    return numbers[-1].replace(",", "").rstrip(".") if numbers else None


def gsm8k_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None,
                method: str = "strict", format_score: float = 0.0, score: float = 1.0) -> dict:
    """GSM8K as in verl: the answer after ``#### `` (strict) or the last number (flexible)."""
    answer = _gsm8k_extract(solution_str[-300:], method)
    if answer is None:
        return {"score": 0.0, "acc": 0.0}
    correct = answer == str(ground_truth).replace(",", "").strip()
    return {"score": score if correct else format_score, "acc": float(correct)}


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), braces balanced."""
    idx = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if idx < 0:
        return None
    if text.startswith("\\boxed ", idx):
        return text[idx + len("\\boxed ") :].split("$")[0].strip()
    start = text.find("{", idx)
    if start < 0:
        return None
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start + 1 : i]
    return None


_UNITS = ("degrees", "degree", "cm", "inches", "inch", "units", "unit", "meters", "\\%", "%", "\\$", "$")


def normalize_math_answer(answer: str) -> str:
    """Normalise a LaTeX answer for comparison: spacing, ``\\left/\\right``, ``dfrac``, units, ``x=``, ``.0``."""
    s = str(answer).strip()
    s = s.replace("\n", "").replace("\\!", "").replace("\\,", "").replace("\\;", "").replace("\\ ", "")
    s = s.replace("\\left", "").replace("\\right", "").replace("tfrac", "frac").replace("dfrac", "frac")
    s = s.replace("^{\\circ}", "").replace("^\\circ", "")
    s = re.sub(r"\\text\{\s*([^}]*)\}", r"\1", s)
    s = re.sub(r"\\mbox\{\s*([^}]*)\}", r"\1", s)
    for unit in _UNITS:
        if s.endswith(unit):
            s = s[: -len(unit)]
    s = s.strip()
    if re.fullmatch(r"[a-zA-Z]\s*=.*", s):
        s = s.split("=", 1)[1]
    s = s.replace(" ", "")
    if s.startswith("."):
        s = "0" + s
    s = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\sqrt(\d)", r"\\sqrt{\1}", s)
    if re.fullmatch(r"-?\d+\.0+", s):
        s = s.split(".")[0]
    if re.fullmatch(r"-?[\d,]+", s) and "," in s and all(len(p) == 3 for p in s.lstrip("-").split(",")[1:]):
        s = s.replace(",", "")
    if s == "0.5":
        s = "\\frac{1}{2}"
    return s


def math_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> dict:
    """MATH: the last ``\\boxed{}`` answer, normalised, equals the normalised ground truth."""
    boxed = last_boxed(solution_str)
    truth = last_boxed(str(ground_truth)) or str(ground_truth)
    correct = boxed is not None and normalize_math_answer(boxed) == normalize_math_answer(truth)
    return {"score": float(correct), "acc": float(correct)}
