"""``reward.combine`` (weighted sum, rule-gated, user function, per data source) over real component scores, and
the built-in judge-output parsers."""

from __future__ import annotations

import pytest
import torch

from polyrl.batch import make_batch
from polyrl.errors import ConfigError
from polyrl.protocols import RewardOutput
from polyrl.reward_models.parsers import parse_boxed, parse_json, parse_score_line
from polyrl.rewards.combine import ComponentScores, RewardComposer
from polyrl.rewards.config import CombineConfig

RULE = [1.0, 0.0, 1.0, 0.0]
RM = [0.5, 2.0, -1.0, 0.25]


def _batch(sources=("a", "a", "b", "b")):
    responses = torch.ones(4, 3, dtype=torch.long)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]])
    return make_batch({"responses": responses, "response_mask": mask},
                      {"data_source": list(sources), "extra_info": [{"i": i} for i in range(4)]})


def _rule(batch):
    from polyrl.batch import non_tensor

    rows = [int(info["i"]) for info in non_tensor(batch, "extra_info", None)]
    scores = torch.zeros(len(rows), 3)
    scores[:, 0] = torch.tensor([RULE[i] for i in rows])
    return RewardOutput(scores, {"acc": [RULE[i] for i in rows]}, {})


class _Model:
    name = "rm"

    def __call__(self, batch):
        from polyrl.batch import non_tensor

        return ComponentScores([RM[int(info["i"])] for info in non_tensor(batch, "extra_info", None)])


def _scores(combine: CombineConfig) -> list[float]:
    out = RewardComposer(rule=_rule, models=[_Model()], combine=combine)(_batch())
    return out.extra["score"]


def test_weighted_sum_gate_function_and_per_data_source(tmp_path):
    assert _scores(CombineConfig()) == RM  # the reward model alone by default
    assert _scores(CombineConfig(weights={"rule": 1.0, "rm": 0.5})) == pytest.approx(
        [r + 0.5 * m for r, m in zip(RULE, RM)])
    # gated by the rule: the model's score counts only where the rule passes
    assert _scores(CombineConfig(mode="gate")) == pytest.approx([1.5, 0.0, 0.0, 0.0])
    fn = tmp_path / "mix.py"
    fn.write_text("def mix(scores, data_source, extra_info):\n    return scores['rm'] * 10 + extra_info['i']\n")
    assert _scores(CombineConfig(mode="function", function=f"{fn}:mix")) == pytest.approx([5.0, 21.0, -8.0, 5.5])
    per = CombineConfig(per_data_source={"b": {"weights": {"rule": 1.0}}})
    assert _scores(per) == pytest.approx([0.5, 2.0, 1.0, 0.0])


def test_each_component_is_logged_and_the_score_sits_on_the_last_token():
    out = RewardComposer(rule=_rule, models=[_Model()], combine=CombineConfig(weights={"rule": 1, "rm": 1}))(_batch())
    assert out.metrics["reward/rm/mean"] == pytest.approx(sum(RM) / 4)
    assert out.metrics["reward/rule/max"] == 1.0 and out.metrics["reward/rm/min"] == -1.0
    assert out.metrics["reward/rm/failures"] == 0.0
    assert out.token_level_scores[1].tolist() == [0.0, 2.0, 0.0]  # its response ends at the second token
    assert out.extra["acc"] == RULE


def test_bad_combine_keys_name_the_key():
    with pytest.raises(ConfigError, match=r"reward.combine.weights.judge: no reward component 'judge'"):
        _scores(CombineConfig(weights={"judge": 1.0}))
    with pytest.raises(ConfigError, match=r"reward.combine.mode='max'"):
        _scores(CombineConfig(mode="max"))
    with pytest.raises(ConfigError, match=r"reward.combine.per_data_source.b.weight: unknown key"):
        _scores(CombineConfig(per_data_source={"b": {"weight": {"rule": 1.0}}}))


def test_judge_parsers_read_the_last_verdict_and_nothing_else():
    assert parse_score_line("thinking... Score: 0\nfinal score = 7.5") == 7.5
    assert parse_score_line("no verdict here") is None
    assert parse_boxed("so \\boxed{3/4}") == 0.75 and parse_boxed("\\boxed{x}") is None and parse_boxed("1") is None
    assert parse_json('{"score": 2} then {"why": "x", "score": 4}') == 4.0
    assert parse_json('{"score": "high"}') is None and parse_json("{broken") is None
