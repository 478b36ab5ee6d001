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


@pytest.mark.parametrize("extra, match", [
    (("trainer.flow_grpo.noise_level=nan",), r"^trainer\.flow_grpo\.noise_level=nan must be a finite number$"),
    (("trainer.flow_grpo.height=-8",), r"^trainer\.flow_grpo\.height=-8 must be >= 0$"),
    (("trainer.flow_grpo.width=7",), r"^trainer\.flow_grpo\.width=7: give a multiple of 2 pixels"),
    (("trainer.flow_grpo.cfg_scale=inf",), r"trainer\.flow_grpo\.cfg_scale=inf must be a finite number"),
    (("trainer.flow_grpo.dance_grpo.noise_level=-0.1",), r"trainer\.flow_grpo\.dance_grpo\.noise_level=-0\.1 must"),
    (("trainer.flow_grpo.ema.decay=1.0",), r"trainer\.flow_grpo\.ema\.decay=1\.0 must be in \[0, 1\)"),
    (("trainer.flow_grpo.algorithm=diffusion_nft", "trainer.flow_grpo.nft.beta=nan"), r"trainer\.flow_grpo\.nft\.beta=nan"),
    (("rollout.diffusers.max_batch_size=0",), r"rollout\.diffusers\.max_batch_size=0 must be >= 1"),
    (("actor.diffusers.fsdp_size=0",), r"actor\.diffusers\.fsdp_size=0"),
    (("trainer.flow_grpo.noise_level=0",), r"noise_level=0 makes every step an ODE step"),
    (("trainer.flow_grpo.train_steps=1",), r"train_steps=1 leaves no step to train"),
    (("trainer.flow_grpo.sde_type=ode",), r"sde_type='ode': choose"),
    (("trainer.flow_grpo.kl_form=k3",), r"kl_form='k3': choose"),
])
def test_bad_numbers_are_one_line_errors_before_workers_start(setup, tmp_path, extra, match):
    with pytest.raises(ConfigError, match=match) as info:
        _train(setup, tmp_path, extra=extra)
    assert "\n" not in str(info.value)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_every_numeric_key_of_the_diffusion_blocks_is_checked():
    """Each int / float key of trainer.flow_grpo (nested blocks too) and rollout.diffusers has a range, and a NaN
    (floats) or a value below its range (ints) is refused with its key named."""
    import dataclasses
    import math
    import re

    from polyrl_diffusion.config import RANGES, DiffusersRolloutConfig, FlowGRPOConfig, _numbers, check_numbers
    from polyrl_diffusion.sampler import check_sampler_config

    def replaced(cfg, dotted, value):
        head, _, rest = dotted.partition(".")
        if not rest:
            return dataclasses.replace(cfg, **{head: value})
        return dataclasses.replace(cfg, **{head: replaced(getattr(cfg, head), rest, value)})

    keys = _numbers(FlowGRPOConfig())
    assert {k for k, _ in keys} <= set(RANGES), "a numeric key without a range"
    for key, value in keys:
        low = RANGES[key][0]
        bad = math.nan if isinstance(value, float) else int(low) - 1
        with pytest.raises(ConfigError, match="^" + re.escape(f"trainer.flow_grpo.{key}=")):
            check_sampler_config(replaced(FlowGRPOConfig(), key, bad))
    for key, _ in _numbers(DiffusersRolloutConfig(), skip=("sampler",)):
        with pytest.raises(ConfigError, match=rf"rollout\.diffusers\.{key}="):
            check_numbers(replaced(DiffusersRolloutConfig(), key, -1), "rollout.diffusers", skip=("sampler",))


def _by_data_source(setup, tmp_path, rows, name, extra=()):
    """A dry run whose rows pick their image reward by data_source (no reward.function)."""
    root, models = setup
    data = tmp_path / name
    if name.endswith(".txt"):
        data.parent.mkdir(parents=True, exist_ok=True)
        data.write_text("\n".join(rows) + "\n")
    else:
        data.write_text("\n".join(json.dumps(r) for r in rows))
    return train(root / "m.toml", [], [
        f"model.path={models['sd3']}", f"data.train_files=[{data}]", "data.train_batch_size=4",
        "actor.engine=diffusers", "rollout.name=diffusers", "trainer.name=flow_grpo", "trainer.executor=local",
        "algorithm.adv_estimator=flow_grpo", "actor.policy_loss.loss_mode=flow_grpo", "actor.ppo_mini_batch_size=4",
        "rollout.n=2", "trainer.total_steps=1", f"trainer.run_dir={tmp_path / 'run'}", "trainer.progress_bar=false",
        "trainer.logger=[jsonl]", *extra], dry_run=True)


def test_a_data_source_without_an_image_reward_fails_the_dry_run_in_one_line(setup, tmp_path):
    """Issue 47: such rows passed --dry-run, then died at step 1 with a KeyError traceback."""
    rows = [{"prompt": "a red house", "data_source": "pickscore"}] * 4
    with pytest.raises(ConfigError) as err:
        _by_data_source(setup, tmp_path, rows, "rows.jsonl")
    msg = str(err.value)
    assert "\n" not in msg and "'pickscore'" in msg and "rows.jsonl" in msg and "reward.function" in msg, msg
    assert "brightness" in msg and "ocr" in msg  # the image rewards there are
    assert not (tmp_path / "run").exists()
    # Flow-GRPO's pickscore/*.txt: data_source from the folder, the same one line
    with pytest.raises(ConfigError, match=r"'pickscore'.*reward\.function"):
        _by_data_source(setup, tmp_path, ["a red house"] * 4, "pickscore/train.txt")
    # the fixes the message names pass: a data source with an image reward, or reward.function
    assert _by_data_source(setup, tmp_path, [dict(r, data_source="brightness") for r in rows], "ok.jsonl") == {}
    assert _by_data_source(setup, tmp_path, rows, "rows.jsonl", ["reward.function=brightness"]) == {}
    # Flow-GRPO's ocr/*.txt loads as it is and reaches the ocr reward
    assert _by_data_source(setup, tmp_path, ['a sign that says "open"'] * 4, "ocr/train.txt") == {}
