"""engine-fsdp trains Hugging Face mixtures of experts as transformers builds them (Qwen3-MoE, Mixtral; tiny
random models with 4 experts, 2 per token): no conversion, the experts are ordinary parameters that FSDP2 shards.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from dist_worker import batch, loss_fn, make_engine  # noqa: E402
from test_fsdp_engine import _hf_log_probs, _run_group  # noqa: E402


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def moe_dir(request, tmp_path_factory):
    from polyrl.models.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp(request.param) / "moe", arch=request.param, seed=0)


def test_fsdp_trains_a_mixture_of_experts(moe_dir, tmp_path):
    """transformers' log-probs, an objective that rises over three steps with every expert and router trained,
    and an export that transformers loads back to the engine's log-probs."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(moe_dir)
    engine = make_engine(str(moe_dir), lr=1e-2)
    b = batch(seed=5)
    b["advantages"] = torch.ones_like(b["advantages"])  # raise every sampled token's probability
    before = engine.infer_batch(b)["log_probs"]
    for row in range(3):
        n = int(b["response_mask"][row].sum())
        assert torch.allclose(before[row, :n], _hf_log_probs(model, b, row), atol=1e-5)
    initial = {n: t.clone() for bucket in engine.weights_for_rollout() for n, t in bucket}
    losses = [engine.train_batch(b, loss_fn)["loss"] for _ in range(3)]
    assert losses[-1] < losses[0]
    after = {n: t for bucket in engine.weights_for_rollout() for n, t in bucket}
    experts = [n for n in initial if ".experts." in n or n.endswith("mlp.gate.weight")]
    assert experts and all(not torch.equal(after[n], initial[n]) for n in experts), experts
    engine.export_hf(str(tmp_path / "out"))
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    mine = engine.infer_batch(b)["log_probs"]
    for row in range(3):
        n = int(b["response_mask"][row].sum())
        assert torch.allclose(mine[row, :n], _hf_log_probs(exported, b, row), atol=1e-5)


def test_two_processes_match_one_on_a_mixture_of_experts(tmp_path):
    """FSDP2 over 2 gloo ranks (experts sharded like any parameter) = one process on Qwen3-MoE: three steps'
    gradient norms, losses and weights."""
    from polyrl.models.tiny import make_tiny_model

    moe_dir = make_tiny_model(tmp_path / "qwen3_moe", arch="qwen3_moe", seed=0)
    one = _run_group(1, moe_dir, tmp_path)
    two = _run_group(2, moe_dir, tmp_path)
    assert one["results"]["grad_norm"] == pytest.approx(two["results"]["grad_norm"], rel=1e-6)
    assert one["results"]["loss"] == pytest.approx(two["results"]["loss"], rel=1e-6)
    for name, w in one["weights"].items():
        assert torch.allclose(w, two["weights"][name], atol=1e-6), name
