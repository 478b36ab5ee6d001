"""Conformance suite for agent loops.

Subclass and provide ``agent_loop`` (built) and ``client`` (anything with
``async agenerate(request)``, e.g. ``BatchingClient(rollout)``) fixtures.
"""

from __future__ import annotations

import asyncio

from polyrl.protocols import AgentLoopOutput, SamplingParams


class AgentLoopConformance:
    """What every agent loop promises (see :class:`polyrl.protocols.AgentLoop`)."""

    def _run(self, agent_loop, client, sample=None):
        sample = sample or {"prompt_ids": [5, 6, 7], "prompt": [{"role": "user", "content": "1+1="}], "uid": "u0"}
        return asyncio.run(agent_loop.run(sample, SamplingParams(max_new_tokens=4, seed=0), client))

    def test_returns_an_output_with_aligned_lists(self, agent_loop, client):
        out = self._run(agent_loop, client)
        assert isinstance(out, AgentLoopOutput)
        assert len(out.response_mask) == len(out.response_ids)
        assert not out.log_probs or len(out.log_probs) == len(out.response_ids)
        assert set(out.response_mask) <= {0, 1}
        assert out.num_turns >= 1

    def test_prompt_ids_are_the_samples(self, agent_loop, client):
        out = self._run(agent_loop, client)
        assert list(out.prompt_ids)[:3] == [5, 6, 7]

    def test_trains_on_some_model_tokens(self, agent_loop, client):
        out = self._run(agent_loop, client)
        assert sum(out.response_mask) >= 1
