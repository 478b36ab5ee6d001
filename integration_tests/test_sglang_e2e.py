"""GRPO end to end and the tool agent loop with the SGLang rollout (marker ``gpu``).

Skipped without SGLang and a CUDA GPU (SGLang has no CPU build): not run yet, see docs/rollouts/sglang.md.
"""

from __future__ import annotations

import json
import math

import pytest

pytestmark = pytest.mark.gpu
# before any fixture is built: on a CPU machine the whole module skips at once
pytest.importorskip("sglang", reason="needs SGLang (CUDA only): pip install 'polyrl-rollout-sglang[cuda]'")


def _needs_sglang_and_gpu():
    import torch

    if not torch.cuda.is_available():
        pytest.skip("SGLang needs a CUDA GPU")


@pytest.mark.parametrize("tp", [1, 2])
def test_grpo_with_sglang_rollout(base_overrides, tmp_path, tp):
    _needs_sglang_and_gpu()
    import torch

    if torch.cuda.device_count() < tp:
        pytest.skip(f"needs {tp} GPUs")
    from polyrl.trainer.commands import train

    manifest = tmp_path / "polyrl.toml"
    manifest.write_text('[plugins]\nrequire = ["polyrl-engine-fsdp>=0.1,<0.2", "polyrl-rollout-sglang>=0.1,<0.2"]\n')
    train(manifest, [], base_overrides + [
        "rollout.name=sglang", f"rollout.tensor_parallel_size={tp}", "rollout.gpu_memory_utilization=0.2",
        "trainer.executor=ray", f"trainer.n_workers={tp}", "trainer.device=cuda"])
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "critic/score/mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert math.isfinite(r["actor/pg_loss"]) and r["actor/grad_norm"] > 0
        assert r["rollout/logprob_diff_mean"] < 1e-3  # SGLang's log-probs vs the actor's on the synced weights


def test_tool_agent_on_sglang(tiny_model):
    _needs_sglang_and_gpu()
    from transformers import AutoTokenizer

    from polyrl.agent_loops import ToolAgentLoop, run_agent_loops
    from polyrl.agent_loops.arithmetic_task import make_tool_arithmetic_rows
    from polyrl.config.roles import RolloutConfig
    from polyrl.config.schema import AgentConfig
    from polyrl.plugins import get_plugin_manager
    from polyrl.protocols import SamplingParams
    from polyrl.tools import build_tools
    from polyrl_rollout_sglang.config import SGLangConfig
    from polyrl_rollout_sglang.rollout import SGLangRollout

    tok = AutoTokenizer.from_pretrained(tiny_model)
    cfg = RolloutConfig(name="sglang", prompt_length=64, response_length=160, gpu_memory_utilization=0.2,
                        plugin_config=SGLangConfig(disable_cuda_graph=True))
    rollout = SGLangRollout(cfg, model_path=str(tiny_model), tokenizer=tok)
    try:
        tools = build_tools(["calculator"], get_plugin_manager())
        loop = ToolAgentLoop(tokenizer=tok, config=AgentConfig(tools=["calculator"], max_turns=3), tools=tools)
        rows = make_tool_arithmetic_rows(32, seed=0)
        for i, r in enumerate(rows):
            r["uid"] = f"r{i}"
            ids = tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=True)
            r["prompt_ids"] = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        outs = run_agent_loops(rows, SamplingParams(max_new_tokens=160, seed=0), rollout, {"tool_agent": loop},
                               default="tool_agent")
        assert len(outs) == 32
        for out in outs:
            assert len(out.response_ids) <= 160 and len(out.log_probs) == len(out.response_ids)
    finally:
        rollout.shutdown()
