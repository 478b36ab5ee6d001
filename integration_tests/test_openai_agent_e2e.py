"""GRPO end to end through an unchanged ``openai``-client agent program: ``examples/openai_agent``'s calculator
agent trained by ``polyrl train`` (the real trainer, local executor, FSDP engine, hf rollout, a tiny model) with
the ``openai_agent`` loop.

What it shows: the program's chat completions are sampled by the rollout through the local endpoint (several per
episode: the program asks again when an answer holds no number), the merged samples are token for token what
was sampled (the actor's recomputed log-probs match the rollout's), and the program's return value is each
sample's score.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from polyrl.trainer.commands import train

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "openai_agent"


def _example():
    spec = importlib.util.spec_from_file_location("openai_agent_example_train", EXAMPLE / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(240)
def test_grpo_trains_an_openai_client_program(tmp_path, tiny_model):
    pytest.importorskip("openai")
    from polyrl.data.synthetic import write_jsonl

    example = _example()
    write_jsonl(example.make_rows(16), tmp_path / "train.jsonl")
    run = tmp_path / "run"
    train(EXAMPLE / "polyrl.toml", [], example.overrides(tiny_model, tmp_path / "train.jsonl", run, steps=2))
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "agent/model_calls/total" in r]
    assert len(steps) == 2
    for r in steps:
        # 2 prompts x 4 samples, each one run of the program; several calls in some episodes
        assert r["agent/model_calls/total"] > 8 and r["agent/turns/max"] >= 2, r
        assert sum(v for k, v in r.items() if k.startswith("agent/program_")) == 0
        assert r["agent/history_edits/total"] == 0 and r["agent/calls_not_trained/total"] == 0
        # the program's reward is the score (the data source's reward function adds 0)
        assert r["critic/score/mean"] == pytest.approx(r["agent/tool_reward/mean"])
        assert 0.0 <= r["critic/score/mean"] <= 1.0
        # the trained tokens are the sampled ones: the actor recomputes the rollout's log-probs
        assert r["rollout/logprob_diff_mean"] < 1e-3


VALUED_PROGRAM = '''
import openai


def run(client_kwargs, row):
    client = openai.OpenAI(**client_kwargs, max_retries=0)
    client.chat.completions.create(model="policy", messages=row["prompt"], max_tokens=4)
    return 0.25 + 0.5 * (row["extra_info"]["index"] % 2)  # 0.25 on even rows, 0.75 on odd ones
'''


@pytest.mark.timeout(240)
def test_validation_reports_the_programs_reward(tmp_path, tiny_model):
    """``val/openai_agent/mean@k`` is the program's reward (the data source's reward function scores 0): the
    validation score is the one training optimizes, as verl's validation reads an agent loop's own score."""
    pytest.importorskip("openai")
    from polyrl.data.synthetic import write_jsonl

    example = _example()
    write_jsonl(example.make_rows(4), tmp_path / "train.jsonl")
    write_jsonl(example.make_rows(6, seed=1), tmp_path / "val.jsonl")
    (tmp_path / "valued.py").write_text(VALUED_PROGRAM)
    run = tmp_path / "run"
    overrides = example.overrides(tiny_model, tmp_path / "train.jsonl", run, steps=1)
    overrides = [o for o in overrides if not o.startswith(("agent.openai_agent.run=", "trainer.val_before_train="))]
    train(EXAMPLE / "polyrl.toml", [], [*overrides, f"agent.openai_agent.run={tmp_path / 'valued.py'}:run",
                                        f"data.val_files=[{tmp_path / 'val.jsonl'}]", "rollout.val_n=2",
                                        "trainer.val_before_train=true", "trainer.test_freq=1"])
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    vals = [r for r in rows if "val/openai_agent/mean@2" in r]
    assert len(vals) == 2, rows  # before training and after the step
    for r in vals:  # 3 even and 3 odd rows, each sampled twice
        assert r["val/openai_agent/mean@1"] == pytest.approx(0.5)
        assert r["val/openai_agent/mean@2"] == pytest.approx(0.5) and r["val/openai_agent/pass@2"] == 1.0
