"""Conformance suite for agent loops, single- and multi-turn.

Subclass and provide ``agent_loop`` (built) and ``client`` (anything with
``async agenerate(request)``, e.g. ``BatchingClient(rollout)``) fixtures. A
multi-turn loop sets ``multi_turn = True`` and may override ``sample`` (a row that
makes it call a tool with the given client) and ``min_turns``::

    class TestMyLoop(AgentLoopConformance):
        multi_turn = True

        @pytest.fixture
        def agent_loop(self, tiny_tokenizer): ...

        @pytest.fixture
        def client(self): return ScriptedClient(...)   # answers with a tool call, then a final answer
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from polyrl.protocols import AgentLoopOutput, GenerationRequest, GenerationResult, SamplingParams


class RecordingClient:
    """Wraps a client and records every request and result (the tokens the model really sampled)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.calls: list[tuple[GenerationRequest, list[GenerationResult]]] = []

    async def agenerate(self, request: GenerationRequest) -> list[GenerationResult]:
        results = await self.inner.agenerate(request)
        self.calls.append((request, list(results)))
        return results


class AgentLoopConformance:
    """What every agent loop promises (see :class:`polyrl.protocols.AgentLoop`)."""

    #: Set in a subclass whose loop interleaves model turns with tool / environment tokens.
    multi_turn: bool = False
    #: Model turns the ``sample`` must produce with the ``client`` when ``multi_turn``.
    min_turns: int = 2

    @pytest.fixture
    def sample(self) -> dict:
        """The row the suite runs (override for loops that need more fields)."""
        return {"prompt_ids": [5, 6, 7], "prompt": [{"role": "user", "content": "1+1="}], "uid": "u0"}

    def _run(self, agent_loop, client, sample, max_new_tokens: int = 4) -> AgentLoopOutput:
        budget = max_new_tokens if not self.multi_turn else max(max_new_tokens, 256)
        return asyncio.run(agent_loop.run(sample, SamplingParams(max_new_tokens=budget, seed=0), client))

    def test_returns_an_output_with_aligned_lists(self, agent_loop, client, sample):
        out = self._run(agent_loop, client, sample)
        assert isinstance(out, AgentLoopOutput)
        assert len(out.response_mask) == len(out.response_ids)
        assert not out.log_probs or len(out.log_probs) == len(out.response_ids)
        assert set(out.response_mask) <= {0, 1}
        assert out.num_turns >= 1

    def test_prompt_ids_are_the_samples(self, agent_loop, client, sample):
        out = self._run(agent_loop, client, sample)
        assert list(out.prompt_ids)[: len(sample["prompt_ids"])] == list(sample["prompt_ids"])[: len(out.prompt_ids)]

    def test_trains_on_some_model_tokens(self, agent_loop, client, sample):
        out = self._run(agent_loop, client, sample)
        assert sum(out.response_mask) >= 1

    def test_model_tokens_are_exactly_the_sampled_ones(self, agent_loop, client, sample):
        """Token exactness: the masked-in tokens are the sampled ids with their log-probs, in order, and each
        request's prompt is the sample's prompt plus everything the trajectory holds so far."""
        rec = RecordingClient(client)
        out = self._run(agent_loop, rec, sample)
        sampled = [t for _, results in rec.calls for t in results[0].response_ids]
        sampled_lp = [x for _, results in rec.calls for x in results[0].log_probs]
        trained = [t for t, m in zip(out.response_ids, out.response_mask) if m]
        assert trained == sampled
        if out.log_probs and sampled_lp:
            trained_lp = [x for x, m in zip(out.log_probs, out.response_mask) if m]
            assert trained_lp == pytest.approx(sampled_lp)
        full = list(out.prompt_ids) + list(out.response_ids)
        for request, _ in rec.calls:
            assert list(request.prompt_ids) == full[: len(request.prompt_ids)], "a turn's prompt is not a prefix"

    def test_environment_tokens_are_masked_and_have_zero_log_prob(self, agent_loop, client, sample):
        out = self._run(agent_loop, client, sample)
        if self.multi_turn:
            assert out.num_turns >= self.min_turns, "the sample/client did not make the loop take several turns"
            assert 0 in out.response_mask, "a multi-turn trajectory has tool/environment tokens (mask 0)"
        if out.log_probs:
            assert all(lp == 0.0 for lp, m in zip(out.log_probs, out.response_mask) if not m)

    def test_stays_within_the_response_budget(self, agent_loop, client, sample):
        budget = 12 if not self.multi_turn else 40
        out = asyncio.run(agent_loop.run(sample, SamplingParams(max_new_tokens=budget, seed=0), client))
        assert len(out.response_ids) <= budget
        assert out.finish_reason in ("stop", "length", "max_turns", "abort", "truncated")
