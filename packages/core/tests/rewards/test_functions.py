"""Built-in reward functions on hand-written cases."""

from __future__ import annotations

import pytest

from polyrl.rewards.functions import arithmetic_score, gsm8k_score, last_boxed, math_score, normalize_math_answer
from polyrl.rewards.scoring import default_compute_score, load_compute_score


@pytest.mark.parametrize("text,truth,ok", [
    ("19", "19", True), (" 19 and more", 19, True), ("answer: 19", "19", True), ("=19", "19", True),
    ("-3", "-3", True), ("18", "19", False), ("", "19", False), ("x19", "19", False), ("190", "19", False),
])
def test_arithmetic(text, truth, ok):
    assert arithmetic_score("arithmetic", text, truth) == {"score": float(ok), "acc": float(ok)}


def test_gsm8k_strict_and_flexible():
    assert gsm8k_score("gsm8k", "so 3+4 = 7\n#### 7", "7")["score"] == 1.0
    assert gsm8k_score("gsm8k", "#### 1,234", "1234")["score"] == 1.0
    assert gsm8k_score("gsm8k", "the answer is 7", "7")["score"] == 0.0
    assert gsm8k_score("gsm8k", "the answer is 7.", "7", method="flexible")["score"] == 1.0
    assert gsm8k_score("gsm8k", "#### 8", "7")["acc"] == 0.0


def test_math_boxed_and_normalisation():
    assert last_boxed("a \\boxed{1} then \\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    assert last_boxed("no box") is None
    assert normalize_math_answer("\\dfrac{1}{2}") == normalize_math_answer("\\frac12")
    assert normalize_math_answer("10\\%") == "10"
    assert normalize_math_answer("x = 5") == "5"
    assert normalize_math_answer("\\left( 1, 2 \\right)") == "(1,2)"
    assert normalize_math_answer("3.0") == "3"
    assert math_score("math", "so \\boxed{\\dfrac{1}{2}}", "\\frac{1}{2}")["score"] == 1.0
    assert math_score("math", "\\boxed{3}", "\\boxed{3.0}")["score"] == 1.0
    assert math_score("math", "\\boxed{4}", "3")["score"] == 0.0


def test_default_compute_score_dispatches_by_data_source():
    assert default_compute_score("openai/gsm8k", "#### 5", "5")["score"] == 1.0
    assert default_compute_score("arithmetic", "5", "5")["acc"] == 1.0
    with pytest.raises(NotImplementedError, match="no reward function registered for data_source 'nope'"):
        default_compute_score("nope", "5", "5")


def test_load_compute_score(tmp_path):
    f = tmp_path / "mine.py"
    f.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.5\n")
    assert load_compute_score(f"{f}:compute_score")("d", "s", "g") == 0.5
    assert load_compute_score("gsm8k") is gsm8k_score
    from polyrl.errors import ConfigError

    with pytest.raises(ConfigError, match="has no function 'other'"):
        load_compute_score(f"{f}:other")
    with pytest.raises(ConfigError, match="does not exist"):
        load_compute_score(str(tmp_path / "none.py:f"))
