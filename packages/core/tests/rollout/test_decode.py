"""The hf rollout's own decode loop (polyrl.rollout.decode) against transformers on real tiny models: the
same greedy tokens as ``generate()``, the log-probs of a plain forward pass, the same samples as the
transformers-forward path, and a fallback for models it does not run."""

from __future__ import annotations

import logging

import pytest
import torch

from polyrl.config.roles import RolloutConfig
from polyrl.protocols import GenerationRequest, SamplingParams
from polyrl.rollout.decode import StaticDecoder, supports
from polyrl.rollout.hf import HFRollout

PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15], [20, 21], [30, 31, 32, 33, 34]]


def _model_dir(tmp_path_factory, arch: str):
    from polyrl.models.tiny import build_char_tokenizer, make_tiny_model

    path = tmp_path_factory.mktemp(f"decode-{arch}") / "model"
    if arch != "qwen3":
        return make_tiny_model(path, arch=arch, size="tiny", seed=1)
    # Qwen3: per-head q/k RMSNorms and no q/k/v biases (tiny_config does not build it: its model_type directly)
    from transformers import AutoConfig, AutoModelForCausalLM

    tok = build_char_tokenizer()
    config = AutoConfig.for_model("qwen3", vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                  max_position_embeddings=512, tie_word_embeddings=False, pad_token_id=tok.pad_token_id,
                                  eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id)
    torch.manual_seed(1)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module", params=["qwen2", "llama", "qwen3"])
def arch_rollout(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = _model_dir(tmp_path_factory, request.param)
    tok = AutoTokenizer.from_pretrained(path)
    rollout = HFRollout(RolloutConfig(max_batch_size=32), model_path=str(path), tokenizer=tok)
    reference = AutoModelForCausalLM.from_pretrained(path).eval()
    return request.param, rollout, reference, tok


@pytest.fixture(autouse=True, params=["per-row", "shared"])
def prefix_layout(request, monkeypatch):
    """Every test under both layouts of the prompt's keys and values (``StaticDecoder.share_prefix_above``):
    copied into each row's cache, and kept once per prompt with the shared-prefix products."""
    monkeypatch.setattr(StaticDecoder, "share_prefix_above", 1 << 30 if request.param == "per-row" else 0)
    return request.param


def _forward_logprobs(model, prompt, response, temperature=1.0):
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1] / temperature
    return torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(response)[:, None]).squeeze(-1)


def test_the_static_decoder_runs_these_models(arch_rollout):
    arch, rollout, _, _ = arch_rollout
    assert rollout.decoder is not None, f"{arch}: {supports(rollout.model)}"


def test_greedy_tokens_are_generates(arch_rollout):
    """Left-padded prompts of four lengths, two samples each (one shared prefill per prompt): every response
    is what transformers' ``generate()`` gives that prompt alone, up to and including its EOS."""
    _, rollout, reference, tok = arch_rollout
    params = SamplingParams(temperature=0, max_new_tokens=12, n=2)
    results = rollout.generate([GenerationRequest(p, params) for p in PROMPTS])
    assert len(results) == 8
    for res in results:
        with torch.no_grad():
            out = reference.generate(torch.tensor([res.prompt_ids]), attention_mask=torch.ones(1, len(res.prompt_ids),
                                     dtype=torch.long), do_sample=False, max_new_tokens=12,
                                     pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
        expected = out[0, len(res.prompt_ids):].tolist()
        if tok.eos_token_id in expected:
            expected = expected[: expected.index(tok.eos_token_id) + 1]
        assert res.response_ids == expected
        assert torch.allclose(torch.tensor(res.log_probs), _forward_logprobs(reference, res.prompt_ids,
                                                                             res.response_ids), atol=1e-4)


def test_samples_and_logprobs_are_the_transformers_paths(arch_rollout):
    """Sampling at temperature 0.8 with top-k and top-p, no stop: the same random stream gives the same tokens
    as the transformers-forward path (same logits to float rounding), and both log-probs are a forward pass's."""
    _, rollout, reference, _ = arch_rollout
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, max_new_tokens=10, n=3, seed=4, ignore_eos=True)
    reqs = [GenerationRequest(p, params) for p in PROMPTS]
    ours = rollout.generate(reqs)
    decoder, rollout.decoder = rollout.decoder, None
    try:
        theirs = rollout.generate(reqs)
    finally:
        rollout.decoder = decoder
    assert [r.response_ids for r in ours] == [r.response_ids for r in theirs]
    assert len({tuple(r.response_ids) for r in ours[:3]}) > 1  # a prompt's samples differ
    for a, b in zip(ours, theirs):
        assert torch.allclose(torch.tensor(a.log_probs), torch.tensor(b.log_probs), atol=1e-4)
        assert torch.allclose(torch.tensor(a.log_probs),
                              _forward_logprobs(reference, a.prompt_ids, a.response_ids, 0.8), atol=1e-4)


@pytest.mark.parametrize("compact_below", [0.0, 0.5, 1.0])
def test_finished_rows_dropped_or_kept_give_the_same_greedy_responses(arch_rollout, compact_below):
    """Stop tokens taken from the rows' own greedy responses at different steps, so rows finish at different
    steps: whether finished rows leave the cache at once, at half, or never, every row's greedy response and
    log-probs are those of a plain forward."""
    _, rollout, reference, _ = arch_rollout
    prompts = [[p, p + 1, p + 2] for p in range(5, 200, 11)]
    free = rollout.generate([GenerationRequest(p, SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True))
                             for p in prompts])
    stop_ids = sorted({r.response_ids[i % 7 + 2] for i, r in enumerate(free[::3])})
    params = SamplingParams(temperature=0, max_new_tokens=10, stop_token_ids=stop_ids, ignore_eos=True)
    reqs = [GenerationRequest(p, params) for p in prompts]
    saved = rollout.compact_below
    rollout.compact_below = compact_below
    try:
        results = rollout.generate(reqs)
    finally:
        rollout.compact_below = saved
    assert len({len(r.response_ids) for r in results}) > 2
    for res in results:
        ids = res.response_ids
        if res.finish_reason == "stop":
            assert ids[-1] in stop_ids and not set(ids[:-1]) & set(stop_ids)
        else:
            assert len(ids) == 10 and not set(ids) & set(stop_ids)
        logits = reference(torch.tensor([res.prompt_ids + ids])).logits[0, len(res.prompt_ids) - 1 : -1]
        assert ids == logits.argmax(-1).tolist()
        assert torch.allclose(torch.tensor(res.log_probs),
                              _forward_logprobs(reference, res.prompt_ids, ids), atol=1e-4)


def _greedy_around_a_weight_sync(rollout, name: str, scale: float):
    """A greedy response before, during and after a weight sync that scales parameter ``name`` (then restores it)."""
    req = GenerationRequest([5, 6, 7], SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True))
    before = rollout.generate([req])[0]
    saved = rollout.model.get_parameter(name).detach().clone()
    try:
        rollout.update_weights([(name, saved * scale)])
        during = rollout.generate([req])[0]
    finally:
        rollout.update_weights([(name, saved)])
    return before, during, rollout.generate([req])[0]


def test_weight_updates_reach_the_decoder(arch_rollout):
    _, rollout, _, _ = arch_rollout
    before, after, restored = _greedy_around_a_weight_sync(rollout, "model.norm.weight", -3.0)
    assert after.log_probs != before.log_probs
    assert restored.response_ids == before.response_ids


def test_a_mixture_of_experts_keeps_transformers_forward(tmp_path, tiny_tokenizer, caplog):
    """Models the decoder does not run (here a mixture of experts) generate through transformers' forward,
    and say so in a debug log."""
    from polyrl.models.tiny import make_tiny_model

    path = make_tiny_model(tmp_path / "moe", arch="qwen3_moe", seed=0)
    with caplog.at_level(logging.DEBUG, logger="polyrl"):
        rollout = HFRollout(RolloutConfig(max_batch_size=4), model_path=str(path), tokenizer=tiny_tokenizer)
    assert rollout.decoder is None
    assert "transformers' forward decodes Qwen3MoeForCausalLM" in caplog.text and "'qwen3_moe'" in caplog.text
    with pytest.raises(ValueError, match="qwen3_moe"):
        StaticDecoder(rollout.model)
    res = rollout.generate([GenerationRequest([5, 6, 7], SamplingParams(temperature=0, max_new_tokens=4,
                                                                        ignore_eos=True))])[0]
    assert len(res.response_ids) == 4


@pytest.mark.parametrize("top_k, top_p", [(-1, 1.0), (3, 1.0), (-1, 0.7)])
def test_sampling_follows_the_filtered_distribution(top_k, top_p):
    """The sampler draws each token with its probability after temperature, top-k and top-p, and never a
    filtered-out one; the log-prob it returns is the unfiltered ``log_softmax(logits / T)``."""
    from polyrl.rollout.hf import _sample

    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    params = SamplingParams(temperature=0.8, top_k=top_k, top_p=top_p)
    rows = 40000
    token, logp = _sample(logits.repeat(rows, 1), params, torch.Generator().manual_seed(0))
    scaled = logits / 0.8
    probs = torch.softmax(scaled, -1)
    keep = torch.ones(6, dtype=torch.bool)
    if top_k > 0:
        keep[top_k:] = False
    if top_p < 1.0:
        keep = (probs.cumsum(-1) - probs) <= top_p  # logits are sorted: the nucleus is a prefix
    expected = torch.where(keep, probs, 0) / probs[keep].sum()
    freq = torch.bincount(token, minlength=6).double() / rows
    assert freq[~keep].sum() == 0
    assert torch.allclose(freq, expected.double(), atol=4 * (0.25 / rows) ** 0.5)  # 4 standard deviations at most
    assert torch.allclose(logp, torch.log_softmax(scaled, -1)[token])


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_bfloat16_joins_layers_and_follows_their_weights(tmp_path_factory, arch):
    """A bfloat16 rollout (``rollout.dtype``): the decoder multiplies q, k and v (with Qwen2's biases) and gate
    and up as one matrix each, its log-probs are a float32 forward pass's to bfloat16 rounding, and an in-place
    write to one of the joined weights (a weight sync) reaches the next batch."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = _model_dir(tmp_path_factory, arch)
    rollout = HFRollout(RolloutConfig(max_batch_size=32, dtype="bfloat16"), model_path=str(path),
                        tokenizer=AutoTokenizer.from_pretrained(path))
    reference = AutoModelForCausalLM.from_pretrained(path).eval()
    params = SamplingParams(temperature=1.0, max_new_tokens=8, n=2, seed=3, ignore_eos=True)
    results = rollout.generate([GenerationRequest(p, params) for p in PROMPTS])
    layer = rollout.decoder.layers[0]
    assert len(layer.qkv.weights) == 1 and len(layer.gate_up.weights) == 1
    assert layer.qkv.weights[0].dtype == torch.bfloat16
    assert (layer.qkv.bias[0] is not None) == (arch == "qwen2")
    for res in results:
        exact = _forward_logprobs(reference, res.prompt_ids, res.response_ids)
        assert torch.allclose(torch.tensor(res.log_probs), exact, atol=0.15), (res.log_probs, exact)
    before, after, restored = _greedy_around_a_weight_sync(rollout, "model.layers.0.self_attn.v_proj.weight", -4.0)
    assert after.log_probs != before.log_probs
    assert restored.log_probs == before.log_probs


def test_bfloat16_products_are_the_layers_products(tmp_path_factory):
    """Every product the bf16 decoder makes (q/k/v and gate/up joined; prepacked in oneDNN's layout where this CPU
    has bf16 kernels) is ``F.linear`` of the model's own layers, for 1 to 40 rows, and still is after an in-place
    write to a weight (a weight sync)."""
    import torch.nn.functional as F
    from transformers import AutoTokenizer

    from polyrl.rollout import decode

    path = _model_dir(tmp_path_factory, "qwen2")
    rollout = HFRollout(RolloutConfig(max_batch_size=8, dtype="bfloat16"), model_path=str(path),
                        tokenizer=AutoTokenizer.from_pretrained(path))
    model, decoder = rollout.model, rollout.decoder
    attn, mlp = model.model.layers[1].self_attn, model.model.layers[1].mlp
    layer = decoder.layers[1]
    pairs = [(layer.qkv, (attn.q_proj, attn.k_proj, attn.v_proj)), (layer.o, (attn.o_proj,)),
             (layer.gate_up, (mlp.gate_proj, mlp.up_proj)), (layer.down, (mlp.down_proj,)),
             (decoder.lm_head, (model.lm_head,))]
    gen = torch.Generator().manual_seed(0)

    def check() -> None:
        for linear, modules in pairs:
            linear.refresh()
            assert linear.packed == decode._packs(modules[0].weight)
            for rows in (1, 7, 40):
                x = torch.randn(rows, modules[0].in_features, generator=gen).to(torch.bfloat16)
                for got, module in zip(linear.split(x), modules, strict=True):
                    want = F.linear(x, module.weight, module.bias)
                    assert torch.allclose(got.float(), want.float(), atol=2e-2, rtol=2e-2), (module, rows)

    check()
    with torch.no_grad():
        attn.k_proj.weight.mul_(-3.0)
        mlp.down_proj.weight.add_(0.5)
    check()


def test_blocked_draw_follows_a_wide_vocabulary():
    """Past 2 x ``DRAW_BLOCK`` entries the sampler picks a block, then an entry inside it: each entry comes with its
    probability, at block edges and in the padded last block too, and a zero-probability entry never comes; a
    vocabulary of one entry of mass among zeros always gives that entry."""
    from polyrl.rollout.hf import DRAW_BLOCK, draw

    width = 5 * DRAW_BLOCK - 120  # not a whole number of blocks: the last one is padded
    # two entries of mass in each block that has any: the draw inside a block must follow its running sum
    where = torch.tensor([0, DRAW_BLOCK - 1, DRAW_BLOCK, DRAW_BLOCK + 300, 3 * DRAW_BLOCK + 7, 3 * DRAW_BLOCK + 900,
                          width - 50, width - 1])
    mass = torch.tensor([0.1, 0.15, 0.05, 0.1, 0.2, 0.15, 0.1, 0.15])
    rows = 40000
    probs = torch.zeros(rows, width)
    probs[:, where] = mass
    token = draw(probs, torch.Generator().manual_seed(0))
    freq = torch.bincount(token, minlength=width).double() / rows
    assert freq.sum() == 1 and freq[where].sum() == 1  # nothing outside the entries of mass
    assert torch.allclose(freq[where], mass.double(), atol=4 * (0.25 / rows) ** 0.5)
    one = torch.zeros(3, width)
    one[:, 2 * DRAW_BLOCK + 5] = 1e-30  # tiny but nonzero, the rest zero
    assert draw(one, torch.Generator().manual_seed(1)).tolist() == [2 * DRAW_BLOCK + 5] * 3
