"""Agent loops: concurrent single-turn loops batch into one generate call; collation layout."""

from __future__ import annotations

import pytest
import torch

from polyrl.agent_loops import BatchingClient, SingleTurnAgentLoop, collate, run_agent_loops
from polyrl.protocols import AgentLoopOutput, GenerationResult, RolloutCapabilities, SamplingParams
from polyrl.testing import AgentLoopConformance


class CountingRollout:
    """A real rollout wrapped to count generate calls."""

    capabilities = RolloutCapabilities()

    def __init__(self, inner):
        self.inner, self.calls = inner, []

    def generate(self, requests):
        self.calls.append(len(requests))
        self.budgets = [r.sampling_params.max_new_tokens for r in requests]
        return self.inner.generate(requests)


@pytest.fixture(scope="module")
def rollout(tiny_model_dir, tiny_tokenizer):
    from polyrl.config.roles import RolloutConfig
    from polyrl.rollout.hf import HFRollout

    return HFRollout(RolloutConfig(), model_path=str(tiny_model_dir), tokenizer=tiny_tokenizer)


class TestSingleTurnConformance(AgentLoopConformance):
    @pytest.fixture
    def agent_loop(self, tiny_tokenizer):
        return SingleTurnAgentLoop(tokenizer=tiny_tokenizer)

    @pytest.fixture
    def client(self, rollout):
        return BatchingClient(rollout)


def test_concurrent_loops_share_one_generate(rollout, tiny_tokenizer):
    counting = CountingRollout(rollout)
    samples = [{"prompt_ids": [5, 6, i], "uid": str(i)} for i in range(7)]
    outs = run_agent_loops(samples, SamplingParams(max_new_tokens=3, seed=0), BatchingClient(counting, 64),
                           {"single_turn": SingleTurnAgentLoop(tokenizer=tiny_tokenizer)})
    assert counting.calls == [7]
    assert [o.prompt_ids for o in outs] == [s["prompt_ids"] for s in samples]


def test_unknown_agent_name_lists_loops(rollout, tiny_tokenizer):
    with pytest.raises(KeyError, match="unknown agent loop 'tools'.*single_turn"):
        run_agent_loops([{"prompt_ids": [1], "agent_name": "tools"}], SamplingParams(), BatchingClient(rollout),
                        {"single_turn": SingleTurnAgentLoop(tokenizer=tiny_tokenizer)})


def test_collate_layout():
    outs = [AgentLoopOutput([1, 2, 3], [7, 8], [1, 0], [-0.5, 0.0]), AgentLoopOutput([4], [9, 9, 9], [1, 1, 1], [-1.0] * 3)]
    b = collate(outs, pad_token_id=0, max_prompt_length=4, max_response_length=4)
    assert b["prompts"].tolist() == [[0, 1, 2, 3], [0, 0, 0, 4]]
    assert b["responses"].tolist() == [[7, 8, 0, 0], [9, 9, 9, 0]]
    assert b["response_mask"].tolist() == [[1, 0, 0, 0], [1, 1, 1, 0]]
    assert b["attention_mask"].tolist() == [[0, 1, 1, 1, 1, 1, 0, 0], [0, 0, 0, 1, 1, 1, 1, 0]]
    assert b["position_ids"][1].tolist() == [0, 0, 0, 0, 1, 2, 3, 3]
    assert torch.equal(b["input_ids"], torch.cat([b["prompts"], b["responses"]], 1))
    assert b["rollout_log_probs"][0].tolist() == [-0.5, 0.0, 0.0, 0.0]


def test_batching_client_propagates_errors(tiny_tokenizer):
    class Broken:
        capabilities = RolloutCapabilities()

        def generate(self, requests):
            raise RuntimeError("backend down")

    with pytest.raises(RuntimeError, match="backend down"):
        run_agent_loops([{"prompt_ids": [1]}] * 2, SamplingParams(), BatchingClient(Broken()),
                        {"single_turn": SingleTurnAgentLoop(tokenizer=tiny_tokenizer)})


def test_result_type_is_protocols():
    assert GenerationResult([1], [2], [0.0]).finish_reason == "stop"


def test_batching_client_shares_budgets_and_cuts_back(rollout):
    """Multi-turn loops ask with different budgets left: one generate call, each result within its budget."""
    import asyncio

    from polyrl.protocols import GenerationRequest

    counting = CountingRollout(rollout)
    counting.max_model_len = rollout.max_model_len
    client = BatchingClient(counting, 64)
    budgets = [2, 5, 9]

    async def main():
        return await asyncio.gather(*[client.agenerate(GenerationRequest(
            [5, 6, b], SamplingParams(max_new_tokens=b, ignore_eos=True, seed=0))) for b in budgets])

    results = asyncio.run(main())
    assert counting.calls == [3] and counting.budgets == [9, 9, 9]  # one batch for the rollout
    for b, (r,) in zip(budgets, results):
        assert len(r.response_ids) == len(r.log_probs) == b and r.finish_reason == "length"


def test_run_agent_loops_never_builds_the_outputs_repr():
    """On the main thread, asyncio.run's SIGINT bookkeeping reprs the finished main task, result included; with
    tensors in the outputs (image rollouts) that cost 0.3 s per step. The outputs must not be the task's result."""
    import threading

    assert threading.current_thread() is threading.main_thread()  # where the SIGINT handler is installed
    calls = []

    class Costly:
        def __repr__(self) -> str:
            calls.append(1)
            return "Costly()"

    class Loop:
        async def run(self, sample, sampling_params, client):
            return AgentLoopOutput(prompt_ids=[1], response_ids=[2], response_mask=[1], log_probs=[0.0],
                                   extra={"payload": Costly()})

    outs = run_agent_loops([{"uid": "a"}, {"uid": "b"}], SamplingParams(), client=None, loops={"single_turn": Loop()})
    assert [type(o.extra["payload"]) for o in outs] == [Costly, Costly]
    assert calls == []
