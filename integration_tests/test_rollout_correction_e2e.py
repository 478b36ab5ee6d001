"""`polyrl train` with verl's algorithm.rollout_correction: decoupled (weights + rejection) and bypass mode."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from polyrl.errors import ConfigError
from polyrl.trainer.commands import train


def _train_rows(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "critic/score/mean" in r]


def _overrides(base_overrides: list[str], run_dir: Path) -> list[str]:
    keep = [o for o in base_overrides if not o.startswith("trainer.run_dir=")]
    # one mini-batch, one epoch: on-policy, so polyrl would skip the old-log-prob pass on its own
    return keep + ["trainer.executor=local", "actor.ppo_mini_batch_size=4", "trainer.test_freq=0",
                   "trainer.total_steps=1", "trainer.val_before_train=false", f"trainer.run_dir={run_dir}"]


def test_decoupled_and_bypass_rollout_correction(base_overrides, manifest_file, tmp_path):
    decoupled = tmp_path / "decoupled"
    train(manifest_file, [], _overrides(base_overrides, decoupled) + [
        "algorithm.rollout_correction.rollout_is=token", "algorithm.rollout_correction.rollout_is_threshold=2.0",
        "algorithm.rollout_correction.rollout_rs=token_k1",
        "algorithm.rollout_correction.rollout_rs_threshold='0.5_2.0'"])
    (row,) = _train_rows(decoupled)
    assert "timing/old_log_prob" in row  # rejection sampling needs the whole batch's old log-probs first
    for key in ("rollout_corr/rollout_is_mean", "rollout_corr/rollout_rs_masked_fraction", "rollout_corr/kl"):
        assert key in row and math.isfinite(row[key]), key
    assert math.isfinite(row["actor/pg_loss"])

    bypass = tmp_path / "bypass"
    train(manifest_file, [], _overrides(base_overrides, bypass) + [
        "algorithm.rollout_correction.bypass_mode=true", "algorithm.rollout_correction.loss_type=reinforce",
        "algorithm.rollout_correction.rollout_is=sequence"])
    (row,) = _train_rows(bypass)
    assert "timing/old_log_prob" not in row
    assert math.isfinite(row["rollout_corr/rollout_is_mean"])  # computed by the bypass_mode loss, per micro-batch
    assert math.isfinite(row["actor/pg_loss"]) and row["actor/grad_norm"] > 0


def test_old_tis_key_and_rollout_correction_must_agree(base_overrides, manifest_file, tmp_path):
    with pytest.raises(ConfigError, match="tis_imp_ratio_cap"):
        train(manifest_file, [], _overrides(base_overrides, tmp_path / "run") + [
            "actor.policy_loss.tis_imp_ratio_cap=2.0", "algorithm.rollout_correction.rollout_is=sequence"])
