"""Multi-turn GRPO end to end: the tool_agent loop, the calculator tool, the hf rollout, real Ray.

A tiny model is warmed up with ``polyrl sft`` on transcripts of which a quarter call the calculator,
then trained with GRPO on a reward for answering with the calculator's help; the share of
trajectories that call the tool rises.
"""

from __future__ import annotations

import json
import random

import pytest

from polyrl.trainer.commands import sft, train


@pytest.fixture
def tool_task(tmp_path):
    from polyrl.agent_loops.arithmetic_task import make_tool_arithmetic_rows, sft_response_text
    from polyrl.data.synthetic import write_jsonl
    from polyrl.models.tiny import build_char_tokenizer

    tok = build_char_tokenizer()
    rows = make_tool_arithmetic_rows(600, seed=0, digits=2)
    rng = random.Random(0)
    sft_rows = [dict(r, response=sft_response_text(r, tok, use_tool=rng.random() < 0.25)) for r in rows[:512]]
    write_jsonl(sft_rows, tmp_path / "sft.jsonl")
    write_jsonl(rows[512:], tmp_path / "train.jsonl")
    reward = tmp_path / "tool_use_reward.py"
    # the answer can only come from the calculator: reward a trajectory that used it successfully
    reward.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    used = '<tool_call>{\"name\": \"calculator\"' in solution_str and 'Error' not in solution_str\n"
        "    return {'score': float(used), 'acc': float(used)}\n")
    return tmp_path, reward


def test_grpo_raises_tool_use(tool_task, tiny_model, manifest_file):
    root, reward = tool_task
    sft(manifest_file, [], [
        f"model.path={tiny_model}", f"data.train_files=[{root / 'sft.jsonl'}]", "data.train_batch_size=32",
        "data.max_prompt_length=32", "data.max_response_length=128", "actor.engine=fsdp", "actor.micro_batch_size=32",
        "actor.optim.lr=1e-2", "actor.optim.lr_warmup_steps=5", "actor.optim.weight_decay=0.0", "trainer.executor=local",
        "trainer.total_steps=80", "trainer.logger=[jsonl]", "trainer.progress_bar=false",
        f"trainer.run_dir={root / 'sft'}"])
    run = root / "grpo"
    train(manifest_file, [], [
        f"model.path={root / 'sft' / 'hf'}", f"data.train_files=[{root / 'train.jsonl'}]",
        f"reward.function={reward}:compute_score", "data.train_batch_size=8", "data.max_prompt_length=32",
        "data.max_response_length=128", "actor.engine=fsdp", "actor.ppo_mini_batch_size=8",
        "actor.micro_batch_size=64", "actor.optim.lr=1e-3", "actor.optim.weight_decay=0.0", "rollout.n=8", "rollout.temperature=0.7",
        "agent.default_loop=tool_agent", "agent.tools=[calculator]", "agent.max_turns=2",
        "trainer.executor=ray", "trainer.n_workers=1", "trainer.ray_num_cpus=2", "trainer.total_steps=6",
        "trainer.logger=[jsonl]", "trainer.progress_bar=false", f"trainer.run_dir={run}"])
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "agent/tool_use_rate" in r]
    assert len(steps) == 6
    use = [r["agent/tool_use_rate"] for r in steps]
    print("tool use per step:", use)
    assert 0.0 < use[0] < 1.0, "the warm-up should leave the model undecided"
    assert sum(use[-2:]) / 2 > use[0] + 0.1, use
    for r in steps:
        assert r["agent/turns/mean"] >= 1.0 and r["agent/truncated"] <= 1.0
        assert r["agent/tool_calls/total"] >= 1 and "agent/tool_time_s/mean" in r
        # the model tokens were sampled by the hf rollout from the weights the actor recomputes
        assert r.get("rollout/logprob_diff_mean", 0.0) < 1e-3
