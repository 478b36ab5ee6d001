"""SGLangRollout's own logic, driven against ``RecordingEngineDouble``: a TEST DOUBLE of ``sglang.Engine`` (SGLang
does not install on a CPU machine). It records the calls the rollout makes and answers in SGLang's output format;
it generates nothing real. What is tested here is the rollout's side: validation before anything reaches the
engine, cache flushes, memory tags, threading, batching of concurrent ``agenerate`` calls, shutdown. The real
engine is exercised by test_sglang_engine.py (marker ``gpu``)."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from polyrl.config.roles import RolloutConfig
from polyrl.protocols import GenerationRequest, SamplingParams
from polyrl_rollout_sglang.config import SGLangConfig
from polyrl_rollout_sglang.rollout import SGLangRollout, SGLangVersionError, check_sglang_version


class RecordingEngineDouble:
    """Test double of ``sglang.Engine``: records calls; each input's output repeats its last prompt token."""

    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.calls: list[tuple] = []
        self.threads: set[int] = set()
        self.loop = asyncio.new_event_loop()
        self.loaded: dict[str, torch.Tensor] = {}
        self.fail_update = False

    def _record(self, *call):
        self.calls.append(call)
        self.threads.add(threading.get_ident())
        assert asyncio.get_event_loop() is self.loop  # the rollout's thread adopted the engine's loop

    def generate(self, input_ids, sampling_params, return_logprob=False, lora_path=None, image_data=None):
        self._record("generate", len(input_ids), *([lora_path[0]] if lora_path else []))
        assert lora_path is None or len(lora_path) == len(input_ids)
        assert image_data is None or len(image_data) == len(input_ids)
        self.image_data = image_data
        outs = []
        for ids, sp in zip(input_ids, sampling_params):
            toks = [ids[-1]] * min(2, sp["max_new_tokens"])
            meta = {"finish_reason": {"type": "length"}}
            if return_logprob:
                meta["output_token_logprobs"] = [(-0.5, t, None) for t in toks]
            outs.append({"output_ids": toks, "meta_info": meta})
        return outs[0] if len(outs) == 1 else outs

    def update_weights_from_tensor(self, named_tensors, flush_cache=True):
        self._record("update", [n for n, _ in named_tensors], flush_cache)
        if self.fail_update:
            return False, "no such parameter"
        self.loaded.update(named_tensors)
        return True, "Success"

    def load_lora_adapter(self, lora_name, lora_path):
        import json
        from pathlib import Path

        config = json.loads((Path(lora_path) / "adapter_config.json").read_text())
        self._record("load_lora", lora_name, config["r"], config["lora_alpha"],
                     (Path(lora_path) / "adapter_model.safetensors").exists())
        return True, "Success"

    def unload_lora_adapter(self, lora_name):
        self._record("unload_lora", lora_name)

    def flush_cache(self):
        self._record("flush")

    def release_memory_occupation(self, tags=None):
        self._record("release", tags)

    def resume_memory_occupation(self, tags=None):
        self._record("resume", tags)

    def shutdown(self):
        self._record("shutdown")


CFG = RolloutConfig(name="sglang", prompt_length=16, response_length=128, plugin_config=SGLangConfig())


@pytest.fixture
def rollout(tiny_model_dir, tiny_tokenizer):
    r = SGLangRollout(CFG, model_path=str(tiny_model_dir), tokenizer=tiny_tokenizer,
                      engine_factory=RecordingEngineDouble)
    yield r
    r.shutdown()


def _names(rollout):
    return [c[0] for c in rollout.engine.calls]


def test_generate_runs_on_one_helper_thread_and_returns_n_per_request(rollout):
    reqs = [GenerationRequest([3, 4], SamplingParams(n=2, max_new_tokens=4)), GenerationRequest([5])]
    res = rollout.generate(reqs)
    assert [(r.response_ids, r.sample_index) for r in res] == [([4, 4], 0), ([4, 4], 1), ([5, 5], 0)]
    assert res[0].log_probs == [-0.5, -0.5]
    assert rollout.engine.calls == [("generate", 3)]
    assert rollout.engine.threads and threading.get_ident() not in rollout.engine.threads
    with pytest.raises(ValueError, match="exceeds rollout.max_model_len 144"):
        rollout.generate([GenerationRequest([1] * 20, SamplingParams(max_new_tokens=128))])


def test_a_bad_bucket_reaches_no_engine_and_keeps_the_weights(rollout, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    good = ("lm_head.weight", model.lm_head.weight.detach())
    with pytest.raises(KeyError, match="'model.no_such' matches no parameter of the model at"):
        rollout.update_weights([good, ("model.no_such", torch.zeros(2))])
    with pytest.raises(ValueError, match=r"'lm_head.weight' has shape \(3,\)"):
        rollout.update_weights([("lm_head.weight", torch.zeros(3))])
    with pytest.raises(KeyError, match="model.lora.sync=merged"):
        rollout.update_weights([("model.layers.0.self_attn.q_proj.lora_A.weight", torch.zeros(2, 2))])
    assert "update" not in _names(rollout)
    rollout.update_weights([good])
    rollout.update_weights([("model.norm.weight", model.model.norm.weight.detach())])
    # each bucket loads at once without a flush; one flush before the next generation
    assert rollout.engine.calls == [("update", ["lm_head.weight"], False), ("update", ["model.norm.weight"], False)]
    rollout.generate([GenerationRequest([3])])
    rollout.generate([GenerationRequest([3])])
    assert _names(rollout)[2:] == ["flush", "generate", "generate"]


def test_an_engine_side_load_failure_is_an_error(rollout, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    rollout.engine.fail_update = True
    with pytest.raises(RuntimeError, match="SGLang failed to load 1 weights .*no such parameter"):
        rollout.update_weights([("model.norm.weight", model.model.norm.weight.detach())])
    rollout.generate([GenerationRequest([3])])
    assert "flush" not in _names(rollout)  # nothing loaded: the cache stays


def test_sleep_and_wake_release_and_resume_the_same_tags(rollout):
    rollout.sleep(1)
    rollout.sleep(1)  # already asleep: no second release
    rollout.wake_up()
    rollout.wake_up()
    rollout.sleep(2)
    rollout.generate([GenerationRequest([3])])  # generating wakes it first
    assert rollout.engine.calls[:5] == [("release", ["kv_cache", "cuda_graph"]), ("resume", ["kv_cache", "cuda_graph"]),
                                        ("release", None), ("resume", None), ("generate", 1)]


def test_without_the_memory_saver_sleep_is_a_no_op(tiny_model_dir, tiny_tokenizer):
    cfg = RolloutConfig(name="sglang", plugin_config=SGLangConfig(enable_memory_saver=False))
    r = SGLangRollout(cfg, model_path=str(tiny_model_dir), tokenizer=tiny_tokenizer, engine_factory=RecordingEngineDouble)
    assert not r.capabilities.sleep and r.engine.kwargs["enable_memory_saver"] is False
    r.sleep(1)
    r.wake_up()
    assert r.engine.calls == []
    r.shutdown()


def test_concurrent_agenerate_calls_are_batched_into_few_engine_calls(rollout):
    async def many():
        reqs = [GenerationRequest([i + 3], SamplingParams(max_new_tokens=2), request_id=str(i)) for i in range(20)]
        return await asyncio.gather(*[rollout.agenerate(r) for r in reqs])

    results = asyncio.run(many())
    assert [r[0].response_ids for r in results] == [[i + 3, i + 3] for i in range(20)]
    generate_calls = [c for c in rollout.engine.calls if c[0] == "generate"]
    assert sum(c[1] for c in generate_calls) == 20 and len(generate_calls) < 20


def test_shutdown_stops_the_engine_once_and_later_use_fails(rollout):
    rollout.shutdown()
    rollout.shutdown()
    assert _names(rollout) == ["shutdown"]
    with pytest.raises(RuntimeError, match="generate after shutdown"):
        rollout.generate([GenerationRequest([3])])


def test_untested_sglang_versions_are_refused_unless_allowed(caplog):
    check_sglang_version("0.5.3")
    with pytest.raises(SGLangVersionError, match=r"SGLang 0.4.6 is outside .*>=0.5,<0.6.*allow_untested_version"):
        check_sglang_version("0.4.6")
    with pytest.raises(SGLangVersionError):
        check_sglang_version("not-a-version")
    check_sglang_version("0.6.0", allow_untested=True)
    assert "0.6.0 is outside" in caplog.text


def test_lora_adapter_sync_loads_a_new_adapter_and_drops_the_old(tiny_model_dir, tiny_tokenizer):
    cfg = RolloutConfig(name="sglang", prompt_length=16, response_length=128,
                        plugin_config=SGLangConfig(lora_adapter=True, lora_alpha=8, max_lora_rank=4))
    r = SGLangRollout(cfg, model_path=str(tiny_model_dir), tokenizer=tiny_tokenizer, engine_factory=RecordingEngineDouble)
    try:
        assert r.capabilities.lora_adapter and r.engine.kwargs["enable_lora"] is True
        assert r.engine.kwargs["lora_target_modules"] == "all" and r.engine.kwargs["max_lora_rank"] == 4
        module = "model.layers.0.self_attn.q_proj"
        out_f, in_f = 64, 64  # q_proj of the tiny model
        a, b = torch.randn(2, in_f), torch.randn(out_f, 2)
        with pytest.raises(ValueError, match="rank 8 > rollout.sglang.max_lora_rank 4"):
            r.update_weights([(f"{module}.lora_A.weight", torch.randn(8, in_f)), (f"{module}.lora_B.weight", torch.randn(out_f, 8))])
        with pytest.raises(KeyError, match="matches no linear layer"):
            r.update_weights([("model.no_such.lora_A.weight", a)])
        r.generate([GenerationRequest([3])])
        assert [c[0] for c in r.engine.calls] == ["generate"]  # nothing staged: the base model serves
        r.update_weights([(f"{module}.lora_A.weight", a)])  # buckets of one sync: A here, B in the next
        r.update_weights([(f"{module}.lora_B.weight", b)])
        r.generate([GenerationRequest([3], SamplingParams(n=2))])
        assert r.engine.calls[1:] == [("load_lora", "polyrl-adapter-v1", 2, 8, True), ("flush",),
                                      ("generate", 2, "polyrl-adapter-v1")]
        r.update_weights([(f"{module}.lora_A.weight", a), (f"{module}.lora_B.weight", b)])
        r.generate([GenerationRequest([3])])
        assert r.engine.calls[4:] == [("load_lora", "polyrl-adapter-v2", 2, 8, True), ("unload_lora", "polyrl-adapter-v1"),
                                      ("flush",), ("generate", 1, "polyrl-adapter-v2")]
    finally:
        r.shutdown()


def test_images_reach_the_engine_beside_the_expanded_ids(rollout):
    """A vision-language request's images go to SGLang as ``image_data`` for each of its samples, next to ids
    that already hold the image tokens; a text-only batch sends none."""
    picture = object()  # a PIL image in a real run
    rollout.generate([GenerationRequest([3, 9, 9, 4], SamplingParams(n=2), multi_modal={"image": [picture]}),
                      GenerationRequest([5])])
    assert rollout.engine.image_data == [[picture], [picture], None]
    rollout.generate([GenerationRequest([5])])
    assert rollout.engine.image_data is None
