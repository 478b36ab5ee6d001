"""Translation between polyrl's protocol and SGLang's engine API (pure functions; no SGLang needed)."""

from __future__ import annotations

import pytest

from polyrl.config.roles import RolloutConfig
from polyrl.protocols import GenerationRequest, SamplingParams
from polyrl_rollout_sglang.config import SGLangConfig
from polyrl_rollout_sglang.requests import (
    engine_inputs,
    engine_kwargs,
    finish_reason,
    memory_tags,
    result_from_output,
    results_from_outputs,
    sampling_dict,
)


def test_sampling_dict_maps_every_protocol_field():
    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=20, max_new_tokens=12, n=3, stop_token_ids=[5, 9],
                            ignore_eos=True, seed=11)
    out = sampling_dict(params, seed_offset=2)
    assert out == {"n": 1, "temperature": 0.7, "top_p": 0.9, "top_k": 20, "max_new_tokens": 12, "ignore_eos": True,
                   "no_stop_trim": True, "skip_special_tokens": False, "stop_token_ids": [5, 9],
                   "sampling_seed": 11 + 2 * 7919}


def test_sampling_dict_defaults_disable_filters_and_leave_the_seed_to_the_engine():
    out = sampling_dict(SamplingParams(top_k=0))
    assert out["top_k"] == -1 and out["top_p"] == 1.0
    assert "sampling_seed" not in out and "stop_token_ids" not in out


def test_every_sample_is_its_own_input_with_its_own_seed():
    reqs = [GenerationRequest([1, 2], SamplingParams(n=2, seed=3), request_id="a"),
            GenerationRequest([4], SamplingParams(n=1, seed=3), request_id="b")]
    inputs = engine_inputs(reqs)
    assert [(i.request_index, i.sample_index, i.input_ids) for i in inputs] == [(0, 0, [1, 2]), (0, 1, [1, 2]), (1, 0, [4])]
    seeds = [i.sampling_params["sampling_seed"] for i in inputs]
    assert len(set(seeds)) == 3  # a GRPO group must not share one random stream
    with pytest.raises(ValueError, match="request c: sampling_params.n=0"):
        engine_inputs([GenerationRequest([1], SamplingParams(n=0), request_id="c")])


def _out(ids, reason="stop", logps=None):
    meta = {"finish_reason": {"type": reason, "matched": ids[-1] if ids else None}}
    if logps is not None:
        meta["output_token_logprobs"] = [(lp, tok, None) for lp, tok in zip(logps, ids)]
    return {"output_ids": ids, "meta_info": meta}


def test_outputs_become_results_in_request_order():
    reqs = [GenerationRequest([1, 2], SamplingParams(n=2), request_id="a"),
            GenerationRequest([4], SamplingParams(n=1, logprobs=False), request_id="b")]
    inputs = engine_inputs(reqs)
    outs = [_out([7, 8], "stop", [-0.5, -0.25]), _out([9], "length", [-1.0]), _out([3], "abort")]
    res = results_from_outputs(reqs, inputs, outs)
    assert [(r.request_id, r.sample_index, r.response_ids, r.finish_reason) for r in res] == [
        ("a", 0, [7, 8], "stop"), ("a", 1, [9], "length"), ("b", 0, [3], "abort")]
    assert res[0].log_probs == [-0.5, -0.25] and res[0].prompt_ids == [1, 2]
    assert res[2].log_probs == []  # request b did not ask for them
    with pytest.raises(RuntimeError, match="returned 2 outputs for 3 inputs"):
        results_from_outputs(reqs, inputs, outs[:2])


def test_log_probs_that_do_not_line_up_with_the_tokens_are_an_error():
    req = GenerationRequest([1])
    with pytest.raises(RuntimeError, match="1 output_token_logprobs for 2 output tokens"):
        result_from_output(req, 0, {"output_ids": [5, 6], "meta_info": {"output_token_logprobs": [(-1.0, 5, None)]}},
                           want_logprobs=True)
    with pytest.raises(RuntimeError, match="log-prob 0 is for token 4, the output token is 5"):
        result_from_output(req, 0, {"output_ids": [5], "meta_info": {"output_token_logprobs": [(-1.0, 4, None)]}},
                           want_logprobs=True)


def test_finish_reason_forms():
    assert finish_reason({"finish_reason": {"type": "length", "length": 8}}) == "length"
    assert finish_reason({"finish_reason": "stop"}) == "stop"
    assert finish_reason({"finish_reason": None}) == "abort"
    assert finish_reason({"finish_reason": {"type": "weird"}}) == "abort"


def test_engine_kwargs_follow_the_rollout_block():
    cfg = RolloutConfig(name="sglang", prompt_length=64, response_length=32, tensor_parallel_size=2,
                        gpu_memory_utilization=0.4, dtype="bfloat16", seed=5)
    kw = engine_kwargs(cfg, SGLangConfig(max_running_requests=8, engine_kwargs={"chunked_prefill_size": 512}),
                       model_path="/m")
    assert kw["model_path"] == "/m" and kw["skip_tokenizer_init"] is True
    assert (kw["tp_size"], kw["context_length"], kw["mem_fraction_static"], kw["dtype"], kw["random_seed"]) == (
        2, 96, 0.4, "bfloat16", 5)
    assert kw["enable_memory_saver"] is True and kw["base_gpu_id"] == 0
    assert kw["max_running_requests"] == 8 and kw["chunked_prefill_size"] == 512
    assert "attention_backend" not in kw
    assert engine_kwargs(RolloutConfig(max_model_len=200), SGLangConfig(mem_fraction_static=0.7),
                         model_path="/m")["context_length"] == 200


def test_memory_tags_per_sleep_level():
    assert memory_tags(1) == ["kv_cache", "cuda_graph"]
    assert memory_tags(2) is None
    with pytest.raises(ValueError, match="sleep level 3"):
        memory_tags(3)


def test_images_travel_as_image_data_one_list_per_input():
    """A vision-language request's images (``multi_modal["image"]``) go to every one of its samples; text requests
    get ``None``; a batch without images sends no ``image_data`` at all (the text call is unchanged)."""
    from polyrl_rollout_sglang.requests import image_data_argument

    red, blue = object(), object()  # PIL images in a real run; the translation only passes them on
    reqs = [GenerationRequest([1, 2], SamplingParams(n=2), multi_modal={"image": [red, blue], "key": "k"}),
            GenerationRequest([4], SamplingParams(n=1))]
    inputs = engine_inputs(reqs)
    assert image_data_argument(inputs) == {"image_data": [[red, blue], [red, blue], None]}
    assert image_data_argument(engine_inputs([GenerationRequest([4], SamplingParams(n=2))])) == {}
