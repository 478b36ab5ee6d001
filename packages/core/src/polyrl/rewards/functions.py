"""Built-in reward functions with verl's ``compute_score`` signature.

Each returns ``{"score": float, "acc": float}``: ``acc`` (1.0 correct / 0.0 not)
feeds accuracy metrics and validation. Which data sets they score (verl's
``default_compute_score`` dispatch): docs/rewards_and_data.md.
"""

from __future__ import annotations

import logging
import re
import string
from typing import Any

log = logging.getLogger("polyrl.rewards")

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


def shapes_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> dict:
    """The shapes task (:func:`polyrl.data.synthetic.make_shape_rows`): correct when the response, stripped and
    lower-cased (a final ``.`` dropped), is the answer word."""
    answer = solution_str.strip().lower().rstrip(".").strip()
    correct = answer == str(ground_truth).strip().lower()
    return {"score": float(correct), "acc": float(correct)}


#: GSM8K's answer format: the final line ``#### <number>`` (the number may carry ``,`` and ``$``)
_GSM8K_MARKER = re.compile(r"####\s*\$?\s*(-?[0-9][0-9.,]*|-?\.[0-9]+)")
_NUMBER = re.compile(r"-?[0-9.,]*[0-9]")


def _clean_number(text: str) -> str:
    return text.replace(",", "").replace("$", "").strip().rstrip(".")


def _same_number(answer: str, truth: Any) -> bool:
    """Equal as numbers when both parse (``7.0`` == ``7``), else as cleaned strings."""
    truth_text = _clean_number(str(truth))
    try:
        return float(answer) == float(truth_text)
    except ValueError:
        return answer == truth_text


def gsm8k_extract(text: str, method: str = "strict") -> str | None:
    """The answer of a GSM8K-style response, or None.

    ``strict``: the number after the last ``####`` marker, wherever it is and whatever
    follows it. ``flexible``: the last number in the text.
    """
    if method == "strict":
        found = _GSM8K_MARKER.findall(text)
        return _clean_number(found[-1]) if found else None
    if method == "flexible":
        numbers = _NUMBER.findall(text)
        return _clean_number(numbers[-1]) if numbers else None
    raise ValueError(f"gsm8k method={method!r}: choose 'strict' or 'flexible'")


def gsm8k_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None,
                method: str = "strict", format_score: float = 0.0, score: float = 1.0) -> dict:
    """GSM8K: ``score`` when the answer (see :func:`gsm8k_extract`) equals the ground truth as a number,
    ``format_score`` when there is an answer but it is wrong, 0 without one."""
    answer = gsm8k_extract(solution_str, method)
    if answer is None:
        return {"score": 0.0, "acc": 0.0}
    correct = _same_number(answer, ground_truth)
    return {"score": float(score if correct else format_score), "acc": float(correct)}


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


#: seconds one math-verify check may take (a timed-out answer scores 0)
MATH_VERIFY_TIMEOUT_S = 30.0  # verl's math_verify default


def _verified(solution: str, truth: str) -> bool:
    from polyrl.rewards.math_verifier import MathVerifyTimeout, get_math_verifier

    try:
        return get_math_verifier(MATH_VERIFY_TIMEOUT_S)(solution, truth)
    except MathVerifyTimeout:
        log.warning("math-verify timed out after %ss on an answer; it scores 0", MATH_VERIFY_TIMEOUT_S)
        return False


def math_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> dict:
    """MATH (``lighteval/MATH``, MATH-500...): the response's answer is checked against the ground truth by
    ``math-verify`` (symbolic equality), in a child process with a time limit (:mod:`polyrl.rewards.math_verifier`).

    The answer is the response's last ``\\boxed{}`` (as verl's MATH scorer reads it: a response that corrects
    itself, "\\boxed{7}. No wait, \\boxed{8}.", answers 8); a response without one is parsed whole, as an
    expression or LaTeX."""
    truth = last_boxed(str(ground_truth)) or str(ground_truth)
    boxed = last_boxed(solution_str)
    correct = _verified(solution_str if boxed is None else "\\boxed{" + boxed + "}", truth)
    return {"score": float(correct), "acc": float(correct)}


_MINERVA_ANSWER = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")


def _dapo_normalize(answer: str) -> str:
    """A final answer for comparison: the part after the last ``=``, ``$``/``\\text{}``/``\\boxed{}`` removed,
    then :func:`normalize_math_answer`."""
    text = answer.split("=")[-1].strip()
    boxed = last_boxed(text)
    if boxed is not None:
        text = boxed
    text = re.sub(r"\\text(bf)?\{(.*?)\}", r"\2", text).replace("$", "")
    return normalize_math_answer(text)


def math_dapo_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None,
                    strict_box_verify: bool = False) -> dict:
    """DAPO-Math / AIME (verl's ``math_dapo``): 1.0 if correct, -1.0 if not.

    The answer is the last ``Answer: ...`` line (Minerva style), else the last
    ``\\boxed{}``; with ``strict_box_verify`` only the boxed answer counts. Both sides
    are normalised (:func:`normalize_math_answer`) before comparison. Returns ``score``,
    ``acc`` and ``pred`` (the extracted answer).
    """
    truth = _dapo_normalize(str(ground_truth))
    pred: str | None = None
    if not strict_box_verify:
        lines = _MINERVA_ANSWER.findall(solution_str)
        pred = lines[-1] if lines else None
    if pred is None:
        pred = last_boxed(solution_str)
    correct = pred is not None and _dapo_normalize(pred) == truth
    return {"score": 1.0 if correct else -1.0, "acc": float(correct), "pred": pred or "[INVALID]"}


_GEO3K_FORMAT = re.compile(r"<think>.*</think>.*\\boxed\{.*\}.*", re.DOTALL)


def geo3k_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None,
                format_score: float = 0.1) -> dict:
    """Geometry3K (``hiyouga/geometry3k``): ``(1 - format_score) * acc + format_score * format``.

    ``format``: the response is ``<think>...</think>`` followed by a ``\\boxed{}`` answer;
    ``acc``: the boxed answer equals the ground truth (``math-verify``).
    """
    formatted = _GEO3K_FORMAT.fullmatch(solution_str) is not None
    boxed = last_boxed(solution_str)
    correct = boxed is not None and (normalize_math_answer(boxed) == normalize_math_answer(str(ground_truth))
                                     or _verified("\\boxed{" + boxed + "}", str(ground_truth)))
    return {"score": (1.0 - format_score) * float(correct) + format_score * float(formatted),
            "acc": float(correct), "format": float(formatted)}


def normalize_qa_answer(text: str) -> str:
    """SQuAD-style normalisation: lower case, no punctuation, no articles, single spaces."""
    text = "".join(ch for ch in text.lower() if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def search_r1_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None,
                    format_score: float = 0.0, score: float = 1.0) -> dict:
    """Search-R1 QA (``searchR1_nq``, ``searchR1_hotpotqa``...): exact match of the last ``<answer>...</answer>``
    with any of ``ground_truth["target"]`` (or ``ground_truth`` itself, a string or a list), after
    :func:`normalize_qa_answer`. More than 10 answer tags quarter the score (verl's guard against tag spam);
    a wrong answer gets ``format_score``, no answer 0."""
    found = _ANSWER_TAG.findall(solution_str)
    if not found:
        return {"score": 0.0, "acc": 0.0}
    targets = ground_truth.get("target", []) if isinstance(ground_truth, dict) else ground_truth
    if isinstance(targets, str) or not hasattr(targets, "__iter__"):
        targets = [targets]
    answer = normalize_qa_answer(found[-1].strip())
    correct = any(normalize_qa_answer(str(t)) == answer for t in targets)
    if not correct:
        return {"score": float(format_score), "acc": 0.0}
    spam = solution_str.count("<answer>") > 10 or solution_str.count("</answer>") > 10
    return {"score": float(score / 4 if spam else score), "acc": 1.0}
