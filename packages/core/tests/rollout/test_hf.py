"""The built-in hf rollout on a real tiny model: log-probs, determinism, weight updates, guards."""

from __future__ import annotations

import pytest
import torch

from polyrl.config.roles import RolloutConfig
from polyrl.protocols import GenerationRequest, SamplingParams
from polyrl.rollout.hf import HFRollout
from polyrl.testing import RolloutConformance


@pytest.fixture(scope="module")
def hf_rollout(tiny_model_dir, tiny_tokenizer):
    return HFRollout(RolloutConfig(max_batch_size=8), model_path=str(tiny_model_dir), tokenizer=tiny_tokenizer)


@pytest.mark.smoke
class TestHFRolloutConformance(RolloutConformance):
    @pytest.fixture
    def rollout(self, hf_rollout):
        return hf_rollout


def test_log_probs_match_a_forward_pass(hf_rollout, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    reqs = [GenerationRequest([5, 6, 7], SamplingParams(temperature=0.7, max_new_tokens=6, seed=3)),
            GenerationRequest([9, 10, 11, 12, 13], SamplingParams(temperature=0.7, max_new_tokens=6, seed=3))]
    for res in hf_rollout.generate(reqs):
        ids = torch.tensor([res.prompt_ids + res.response_ids])
        logits = model(ids).logits[0, len(res.prompt_ids) - 1 : -1] / 0.7
        expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(res.response_ids)[:, None]).squeeze(-1)
        assert torch.allclose(expected, torch.tensor(res.log_probs), atol=1e-4)


def test_seeded_sampling_is_reproducible(hf_rollout):
    req = GenerationRequest([5, 6, 7], SamplingParams(max_new_tokens=5, n=3, seed=11))
    a, b = hf_rollout.generate([req]), hf_rollout.generate([req])
    assert [r.response_ids for r in a] == [r.response_ids for r in b]
    assert len({tuple(r.response_ids) for r in a}) > 1  # n samples differ


def test_stop_tokens_end_samples(hf_rollout):
    greedy = hf_rollout.generate([GenerationRequest([5, 6], SamplingParams(temperature=0, max_new_tokens=4))])[0]
    stop = greedy.response_ids[1]
    res = hf_rollout.generate([GenerationRequest([5, 6], SamplingParams(temperature=0, max_new_tokens=4,
                                                                         stop_token_ids=[stop]))])[0]
    assert res.response_ids == greedy.response_ids[: greedy.response_ids.index(stop) + 1]
    assert res.finish_reason == "stop"


def test_prompt_too_long_names_request(hf_rollout):
    with pytest.raises(ValueError, match="request long-one: prompt"):
        hf_rollout.generate([GenerationRequest([1] * 2040, SamplingParams(max_new_tokens=20), request_id="long-one")])


def test_update_weights_checks_before_changing(hf_rollout):
    req = GenerationRequest([5, 6, 7], SamplingParams(temperature=0, max_new_tokens=5))
    before = hf_rollout.generate([req])[0].response_ids
    name, param = next(iter(hf_rollout.model.named_parameters()))
    saved = {n: p.detach().clone() for n, p in hf_rollout.model.named_parameters()}
    with pytest.raises(KeyError, match="matches no parameter"):
        hf_rollout.update_weights([(name, param.detach() * 0), ("no.such.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match="has shape"):
        hf_rollout.update_weights([(name, torch.zeros(3))])
    assert hf_rollout.generate([req])[0].response_ids == before  # nothing changed, still usable
    hf_rollout.update_weights([("lm_head.weight", torch.randn_like(saved["lm_head.weight"]) * 5)])
    assert hf_rollout.generate([req])[0].response_ids != before
    hf_rollout.update_weights(list(saved.items()))
    assert hf_rollout.generate([req])[0].response_ids == before


def test_chunks_of_one_call_do_not_replay_the_random_stream(tiny_model_dir, tiny_tokenizer):
    rollout = HFRollout(RolloutConfig(max_batch_size=2), model_path=str(tiny_model_dir), tokenizer=tiny_tokenizer)
    params = SamplingParams(max_new_tokens=6, seed=5, ignore_eos=True)
    results = rollout.generate([GenerationRequest([5, 6, 7], params) for _ in range(4)])  # two chunks of two
    assert [r.response_ids for r in results[:2]] != [r.response_ids for r in results[2:]]


def test_shared_prefill_samples_what_separate_prefills_sample(hf_rollout, tiny_model_dir):
    """Repeated prompts are prefilled once and their KV cache copied per sample; the samples, log-probs and
    finish reasons must be those of one prefill per sample, and match a plain forward pass."""
    from transformers import AutoModelForCausalLM

    params = SamplingParams(temperature=1.0, max_new_tokens=8, seed=5)
    # two prompts of different lengths (left padding), each repeated, interleaved with a single one
    reqs = [GenerationRequest([5, 6, 7], SamplingParams(temperature=1.0, max_new_tokens=8, seed=5, n=3)),
            GenerationRequest([9, 10, 11, 12, 13], params), GenerationRequest([9, 10, 11, 12, 13], params),
            GenerationRequest([20, 21], params)]
    try:
        shared = hf_rollout.generate(reqs)
        hf_rollout.share_prefill = False
        separate = hf_rollout.generate(reqs)
    finally:
        hf_rollout.share_prefill = True
    assert [r.response_ids for r in shared] == [r.response_ids for r in separate]
    assert [r.finish_reason for r in shared] == [r.finish_reason for r in separate]
    for a, b in zip(shared, separate):
        assert torch.allclose(torch.tensor(a.log_probs), torch.tensor(b.log_probs), atol=1e-5)
    assert len({tuple(r.response_ids) for r in shared[:3]}) > 1  # one prompt's samples still differ
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    for res in shared:
        ids = torch.tensor([res.prompt_ids + res.response_ids])
        logits = model(ids).logits[0, len(res.prompt_ids) - 1 : -1]
        expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(res.response_ids)[:, None]).squeeze(-1)
        assert torch.allclose(expected, torch.tensor(res.log_probs), atol=1e-4)


def test_rows_that_stop_early_leave_the_batch_without_disturbing_the_rest(hf_rollout, tiny_model_dir):
    """Finished rows are dropped from the batch and its KV cache mid-generation: every row's tokens must
    still be what the model gives that row alone (log-probs of a plain forward), stopping rows end on a
    stop token, and the others run to the length limit."""
    from transformers import AutoModelForCausalLM

    stop_ids = list(range(100, 230))  # about half the vocabulary: rows stop at many different steps
    params = SamplingParams(temperature=1.0, max_new_tokens=10, seed=2, n=4, stop_token_ids=stop_ids)
    reqs = [GenerationRequest([5, 6, 7], params), GenerationRequest([9, 10, 11, 12, 13], params)]
    results = hf_rollout.generate(reqs)
    lengths = [len(r.response_ids) for r in results]
    assert len(set(lengths)) > 2, lengths
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    for res in results:
        if res.finish_reason == "stop":
            assert res.response_ids[-1] in stop_ids and not set(res.response_ids[:-1]) & set(stop_ids)
        else:
            assert len(res.response_ids) == 10 and not set(res.response_ids) & set(stop_ids)
        ids = torch.tensor([res.prompt_ids + res.response_ids])
        logits = model(ids).logits[0, len(res.prompt_ids) - 1 : -1]
        expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(res.response_ids)[:, None]).squeeze(-1)
        assert torch.allclose(expected, torch.tensor(res.log_probs), atol=1e-4)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_update_weights_takes_a_mixtures_per_expert_checkpoint_names(arch, tmp_path, tiny_tokenizer):
    """transformers fuses a mixture's experts in memory (experts.gate_up_proj [E, 2I, H]); engines stream them per
    expert, as checkpoints name them. Each lands in its slice: the rollout then computes what transformers computes
    on a checkpoint with those tensors."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from polyrl.models.tiny import make_tiny_model

    path = make_tiny_model(tmp_path / arch, arch=arch, seed=0)
    rollout = HFRollout(RolloutConfig(max_batch_size=4), model_path=str(path), tokenizer=tiny_tokenizer)
    disk = load_file(str(path / "model.safetensors"))
    experts = sorted(n for n in disk if ".experts." in n)
    assert experts and not any(n in dict(rollout.model.named_parameters()) for n in experts)
    torch.manual_seed(0)
    changed = {n: disk[n] + 0.1 * torch.randn_like(disk[n]) for n in experts}
    with pytest.raises(ValueError, match=f"weight '{experts[0]}' has shape"):
        rollout.update_weights([(experts[0], torch.zeros(3))])
    for i in range(0, len(experts), 5):  # buckets split the experts of one layer
        rollout.update_weights([(n, changed[n]) for n in experts[i : i + 5]])
    save_file({**disk, **changed}, str(path / "model.safetensors"), metadata={"format": "pt"})
    reference = AutoModelForCausalLM.from_pretrained(path)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        assert torch.allclose(rollout.model(ids).logits, reference(ids).logits, atol=1e-6)
        assert not torch.allclose(AutoModelForCausalLM.from_config(reference.config)(ids).logits,
                                  reference(ids).logits, atol=1e-3)


def _forward_takes_cache(model_cls: type) -> type:
    """A test double of transformers >= 5.24's API on top of the installed model class: ``forward`` takes the KV
    cache as ``cache`` and refuses the old name ``past_key_values`` (which 5.24 deprecates and 5.40 removes)."""

    class CacheNamed(model_cls):  # type: ignore[misc,valid-type]
        def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, **kwargs):
            if "past_key_values" in kwargs:
                raise TypeError("forward() got an unexpected keyword argument 'past_key_values'")
            return super().forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                   past_key_values=cache, **kwargs)

    return CacheNamed


def test_decoding_passes_the_cache_under_the_name_the_model_takes(tiny_model_dir, tiny_tokenizer):
    """transformers renamed ``past_key_values`` to ``cache``: the rollout passes its own cache under whichever name
    the model's forward declares, and samples the same tokens either way."""
    from polyrl.models.kv_cache import cache_keyword

    reqs = [GenerationRequest([5, 6, 7], SamplingParams(temperature=1.0, max_new_tokens=6, seed=4, n=3)),
            GenerationRequest([9, 10], SamplingParams(temperature=1.0, max_new_tokens=6, seed=4))]
    old_style = HFRollout(RolloutConfig(max_batch_size=8), model_path=str(tiny_model_dir), tokenizer=tiny_tokenizer)
    new_style = HFRollout(RolloutConfig(max_batch_size=8), model_path=str(tiny_model_dir), tokenizer=tiny_tokenizer)
    new_style.model.__class__ = _forward_takes_cache(type(new_style.model))
    old_style.decoder = new_style.decoder = None  # transformers' forward step by step (polyrl.rollout.decode calls none)
    assert cache_keyword(new_style.model) == "cache"
    a, b = old_style.generate(reqs), new_style.generate(reqs)
    assert [r.response_ids for r in a] == [r.response_ids for r in b]
    for x, y in zip(a, b):
        assert torch.allclose(torch.tensor(x.log_probs), torch.tensor(y.log_probs), atol=1e-6)
