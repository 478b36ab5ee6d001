"""Multi-turn GRPO end to end: the tool_agent loop, the calculator tool, the hf rollout, real Ray.

A tiny model is warmed up with ``polyrl sft`` on transcripts of which a quarter call the calculator,
then trained with GRPO on a reward for answering with the calculator's help; the share of
trajectories that call the tool rises.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

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


#: A plugin for the runs below: tools that misbehave, and a parser that makes every turn call one of them
#: (a random tiny model would rarely call a tool by itself).
MISBEHAVING_TOOLS = '''
import threading

from polyrl import hookimpl
from polyrl.protocols import ToolResult
from polyrl.tools import ParsedTurn, ToolCall, tool


@tool
def hang(x: int) -> str:
    """Never returns.

    Args:
        x: anything.
    """
    threading.Event().wait()
    return ""


@tool
def nan_reward(x: int) -> ToolResult:
    """Returns a NaN reward.

    Args:
        x: anything.
    """
    return ToolResult("graded", reward=float("nan"))


def always(name):
    class AlwaysCalls:
        def parse(self, text):
            return ParsedTurn("", [ToolCall(name, {"x": 1})])
    return AlwaysCalls


@hookimpl
def register_tools(register):
    register("hang", hang)
    register("nan_reward", nan_reward)


@hookimpl
def register_tool_parsers(register):
    register("always_hang", always("hang"))
    register("always_nan_reward", always("nan_reward"))
'''


def _misbehaving_run(tmp_path, base_overrides, tool: str) -> tuple[subprocess.CompletedProcess, Path]:
    (tmp_path / "misbehaving_tools.py").write_text(MISBEHAVING_TOOLS)
    manifest = tmp_path / "polyrl-tools.toml"
    manifest.write_text('[plugins]\nrequire = ["polyrl-engine-fsdp>=0.1,<0.2"]\nmodules = ["misbehaving_tools"]\n')
    run = tmp_path / f"run-{tool}"
    overrides = [o for o in base_overrides if not o.startswith(("trainer.run_dir", "trainer.total_steps",
                                                                "data.max_response_length", "data.train_batch_size",
                                                                "rollout.n"))]
    overrides += [f"trainer.run_dir={run}", "trainer.total_steps=1", "trainer.executor=local",
                  "trainer.val_before_train=false", "data.train_batch_size=2", "rollout.n=2",
                  "data.max_response_length=48", "agent.default_loop=tool_agent", f"agent.tools=[{tool}]",
                  f"agent.tool_parser=always_{tool}", "agent.tool_timeout_s=0.5", "agent.max_turns=2",
                  # half the vocabulary ends a turn, so every first turn stops (a tool is called only after a turn
                  # that stopped) instead of a random-init model's rare end-of-sequence token deciding it
                  f"rollout.stop_token_ids=[{','.join(map(str, range(10, 138)))}]"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        [str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])]))
    proc = subprocess.run([sys.executable, "-m", "polyrl", "train", "--manifest", str(manifest), *overrides],
                          env=env, capture_output=True, text=True, timeout=300)
    return proc, run


def test_a_hung_sync_tool_times_out_is_reported_and_the_run_still_exits(tmp_path, base_overrides):
    """A synchronous tool that never returns: every call times out, the metrics and a warning say threads
    hang, and ``polyrl train`` (local executor) exits after its last step instead of waiting for them."""
    proc, run = _misbehaving_run(tmp_path, base_overrides, "hang")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    step = next(r for r in rows if "agent/tools_hung" in r)
    assert step["agent/tools_hung"] >= 1 and step["agent/tool_timeouts/total"] >= 2
    assert "tool 'hang' did not return" in proc.stderr


def test_a_nan_tool_reward_is_one_line_naming_the_tool(tmp_path, base_overrides):
    proc, _ = _misbehaving_run(tmp_path, base_overrides, "nan_reward")
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert "tool 'nan_reward' returned ToolResult(reward=nan)" in last, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "reward function" not in last
