"""`polyrl train` with trainer.name=flow_grpo refuses bad input before any worker starts."""

from __future__ import annotations

import json

import pytest

from polyrl.errors import ConfigError
from polyrl.trainer.commands import train


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from polyrl_diffusion.models import make_tiny_pipeline

    root = tmp_path_factory.mktemp("cfg")
    models = {f: make_tiny_pipeline(root / f, family=f, seed=0) for f in ("sd3", "flux")}
    (root / "ok.jsonl").write_text("\n".join(json.dumps({"prompt": "a red house"}) for _ in range(4)))
    (root / "long.jsonl").write_text("\n".join(json.dumps({"prompt": "a red house " * 6}) for _ in range(4)))
    (root / "m.toml").write_text('[plugins]\nrequire = ["polyrl-engine-fsdp", "polyrl-diffusion"]\n')
    return root, models


def _train(setup, tmp_path, data="ok.jsonl", family="sd3", extra=()):
    root, models = setup
    return train(root / "m.toml", [], [
        f"model.path={models[family]}", f"data.train_files=[{root / data}]", "data.train_batch_size=4",
        "actor.engine=diffusers", "rollout.name=diffusers", "trainer.name=flow_grpo", "trainer.executor=local",
        "algorithm.adv_estimator=flow_grpo", "actor.policy_loss.loss_mode=flow_grpo", "reward.function=brightness",
        "actor.ppo_mini_batch_size=4", "rollout.n=2", "trainer.total_steps=1", f"trainer.run_dir={tmp_path / 'run'}",
        "trainer.progress_bar=false", "trainer.logger=[jsonl]", *extra])


@pytest.mark.parametrize("data, family, extra, match", [
    ("long.jsonl", "sd3", (), r"long\.jsonl row 0: 'prompt' is 20 tokens; the text encoder .* takes 12"),
    ("ok.jsonl", "flux", ("trainer.flow_grpo.cfg_scale=3.0",), r"cfg_scale=3\.0 on a FLUX model needs a negative"),
    ("ok.jsonl", "sd3", ("trainer.flow_grpo.sde_window_size=4", "trainer.flow_grpo.sde_window_start=8"),
     r"sde_window_start=8 \+ sde_window_size=4 lies outside"),
    ("ok.jsonl", "sd3", ("trainer.flow_grpo.nosie_level=0.5",), r"nosie_level"),
])
def test_bad_input_is_refused_before_workers_start(setup, tmp_path, data, family, extra, match):
    with pytest.raises(ConfigError, match=match):
        _train(setup, tmp_path, data, family, extra)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_one_local_step_runs(setup, tmp_path):
    metrics = _train(setup, tmp_path, extra=("trainer.flow_grpo.train_steps=4", "trainer.flow_grpo.cfg_scale=2.0"))
    assert "critic/score/mean" in metrics and metrics["diffusion/trained_steps"] == 3  # the last step is not
    assert metrics["throughput/images_per_s"] > 0
