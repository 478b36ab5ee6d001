"""The built-in scorers on real data: every GSM8K reference solution, and MATH answers that correct themselves.

GSM8K is read from the workspace's copy of both splits (``../shared/data/gsm8k``, 7,473 + 1,319 problems) where it
exists, else from the subset the real-model quickstart ships (``examples/quickstart-real/data``, 600 + 150).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from polyrl.rewards.functions import gsm8k_score, math_score
from polyrl.rewards.math_verifier import math_verify_available
from polyrl.rewards.scoring import default_compute_score

REPO = Path(__file__).resolve().parents[4]
FULL = REPO.parent / "shared" / "data" / "gsm8k"
SHIPPED = REPO / "examples" / "quickstart-real" / "data"


def _gsm8k(split: str) -> list[dict]:
    if (FULL / f"{split}.jsonl").exists():
        path = FULL / f"{split}.jsonl"
    else:
        path = next(SHIPPED.glob(f"gsm8k_{split}_*.jsonl"))
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    assert rows, path
    return rows


def _truth(answer: str) -> str:
    """GSM8K's answer: the text after its last line's ``#### ``, thousands separators dropped."""
    last = answer.strip().splitlines()[-1]
    assert last.startswith("#### "), last
    return last[len("#### "):].strip().replace(",", "")


@pytest.mark.parametrize("split", ["train", "test"])
def test_gsm8k_scores_every_reference_solution_one_and_wrong_numbers_zero(split):
    rows = _gsm8k(split)
    failures = []
    for i, row in enumerate(rows):
        solution, truth = row["answer"], _truth(row["answer"])
        head = solution.rsplit("####", 1)[0]
        wrong = str(int(truth) + 1) if truth.lstrip("-").isdigit() else truth + "1"
        cases = [
            (solution, "strict", 1.0), (solution, "flexible", 1.0),
            # as verl's dispatch scores a row of data_source openai/gsm8k (strict)
            (solution, "default", 1.0),
            (f"{head}#### {wrong}", "strict", 0.0), (f"{head}#### {wrong}", "flexible", 0.0),
            (f"{head}#### {truth}5", "strict", 0.0),
            (head, "strict", 0.0),  # the reasoning without the marked answer
        ]
        for text, method, expected in cases:
            if method == "default":
                got = default_compute_score("openai/gsm8k", text, truth)
                got = got["score"] if isinstance(got, dict) else got
            else:
                got = gsm8k_score("openai/gsm8k", text, truth, method=method)["score"]
            if got != expected:
                failures.append(f"{split}[{i}] {method}: {got} != {expected} for ...{text[-60:]!r} (truth {truth})")
    assert not failures, f"{len(failures)} of {len(rows)} rows: " + "\n".join(failures[:10])


def test_gsm8k_reads_the_marked_answer_of_a_chat_model_response():
    """A response the way an instruct model writes one: prose, a ``$`` amount with a comma, then more text."""
    text = "She earns 12 * 50 / 60 = $10.\n#### $1,010.\nI hope this helps! Let me know if you have questions."
    assert gsm8k_score("openai/gsm8k", text, "1010")["score"] == 1.0
    assert gsm8k_score("openai/gsm8k", text, "10")["score"] == 0.0
    # flexible reads the last number, which here is none of the answer's: no score
    assert gsm8k_score("openai/gsm8k", "The answer is 72. Step 3 of 4.", "72", method="flexible")["score"] == 0.0
    assert gsm8k_score("openai/gsm8k", "48/2 = 24, so 48 + 24 = 72", "72", method="flexible")["score"] == 1.0


@pytest.mark.skipif(not math_verify_available(), reason="math-verify is not installed (pip install 'polyrl[math]')")
@pytest.mark.parametrize("response,truth,expected", [
    ("First \\boxed{7}. No wait, \\boxed{8}.", "8", 1.0),
    ("First \\boxed{7}. No wait, \\boxed{8}.", "7", 0.0),
    ("\\boxed{\\frac{1}{3}} is wrong; the answer is \\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("so $x = \\boxed{2}$, check: \\boxed{2+0}", "2", 1.0),
    ("\\boxed{8} ... on reflection \\boxed{9}", "\\boxed{8}", 0.0),
])
def test_math_reads_the_last_boxed_answer(response, truth, expected):
    assert math_score("lighteval/MATH", response, truth)["score"] == expected
