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


# ---------------------------------------------------------------- GSM8K: the "#### <number>" marker wherever it is


def test_gsm8k_answer_followed_by_long_text_still_scores():
    tail = " Let me double-check this reasoning once more." * 10  # ~460 characters after the answer
    assert len(tail) > 300
    assert gsm8k_score("openai/gsm8k", "3 + 4 = 7\n#### 7" + tail, "7")["score"] == 1.0
    # a wrong answer keeps the format score however much text follows it
    wrong = gsm8k_score("openai/gsm8k", "#### 8" + tail, "7", format_score=0.1)
    assert wrong == {"score": 0.1, "acc": 0.0}


def test_gsm8k_uses_the_last_marker_and_verl_number_forms():
    assert gsm8k_score("gsm8k", "#### 5\nno wait\n#### 7", "7")["score"] == 1.0
    assert gsm8k_score("gsm8k", "#### $1,234", "1234")["score"] == 1.0
    assert gsm8k_score("gsm8k", "#### -3.50", "-3.5")["score"] == 1.0
    assert gsm8k_score("gsm8k", "####7", "7")["score"] == 1.0
    assert gsm8k_score("gsm8k", "no marker, answer 7", "7") == {"score": 0.0, "acc": 0.0}


def test_reward_file_with_a_syntax_error_names_file_and_line(tmp_path):
    import pytest

    from polyrl.errors import ConfigError
    from polyrl.rewards import load_compute_score

    bad = tmp_path / "bad_reward.py"
    bad.write_text("def compute_score(a, b, c, d=None):\n    return 1.0\n\ndef oops(:\n    pass\n")
    with pytest.raises(ConfigError, match=r"bad_reward.py line 4: syntax error"):
        load_compute_score(f"{bad}:compute_score")
    bad.write_text("import json\nraise RuntimeError('no key')\n")
    with pytest.raises(ConfigError, match=r"bad_reward.py line 2 failed: RuntimeError: no key"):
        load_compute_score(f"{bad}:compute_score")


# ---------------------------------------------------------------- verl's default_compute_score dispatch


@pytest.mark.parametrize("source,solution,truth,score", [
    ("openai/gsm8k", "so #### 72", "72", 1.0),
    ("lighteval/MATH", "the answer is $\\boxed{\\frac{1}{2}}$", "\\frac12", 1.0),
    ("DigitalLearningGmbH/MATH-lighteval", "\\boxed{0.5}", "\\frac{1}{2}", 1.0),
    ("HuggingFaceH4/MATH-500", "\\boxed{3}", "4", 0.0),
    ("math_dapo", "work...\nAnswer: 204", "204", 1.0),
    ("math", "Answer: 12", "13", -1.0),
    ("aime_2024", "\\boxed{33}", "33", 1.0),
    ("hiyouga/geometry3k", "<think>angles</think> so \\boxed{30}", "30", 1.0),
    ("hiyouga/geometry3k", "\\boxed{30}", "30", 0.9),
    ("searchR1_nq", "<answer> The Eiffel Tower </answer>", {"target": ["eiffel tower"]}, 1.0),
    ("searchR1_hotpotqa", "<answer>Paris</answer>", {"target": ["London"]}, 0.0),
])
def test_verl_data_sources_dispatch(source, solution, truth, score):
    import polyrl.rewards

    result = polyrl.rewards.default_compute_score(source, solution, truth, None, sandbox_fusion_url=None)
    assert result["score"] == pytest.approx(score)


def test_math_scoring_uses_math_verify_for_equivalent_forms():
    assert math_score("lighteval/MATH", "\\boxed{\\sqrt{8}}", "2\\sqrt{2}")["acc"] == 1.0
    assert math_score("lighteval/MATH", "\\boxed{x^2+2x+1}", "(x+1)^2")["acc"] == 1.0
    assert math_score("lighteval/MATH", "no answer here", "3")["acc"] == 0.0


def test_math_verify_from_a_worker_thread_with_a_deadline():
    """math_verify's own timeout is signal.alarm, which a non-main thread cannot use (verl #5635)."""
    import threading

    from polyrl.rewards.math_verifier import MathVerifier, MathVerifyTimeout

    verifier = MathVerifier(timeout_s=60.0)  # generous: CI machines are shared
    results: dict[str, object] = {}

    def work():
        try:
            check()
        except Exception as exc:  # shown by the assertion below
            results["error"] = repr(exc)

    def check():
        results["ok"] = verifier("$\\boxed{\\frac{2}{4}}$", "\\frac{1}{2}")
        results["wrong"] = verifier("\\boxed{7}", "8")
        # a 200-term polynomial takes math_verify about 2 s here (1000 terms: 13 s); the deadline must fire,
        # not hang (a trivial check with a tiny deadline can win the race on a busy machine)
        slow = "\\boxed{" + "+".join(f"x^{{{i}}}" for i in range(200)) + "}"
        verifier.timeout_s = 0.2
        try:
            verifier(slow, slow)
        except MathVerifyTimeout:
            results["timeout"] = True
        verifier.timeout_s = 60.0
        results["after"] = verifier("\\boxed{2}", "2")  # a fresh child process took over

    thread = threading.Thread(target=work)
    thread.start()
    thread.join(timeout=240)
    verifier.close()
    assert not thread.is_alive()
    assert results == {"ok": True, "wrong": False, "timeout": True, "after": True}, results


def test_custom_reward_function_spelling_beside_reward_function(tmp_path):
    from polyrl.errors import ConfigError
    from polyrl.rewards.config import CustomRewardFunctionConfig, RewardConfig
    from polyrl.rewards.scoring import reward_function_spec

    f = tmp_path / "mine.py"
    f.write_text("def my_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.25\n")
    verl_style = RewardConfig(custom_reward_function=CustomRewardFunctionConfig(path=str(f), name="my_score"))
    assert load_compute_score(verl_style)("d", "s", "g") == 0.25
    both = RewardConfig(function=f"{f}:my_score", custom_reward_function=CustomRewardFunctionConfig(path=str(f),
                                                                                                   name="my_score"))
    assert reward_function_spec(both) == f"{f}:my_score"
    default_name = RewardConfig(custom_reward_function=CustomRewardFunctionConfig(path=str(f)))
    assert reward_function_spec(default_name) == f"{f}:compute_score"
    clash = RewardConfig(function="gsm8k", custom_reward_function=CustomRewardFunctionConfig(path=str(f)))
    with pytest.raises(ConfigError, match="reward.function='gsm8k' and reward.custom_reward_function"):
        load_compute_score(clash)
    assert load_compute_score(RewardConfig()) is default_compute_score
