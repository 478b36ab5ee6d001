"""End-to-end GRPO with `actor.engine=megatron` (tensor parallel over 2 Ray workers) and the hf rollout."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from polyrl.trainer.commands import train

pytest.importorskip("megatron.core")


@pytest.fixture(scope="module")
def tp_model(tmp_path_factory) -> Path:
    from polyrl.models.tiny import make_tiny_model

    # two KV heads, so TP=2 splits them
    return make_tiny_model(tmp_path_factory.mktemp("model") / "tiny", size="tiny", seed=0, num_key_value_heads=2)


def test_grpo_megatron_tp2_two_workers(base_overrides, tp_model, tmp_path):
    manifest = tmp_path / "polyrl.toml"
    manifest.write_text('[plugins]\nrequire = ["polyrl-engine-megatron>=0.1,<0.2"]\n')
    overrides = [o for o in base_overrides if not o.startswith(("model.path=", "actor.engine="))]
    train(manifest, [], overrides + [
        f"model.path={tp_model}", "actor.engine=megatron", "actor.megatron.tensor_model_parallel_size=2",
        "trainer.executor=ray", "trainer.n_workers=2", "trainer.ray_num_cpus=2", "trainer.test_freq=0"])
    run = tmp_path / "run"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if "actor/grad_norm" in r]
    assert [r["step"] for r in train_rows] == [1, 2]
    for r in train_rows:
        assert math.isfinite(r["actor/pg_loss"]) and r["actor/grad_norm"] > 0
    assert "polyrl-engine-megatron==" in (run / "manifest.lock.toml").read_text()
