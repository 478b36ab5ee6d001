"""Conformance suite for rollouts (``hf``, ``vllm``, ``sglang``, a plugin's own).

Subclass and provide a ``rollout`` fixture (a built rollout over a small causal LM
whose tokenizer has at least 32 tokens)::

    class TestMyRollout(RolloutConformance):
        @pytest.fixture
        def rollout(self, tiny_model_dir, tiny_tokenizer):
            return MyRollout(RolloutConfig(), model_path=str(tiny_model_dir), tokenizer=tiny_tokenizer)
"""

from __future__ import annotations

import asyncio
import math

import pytest

from polyrl.protocols import GenerationRequest, GenerationResult, Rollout, SamplingParams

PROMPTS = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]


class RolloutConformance:
    """What every rollout promises (see :class:`polyrl.protocols.Rollout`)."""

    def test_is_a_rollout(self, rollout):
        assert isinstance(rollout, Rollout)
        assert isinstance(rollout.capabilities.sleep, bool)

    def test_generate_returns_n_results_per_request_in_order(self, rollout):
        params = SamplingParams(max_new_tokens=4, n=2, seed=0)
        reqs = [GenerationRequest(p, params, request_id=f"r{i}") for i, p in enumerate(PROMPTS)]
        results = rollout.generate(reqs)
        assert len(results) == 2 * len(PROMPTS)
        for i, res in enumerate(results):
            assert isinstance(res, GenerationResult)
            assert res.request_id == f"r{i // 2}" and res.sample_index == i % 2
            assert list(res.prompt_ids) == PROMPTS[i // 2]
            assert 1 <= len(res.response_ids) <= 4
            assert res.finish_reason in ("stop", "length")
            if res.finish_reason == "length":
                assert len(res.response_ids) == 4

    def test_log_probs_are_per_token_and_valid(self, rollout):
        if not rollout.capabilities.log_probs:
            pytest.skip("rollout declares no log-probs")
        res = rollout.generate([GenerationRequest(PROMPTS[0], SamplingParams(max_new_tokens=5, seed=1))])[0]
        assert len(res.log_probs) == len(res.response_ids)
        assert all(math.isfinite(lp) and lp <= 1e-5 for lp in res.log_probs)

    def test_greedy_is_deterministic(self, rollout):
        req = GenerationRequest(PROMPTS[1], SamplingParams(temperature=0.0, max_new_tokens=5))
        assert rollout.generate([req])[0].response_ids == rollout.generate([req])[0].response_ids

    def test_max_new_tokens_respected(self, rollout):
        res = rollout.generate([GenerationRequest(PROMPTS[2], SamplingParams(max_new_tokens=2, ignore_eos=True))])[0]
        assert len(res.response_ids) == 2 and res.finish_reason == "length"

    def test_agenerate_serves_concurrent_requests(self, rollout):
        async def main():
            reqs = [GenerationRequest(p, SamplingParams(max_new_tokens=3, seed=0)) for p in PROMPTS]
            return await asyncio.gather(*[rollout.agenerate(r) for r in reqs])

        out = asyncio.run(main())
        assert [len(r) for r in out] == [1, 1, 1]
        assert [list(r[0].prompt_ids) for r in out] == PROMPTS

    def test_prompt_over_model_length_raises_value_error(self, rollout):
        with pytest.raises(ValueError):
            rollout.generate([GenerationRequest([5] * 100_000, SamplingParams(max_new_tokens=4))])
        limit = rollout.max_model_len  # declared: None (no limit) or the longest prompt + response it takes
        assert limit is None or (isinstance(limit, int) and limit > 0), limit
        if limit is not None:
            with pytest.raises(ValueError):  # one token over its own stated limit
                rollout.generate([GenerationRequest([5] * (limit - 1), SamplingParams(max_new_tokens=2))])

    def test_unknown_weight_name_raises_key_error(self, rollout):
        import torch

        with pytest.raises(KeyError):
            rollout.update_weights([("polyrl.no_such.weight", torch.zeros(2, 2))])
        assert rollout.generate([GenerationRequest(PROMPTS[0], SamplingParams(max_new_tokens=2))])

    def test_sleep_and_wake_up_keep_it_usable(self, rollout):
        rollout.sleep(1)
        rollout.wake_up()
        assert rollout.generate([GenerationRequest(PROMPTS[0], SamplingParams(max_new_tokens=2))])
