"""LoRA on the real pretrained SmolLM2-135M-Instruct (polyrl.testing's ``real_model_dir``) in the FSDP engine: one GRPO
step trains the adapter alone, and the merged export computes what the engine's base+adapter model computes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from dist_worker import make_engine  # noqa: E402
from real_worker import real_batch  # noqa: E402


def _response_log_probs(model, b, row: int) -> torch.Tensor:
    ids = b["input_ids"][row][b["attention_mask"][row].bool()][None]
    n = int(b["response_mask"][row].sum())
    with torch.no_grad():
        logits = model(ids).logits[0, -n - 1 : -1]
    return torch.log_softmax(logits, -1).gather(-1, ids[0, -n:, None])[:, 0]


@pytest.mark.timeout(300)  # about 25 s on 2 quiet cores
def test_lora_grpo_step_on_the_real_model(real_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    from polyrl.algorithms.advantages import compute_grpo_outcome_advantage
    from polyrl.config.roles import LoRAConfig
    from polyrl.config.schema import ActorConfig
    from polyrl.trainer.losses import make_actor_loss

    engine = make_engine(str(real_model_dir), lr=1e-3, micro_batch_size=2, lora=LoRAConfig(rank=8, alpha=16))
    b = real_batch(str(real_model_dir))
    # GRPO: two groups of two answers, one scored 1 and one 0 in each
    rewards = torch.zeros_like(b["response_mask"], dtype=torch.float32)
    last = b["response_mask"].sum(-1) - 1
    rewards[torch.arange(4), last] = torch.tensor([1.0, 0.0, 0.0, 1.0])
    b["advantages"] = compute_grpo_outcome_advantage(rewards, b["response_mask"], index=[0, 0, 1, 1])[0]
    params = dict(engine.module.named_parameters())
    base = {n: p.detach().clone() for n, p in params.items() if ".lora_" not in n}
    adapter = {n: p.detach().clone() for n, p in params.items() if ".lora_" in n}
    assert adapter and all(not params[n].requires_grad for n in base)
    before = engine.infer_batch(b)["log_probs"]
    b["old_log_probs"] = before

    metrics = engine.train_batch(b, make_actor_loss(ActorConfig()))
    assert all(torch.isfinite(torch.tensor(v)) for k, v in metrics.items() if k.startswith("actor/"))
    assert metrics["actor/grad_norm"] > 0
    after = dict(engine.module.named_parameters())
    assert all(torch.equal(after[n].detach(), t) for n, t in base.items())  # the base model did not move
    assert any(not torch.equal(after[n].detach(), t) for n, t in adapter.items() if ".lora_B." in n)  # B left 0
    trained = engine.infer_batch(b)["log_probs"]
    mask = b["response_mask"].bool()
    assert (trained - before)[mask].abs().max() > 1e-3
    # the reference policy (adapter off) is still the pretrained model
    pretrained = AutoModelForCausalLM.from_pretrained(real_model_dir).eval()
    off = engine.infer_batch(b, disable_adapter=True)["log_probs"]
    for row in range(4):
        n = int(b["response_mask"][row].sum())
        assert torch.allclose(off[row, :n], _response_log_probs(pretrained, b, row), atol=1e-4)

    # the merged export is base + adapter: a plain transformers model loaded from it computes the engine's log-probs
    engine.export_hf(str(tmp_path / "merged"))
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    assert not any("lora" in n for n in merged.state_dict())
    for row in range(4):
        n = int(b["response_mask"][row].sum())
        ours = _response_log_probs(merged, b, row)
        assert torch.allclose(trained[row, :n], ours, atol=1e-4), row
        assert not torch.allclose(ours, _response_log_probs(pretrained, b, row), atol=1e-3)  # it is not the base
