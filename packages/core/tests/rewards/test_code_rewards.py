"""The ``code`` reward in the ``local`` sandbox (polyrl's namespace sandbox, for real): passing, failing, timing-out
and crashing programs, a program that tries to escape, the three test styles, partial credit, and at most
``reward.num_workers`` programs at once through the reward manager."""

from __future__ import annotations

import json
import os
import socket
import threading
import time

import pytest
import torch

from polyrl.batch import make_batch
from polyrl.errors import ConfigError
from polyrl.rewards.code import CodeScorer, extract_code, parse_tests, same_output, uses_code_rewards
from polyrl.rewards.config import CodeRewardConfig, RewardConfig
from polyrl.sandboxes.local import LocalSandbox
from polyrl.tools.sandbox import namespaces_available

NS_OK, NS_WHY = namespaces_available()
needs_ns = pytest.mark.skipif(not NS_OK, reason=f"namespaces not permitted here: {NS_WHY}")

ADD_STDIO = {"inputs": ["1 2\n", "10 -3\n", "0 0\n"], "outputs": ["3\n", "7\n", "0\n"]}
ADD_PROGRAM = "a, b = map(int, input().split())\nprint(a + b)\n"


def scorer(partial: bool = False, timeout_s: float = 2.0, slots: int = 4) -> CodeScorer:
    return CodeScorer(LocalSandbox(), CodeRewardConfig(timeout_s=timeout_s, partial_credit=partial, memory_mb=256),
                      slots=slots)


def fenced(code: str) -> str:
    return f"Here is my solution.\n```python\n{code}```\nIt reads a and b."


@needs_ns
def test_a_passing_program_scores_1():
    out = scorer()("codecontests", fenced(ADD_PROGRAM), json.dumps(ADD_STDIO))
    assert out == {"score": 1.0, "acc": 1.0, "passed": 3, "total": 3, "timeouts": 0, "errors": 0}


@needs_ns
def test_a_failing_program_scores_0_or_its_share_with_partial_credit():
    wrong = "a, b = map(int, input().split())\nprint(a + b if a >= 0 and b >= 0 else 0)\n"  # wrong on one test
    assert scorer()("apps", fenced(wrong), ADD_STDIO)["score"] == 0.0
    out = scorer(partial=True)("apps", fenced(wrong), ADD_STDIO)
    assert out["score"] == pytest.approx(2 / 3) and out["passed"] == 2 and out["acc"] == 0.0


@needs_ns
def test_a_program_that_runs_too_long_is_stopped_at_the_per_test_limit():
    slow = "import time\nfor _ in range(100):\n    time.sleep(0.1)\nprint(3)\n"
    start = time.monotonic()
    out = scorer(partial=True, timeout_s=0.5)("apps", fenced(slow), {"inputs": ["1 2\n"] * 2, "outputs": ["3\n"] * 2})
    assert out["score"] == 0.0 and out["timeouts"] == 2
    assert time.monotonic() - start < 6  # two tests of 0.5 s, not the 10 s the program wanted
    spin = scorer(timeout_s=1.0)("apps", fenced("while True:\n    pass\n"), ADD_STDIO)
    assert spin["score"] == 0.0 and spin["timeouts"] == 1  # stopped at its first test


@needs_ns
def test_a_crashing_program_scores_0_and_counts_as_an_error():
    for program in ("raise RuntimeError('boom')\n", "import sys\nsys.exit(3)\n", "def f(:\n"):
        out = scorer()("apps", fenced(program), ADD_STDIO)
        assert out["score"] == 0.0 and out["errors"] == 1, program


@needs_ns
def test_a_program_that_tries_to_escape_gets_nothing_and_changes_nothing(tmp_path):
    """The expected output is a host secret: an escape that read it would pass. The program also tries to write
    a file on the host, reach a server on the host's loopback and read the trainer's environment."""
    secret = tmp_path / "secret.txt"
    secret.write_text("s3cret-value")
    os.environ["POLYRL_CODE_SECRET"] = "env-s3cret"
    marker = tmp_path / "escaped"
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(3)
    accepted: list[bool] = []

    def accept() -> None:
        try:
            server.accept()
            accepted.append(True)
        except OSError:
            pass

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    port = server.getsockname()[1]
    program = f"""
import os, socket
found = ""
try:
    found = open({str(secret)!r}).read()
except Exception:
    pass
found = found or os.environ.get("POLYRL_CODE_SECRET", "")
try:
    open({str(marker)!r}, "w").write("x")
except Exception:
    pass
try:
    socket.create_connection(("127.0.0.1", {port}), timeout=1)
    found = found or "s3cret-value"
except Exception:
    pass
print(found)
"""
    try:
        out = scorer(timeout_s=5.0)("apps", fenced(program), {"inputs": [""], "outputs": ["s3cret-value\n"]})
        time.sleep(0.2)
    finally:
        os.environ.pop("POLYRL_CODE_SECRET", None)
        server.close()
    assert out["score"] == 0.0 and out["errors"] == 0  # it ran, and found nothing
    assert not marker.exists() and not accepted


@needs_ns
def test_function_call_and_assert_styles():
    program = "class Solution:\n    def add(self, a, b):\n        return a + b\n\ndef pair(a):\n    return (a, a)\n"
    calls = {"fn_name": "add", "inputs": [[1, 2], [2.5, 0.25]], "outputs": [3, [2.75]]}  # [2.75]: APPS' wrapping
    assert scorer()("taco", fenced(program), calls)["score"] == 1.0
    assert scorer()("taco", fenced(program), {"fn_name": "pair", "inputs": [[4]], "outputs": [[4, 4]]})["score"] == 1.0
    assert scorer()("taco", fenced(program), {"fn_name": "add", "inputs": [[1, 2]], "outputs": [4]})["score"] == 0.0
    asserts = {"asserts": ["assert Solution().add(2, 2) == 4", "assert pair(1) == (1, 1)"], "setup": "import math"}
    assert scorer()("mbpp", fenced(program), asserts)["score"] == 1.0
    out = scorer(partial=True)("mbpp", fenced(program), ["assert Solution().add(2, 2) == 5", "assert pair(1)[0] == 1"])
    assert out["score"] == 0.5


@needs_ns
def test_at_most_num_workers_programs_run_at_once_through_the_reward_manager():
    from polyrl.models.tiny import build_char_tokenizer
    from polyrl.rewards.code import build_code_scorer
    from polyrl.rewards.managers import NaiveRewardManager

    tok = build_char_tokenizer()
    reward = RewardConfig(num_workers=2, timeout_s=60)
    reward.code.timeout_s = 10.0  # generous: a loaded machine starts sandboxes slowly
    code = build_code_scorer(reward)
    slow = fenced("import time\ntime.sleep(0.3)\n" + ADD_PROGRAM)
    ids = [tok(slow, add_special_tokens=False)["input_ids"]] * 6
    width = max(map(len, ids))
    responses = torch.tensor([i + [tok.pad_token_id] * (width - len(i)) for i in ids])
    batch = make_batch({"responses": responses, "response_mask": (responses != tok.pad_token_id).long()},
                       {"data_source": ["apps"] * 6, "ground_truth": [json.dumps(ADD_STDIO)] * 6,
                        "extra_info": [{}] * 6})
    out = NaiveRewardManager(tokenizer=tok, compute_score=code, config=reward)(batch)
    assert out.extra["acc"] == [1.0] * 6
    assert code.peak_concurrency == 2  # 6 samples x 3 tests, never more than reward.num_workers at once


def test_code_is_found_in_the_response():
    assert extract_code("<think>```python\nbad\n```</think> ok ```python\nprint(1)\n``` and ```python\nprint(2)\n```") \
        == "print(2)\n"
    assert extract_code("```\nprint(3)\n```") == "print(3)\n"
    assert extract_code("print(4)") == "print(4)"


def test_outputs_compare_by_line_and_by_number():
    assert same_output("3\n", "3")
    assert same_output("1 2  \n3\n\n", "1 2\n3")
    assert same_output("0.3333333333\n", "0.33333333")
    assert not same_output("3 4\n", "3\n4\n5")
    assert not same_output("3\n", "4\n")


def test_bad_tests_say_what_is_wrong():
    with pytest.raises(ValueError, match="not JSON tests"):
        parse_tests("{nope")
    with pytest.raises(ValueError, match="2 test inputs but 1 outputs"):
        parse_tests({"inputs": ["1", "2"], "outputs": ["1"]})
    with pytest.raises(ValueError, match="need 'inputs' and 'outputs'"):
        parse_tests({"tests": []})


def test_the_registered_code_reward_serves_verls_code_data_sources():
    assert uses_code_rewards(RewardConfig(), ["apps"]) and uses_code_rewards(RewardConfig(), ["codecontests"])
    assert not uses_code_rewards(RewardConfig(), ["arithmetic", "gsm8k"])
    assert uses_code_rewards(RewardConfig(function="code"), ["anything"])


def test_the_local_sandbox_refuses_other_languages_and_bad_isolation():
    assert LocalSandbox().run("int main(){}", language="cpp").status == "sandbox_error"
    with pytest.raises(ConfigError, match="reward.code.isolation='docker'"):
        LocalSandbox(RewardConfig(code=CodeRewardConfig(isolation="docker")))
