"""The SGLang rollout on the real SGLang engine (marker ``gpu``).

Skipped without SGLang and a CUDA GPU: SGLang has no CPU build, so on a CPU machine (where this package was
written, 2026-11-23) none of these has run yet. Run them on a GPU machine with
``pip install -e 'packages/rollout-sglang[cuda]' && pytest packages/rollout-sglang/tests -m gpu`` and record
the result in docs/rollouts/sglang.md.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

pytestmark = pytest.mark.gpu
pytest.importorskip("sglang", reason="SGLang is not installed (CUDA only): pip install 'polyrl-rollout-sglang[cuda]'")
if not torch.cuda.is_available():  # pragma: no cover - CPU machines
    pytest.skip("SGLang needs a CUDA GPU", allow_module_level=True)

from polyrl.config.roles import RolloutConfig  # noqa: E402
from polyrl.protocols import GenerationRequest, SamplingParams  # noqa: E402
from polyrl.testing import RolloutConformance  # noqa: E402
from polyrl_rollout_sglang.config import SGLangConfig  # noqa: E402
from polyrl_rollout_sglang.rollout import SGLangRollout  # noqa: E402

CFG = RolloutConfig(name="sglang", prompt_length=64, response_length=32, gpu_memory_utilization=0.3,
                    plugin_config=SGLangConfig(disable_cuda_graph=True))
TOL = 1e-3


@pytest.fixture(scope="module")
def sglang_rollout(tiny_model_dir, tiny_tokenizer):
    rollout = SGLangRollout(CFG, model_path=str(tiny_model_dir), tokenizer=tiny_tokenizer)
    yield rollout
    rollout.shutdown()


class TestSGLangConformance(RolloutConformance):
    @pytest.fixture
    def rollout(self, sglang_rollout):
        return sglang_rollout


def _sync(rollout, engine, bucket_bytes=1 << 16):
    for bucket in engine.weights_for_rollout(bucket_bytes):
        rollout.update_weights(bucket)


def test_log_probs_match_the_fsdp_engine(sglang_rollout, tiny_model_dir):
    from polyrl.agent_loops import collate
    from polyrl.config.roles import EngineRoleConfig, ModelConfig
    from polyrl.protocols import AgentLoopOutput
    from polyrl_engine_fsdp.engine import FSDPEngine

    engine = FSDPEngine(EngineRoleConfig(model=ModelConfig(path=str(tiny_model_dir))), role="ref")
    _sync(sglang_rollout, engine)
    results = sglang_rollout.generate([GenerationRequest([5, 6, 7, 8, 9], SamplingParams(max_new_tokens=10, n=4, seed=5))])
    outs = [AgentLoopOutput(r.prompt_ids, r.response_ids, [1] * len(r.response_ids), r.log_probs) for r in results]
    batch = collate(outs, pad_token_id=0, max_prompt_length=8, max_response_length=10)
    ours = engine.infer_batch(batch)["log_probs"]
    mask = batch["response_mask"].bool()
    assert mask.sum() > 0
    assert torch.allclose(ours[mask].cpu(), batch["rollout_log_probs"][mask].cpu(), atol=TOL)


def test_generation_follows_a_weight_sync_and_a_bad_name_keeps_the_weights(sglang_rollout, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    greedy = GenerationRequest([5, 6, 7, 8], SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True))
    before = sglang_rollout.generate([greedy])[0].response_ids
    with pytest.raises(KeyError, match="matches no parameter"):
        sglang_rollout.update_weights([("model.no_such", torch.zeros(2))])
    assert sglang_rollout.generate([greedy])[0].response_ids == before
    torch.manual_seed(0)
    try:
        sglang_rollout.update_weights([("lm_head.weight", torch.randn_like(model.lm_head.weight))])
        assert sglang_rollout.generate([greedy])[0].response_ids != before
    finally:
        sglang_rollout.update_weights([(n, p.detach()) for n, p in model.named_parameters()])
    assert sglang_rollout.generate([greedy])[0].response_ids == before


def test_sleep_releases_device_memory_and_wake_up_restores_generation(sglang_rollout):
    greedy = GenerationRequest([5, 6, 7], SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True))
    before = sglang_rollout.generate([greedy])[0].response_ids
    free_awake, _ = torch.cuda.mem_get_info()
    sglang_rollout.sleep(1)
    free_asleep, _ = torch.cuda.mem_get_info()
    assert free_asleep - free_awake > 64 << 20  # the KV cache (gpu_memory_utilization=0.3) went back
    sglang_rollout.wake_up()
    assert sglang_rollout.generate([greedy])[0].response_ids == before


def test_many_agenerate_calls_in_flight(sglang_rollout):
    async def many():
        reqs = [GenerationRequest([5 + i % 7, 6], SamplingParams(max_new_tokens=6, seed=i), request_id=str(i))
                for i in range(64)]
        return await asyncio.gather(*[sglang_rollout.agenerate(r) for r in reqs])

    results = asyncio.run(many())
    assert len(results) == 64 and all(len(r) == 1 and len(r[0].log_probs) == len(r[0].response_ids) for r in results)
