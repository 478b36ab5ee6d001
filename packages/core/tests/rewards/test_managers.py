"""Reward managers on real tokenized batches: scores on the last token, failures, DAPO overlong."""

from __future__ import annotations

import logging
import math

import torch

from polyrl.agent_loops import collate
from polyrl.batch import set_non_tensor
from polyrl.protocols import AgentLoopOutput
from polyrl.rewards import BatchRewardManager, DAPORewardManager, NaiveRewardManager, RewardConfig


def make_batch(tok, texts, truths):
    outs = [AgentLoopOutput(prompt_ids=[1, 2], response_ids=tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id],
                            response_mask=[1] * (len(tok(t, add_special_tokens=False)["input_ids"]) + 1)) for t in texts]
    batch = collate(outs, pad_token_id=tok.pad_token_id, max_prompt_length=4, max_response_length=12)
    set_non_tensor(batch, "data_source", ["arithmetic"] * len(texts))
    set_non_tensor(batch, "ground_truth", truths)
    set_non_tensor(batch, "extra_info", [{}] * len(texts))
    return batch


def test_naive_scores_last_valid_token(tiny_tokenizer):
    from polyrl.rewards import default_compute_score

    batch = make_batch(tiny_tokenizer, ["12", "7", "100"], ["12", "8", "100"])
    out = NaiveRewardManager(tokenizer=tiny_tokenizer, compute_score=default_compute_score)(batch)
    assert out.token_level_scores.sum(-1).tolist() == [1.0, 0.0, 1.0]
    lengths = batch["response_mask"].sum(-1)
    for i, n in enumerate(lengths.tolist()):
        assert out.token_level_scores[i, n - 1] == out.token_level_scores[i].sum()
    assert out.extra["acc"] == [1.0, 0.0, 1.0]
    assert out.metrics["reward/failures"] == 0


def test_raising_and_nan_functions_get_fallback_counted_and_logged_once(tiny_tokenizer, caplog):
    calls = []

    def flaky(data_source, solution_str, ground_truth, extra_info=None):
        calls.append(solution_str)
        if solution_str == "1":
            raise RuntimeError("boom")
        return math.nan if solution_str == "2" else 1.0

    batch = make_batch(tiny_tokenizer, ["1", "2", "3", "1"], ["0"] * 4)
    manager = NaiveRewardManager(tokenizer=tiny_tokenizer, compute_score=flaky, config=RewardConfig(fallback_score=-1.0))
    with caplog.at_level(logging.WARNING, logger="polyrl.rewards"):
        out = manager(batch)
    assert out.token_level_scores.sum(-1).tolist() == [-1.0, -1.0, 1.0, -1.0]
    assert out.metrics["reward/failures"] == 3
    assert sum("RuntimeError: boom" in r.getMessage() for r in caplog.records) == 1


def test_batch_manager_calls_once(tiny_tokenizer):
    seen = []

    def batched(sources, texts, truths, infos):
        seen.append(len(texts))
        return [float(t == g) for t, g in zip(texts, truths)]

    out = BatchRewardManager(tokenizer=tiny_tokenizer, compute_score=batched)(make_batch(tiny_tokenizer, ["4", "5"], ["4", "4"]))
    assert seen == [2] and out.token_level_scores.sum(-1).tolist() == [1.0, 0.0]


def test_dapo_overlong_penalty(tiny_tokenizer):
    cfg = RewardConfig(overlong_buffer_enable=True, overlong_buffer_len=4, overlong_penalty_factor=1.0, max_response_length=8)
    batch = make_batch(tiny_tokenizer, ["1", "1234567"], ["1", "0"])  # lengths 2 and 8 (with EOS)
    out = DAPORewardManager(tokenizer=tiny_tokenizer, compute_score=lambda *a: 0.0, config=cfg)(batch)
    assert torch.allclose(out.token_level_scores.sum(-1), torch.tensor([0.0, -1.0]))


def test_multi_turn_score_goes_on_the_last_response_token_not_the_last_model_token(tiny_tokenizer):
    tok = tiny_tokenizer
    model, tool, tail = (tok(t, add_special_tokens=False)["input_ids"] for t in ("4", " tool:9 ", "5"))
    ids = model + tool + tail
    out = AgentLoopOutput(prompt_ids=[1, 2], response_ids=ids,
                          response_mask=[1] * len(model) + [0] * len(tool) + [1] * len(tail))
    batch = collate([out], pad_token_id=tok.pad_token_id, max_prompt_length=4, max_response_length=16)
    set_non_tensor(batch, "data_source", ["x"])
    set_non_tensor(batch, "ground_truth", ["5"])
    set_non_tensor(batch, "extra_info", [{}])
    seen = []
    manager = NaiveRewardManager(tokenizer=tok, compute_score=lambda s, text, t, e: seen.append(text) or 2.0)
    scores = manager(batch).token_level_scores
    assert seen == ["4 tool:9 5"]  # tool tokens are decoded too
    assert scores[0, len(ids) - 1] == 2.0 and scores.sum() == 2.0


def test_non_number_results_are_counted_failures_with_one_warning_naming_the_function(tiny_tokenizer, caplog):
    results = {"1": None, "2": "1.0", "3": {"acc": 1.0}, "4": math.inf, "5": 2.0, "6": {"score": 0.5}}

    def odd_reward(data_source, solution_str, ground_truth, extra_info=None):
        return results[solution_str]

    batch = make_batch(tiny_tokenizer, list(results), ["0"] * len(results))
    manager = NaiveRewardManager(tokenizer=tiny_tokenizer, compute_score=odd_reward,
                                 config=RewardConfig(fallback_score=-1.0))
    with caplog.at_level(logging.WARNING, logger="polyrl.rewards"):
        out = manager(batch)
    assert out.token_level_scores.sum(-1).tolist() == [-1.0, -1.0, -1.0, -1.0, 2.0, 0.5]
    assert out.metrics["reward/failures"] == 4 and out.metrics["reward/all_failed"] == 0
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "odd_reward" in warnings[0], warnings


def test_all_failed_batch_is_loud(tiny_tokenizer, caplog):
    batch = make_batch(tiny_tokenizer, ["1", "2"], ["0", "0"])
    manager = NaiveRewardManager(tokenizer=tiny_tokenizer, compute_score=lambda *a: None)
    with caplog.at_level(logging.WARNING, logger="polyrl.rewards"):
        out = manager(batch)
    assert out.metrics["reward/all_failed"] == 1 and out.metrics["reward/failures"] == 2
    assert any(r.levelno == logging.ERROR and "every sample" in r.getMessage() for r in caplog.records)


def test_slow_rewards_time_out_and_run_in_parallel(tiny_tokenizer, caplog):
    import threading
    import time

    release = threading.Event()

    def slow_reward(data_source, solution_str, ground_truth, extra_info=None):
        if solution_str == "9":
            release.wait(30)  # hangs past the timeout
            return 1.0
        time.sleep(0.3)
        return 1.0

    batch = make_batch(tiny_tokenizer, ["1", "2", "3", "9"], ["0"] * 4)
    manager = NaiveRewardManager(tokenizer=tiny_tokenizer, compute_score=slow_reward,
                                 config=RewardConfig(timeout_s=1.0, num_workers=4, fallback_score=-2.0))
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="polyrl.rewards"):
        out = manager(batch)
    took = time.monotonic() - start
    release.set()
    assert out.token_level_scores.sum(-1).tolist() == [1.0, 1.0, 1.0, -2.0]
    assert out.metrics["reward/failures"] == 1
    assert took < 2.5, f"the step waited {took:.1f}s for a hung reward"  # 3 x 0.3 s in parallel + 1 s timeout
    assert any("timed out" in r.getMessage() and "slow_reward" in r.getMessage() for r in caplog.records)


def test_batch_manager_wrong_length_is_a_failure(tiny_tokenizer):
    manager = BatchRewardManager(tokenizer=tiny_tokenizer, compute_score=lambda *a: "oops")
    out = manager(make_batch(tiny_tokenizer, ["4", "5"], ["4", "4"]))
    assert out.metrics["reward/failures"] == 2 and out.token_level_scores.sum().item() == 0.0


def test_a_failed_sample_gets_zero_in_numeric_extra_columns(tiny_tokenizer):
    # the trainer reads `acc` with float(): a failed call (no extra fields) must not leave None there
    def score(data_source, solution_str, ground_truth, extra_info=None):
        if ground_truth == "boom":
            raise RuntimeError("boom")
        return {"score": 1.0, "acc": 1.0, "pred": solution_str}

    batch = make_batch(tiny_tokenizer, ["12", "7"], ["12", "boom"])
    out = NaiveRewardManager(tokenizer=tiny_tokenizer, compute_score=score)(batch)
    assert out.extra["acc"] == [1.0, 0.0]
    assert out.extra["pred"][1] is None
    assert out.metrics["reward/failures"] == 1


def test_a_base_exception_in_a_reward_thread_is_a_failure_not_a_hang(tiny_tokenizer):
    def score(data_source, solution_str, ground_truth, extra_info=None):
        raise SystemExit("a library gave up")

    batch = make_batch(tiny_tokenizer, ["12"], ["12"])
    out = NaiveRewardManager(tokenizer=tiny_tokenizer, compute_score=score,
                             config=RewardConfig(timeout_s=0, num_workers=2))(batch)
    assert out.metrics["reward/failures"] == 1
