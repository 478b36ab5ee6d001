"""The start-up reward check: a data set none of whose rows can reach a scorer is refused in one line."""

from __future__ import annotations

import functools

import pytest

from polyrl.config.schema import DataConfig
from polyrl.errors import ConfigError
from polyrl.rewards.config import RewardConfig
from polyrl.rewards.reachability import check_rewards_reachable, needs_ground_truth, reads_argument


def uses_truth(data_source, solution_str, ground_truth, extra_info=None):
    return float(solution_str == ground_truth)


def ignores_truth(data_source, solution_str, ground_truth, extra_info=None):
    return float(len(solution_str))


def passes_truth_on(data_source, solution_str, ground_truth, extra_info=None):
    return uses_truth(data_source, solution_str, ground_truth)


def truth_in_closure(data_source, solution_str, ground_truth, extra_info=None):
    return (lambda: ground_truth)()


class Scorer:
    def __call__(self, data_source, solution_str, gt, extra_info=None):
        return float(gt is not None)


class LengthScorer:
    def __call__(self, data_source, solution_str, gt, extra_info=None):
        return 1.0


@pytest.mark.parametrize(("fn", "reads"), [
    (uses_truth, True), (ignores_truth, False), (passes_truth_on, True), (truth_in_closure, True),
    (Scorer(), True), (LengthScorer(), False), (functools.partial(uses_truth), True), (len, None),
])
def test_reads_argument(fn, reads):
    assert reads_argument(fn, 2, "ground_truth") is reads


def test_registered_functions_need_ground_truth():
    from polyrl.rewards.functions import arithmetic_score, gsm8k_score

    assert needs_ground_truth(arithmetic_score) and needs_ground_truth(gsm8k_score)
    assert not needs_ground_truth(uses_truth, {"needs_ground_truth": False})


def row(source="arithmetic", truth="3", **extra):
    out = {"prompt": [{"role": "user", "content": "1+2="}], "data_source": source, **extra}
    if truth is not None:
        out["reward_model"] = {"ground_truth": truth}
    return out


def test_reachable_rows_pass_and_one_is_enough():
    check_rewards_reachable([row()], RewardConfig(), DataConfig(), source="train")
    check_rewards_reachable([row("my_task"), row()], RewardConfig(), DataConfig(), source="train")
    # a function that never reads the ground truth needs none
    check_rewards_reachable([row("my_task", truth=None)], RewardConfig(function=f"{__file__}:ignores_truth"),
                            DataConfig(), source="train")


def test_truth_under_another_column_names_column_source_and_key():
    with pytest.raises(ConfigError) as err:
        check_rewards_reachable([row(truth=None, answer="3")] * 3, RewardConfig(), DataConfig(), source="data.train_files (t.jsonl)")
    msg = str(err.value)
    assert "\n" not in msg and "data.train_files (t.jsonl)" in msg and "'reward_model.ground_truth'" in msg
    assert "'arithmetic'" in msg and "data.ground_truth_key=answer" in msg
    # a custom function that reads it: the same refusal
    with pytest.raises(ConfigError, match="data.ground_truth_key=extra_info.answer"):
        check_rewards_reachable([row("my_task", truth=None, extra_info={"answer": "3"})],
                                RewardConfig(function=f"{__file__}:uses_truth"), DataConfig(), source="train")


def test_unknown_data_source_without_function_names_source_and_key():
    with pytest.raises(ConfigError) as err:
        check_rewards_reachable([row("my_task"), row("my_other_task")], RewardConfig(),
                                DataConfig(reward_fn_key="task"), source="data.val_files (v.jsonl)")
    msg = str(err.value)
    assert "'my_task', 'my_other_task'" in msg and "column 'task'" in msg and "reward.function" in msg
    assert "gsm8k" in msg  # the data sources that have a function
