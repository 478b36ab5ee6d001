"""End-to-end runs of `polyrl train` with the FSDP engine plugin, the built-in hf rollout, real Ray."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from polyrl.errors import ConfigError, ManifestError
from polyrl.trainer.commands import train


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _check_run(run_dir: Path, steps: int) -> list[dict]:
    rows = _metrics(run_dir)
    train_rows = [r for r in rows if "critic/score/mean" in r]
    assert [r["step"] for r in train_rows] == list(range(1, steps + 1))
    for r in train_rows:
        for key in ("actor/pg_loss", "actor/grad_norm", "response_length/mean", "timing/gen",
                    "throughput/tokens_per_s", "actor/entropy"):
            assert key in r and math.isfinite(r[key]), key
        assert r["actor/grad_norm"] > 0
    assert any("val/arithmetic/mean@1" in r for r in rows)
    assert (run_dir / "config.yaml").exists()
    assert "polyrl-engine-fsdp==" in (run_dir / "manifest.lock.toml").read_text()
    platform = json.loads((run_dir / "platform.json").read_text())  # the chosen platform and why
    assert platform["name"] == "cpu" and platform["reason"] and platform["dist_backend"] == "gloo"
    return train_rows


def test_grpo_local_executor(base_overrides, manifest_file, tmp_path):
    train(manifest_file, [], base_overrides + ["trainer.executor=local", "trainer.save_freq=2"])
    run = tmp_path / "run"
    _check_run(run, 2)
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_2"


def test_grpo_ray_two_workers(base_overrides, manifest_file, tmp_path):
    train(manifest_file, [], base_overrides + ["trainer.executor=ray", "trainer.n_workers=2", "trainer.ray_num_cpus=2"])
    rows = _check_run(tmp_path / "run", 2)
    assert all(r["batch/rank_tokens_max_over_mean"] >= 1.0 for r in rows)
    assert all(r["perf/colocated/max_rss_gb"] > 0.05 for r in rows)  # each worker's Platform.memory_stats
    log = (tmp_path / "run" / "train.log").read_text()  # the driver's and every worker's records, one file
    assert "INFO polyrl.platforms: platform cpu" in log and "[worker rank 1] polyrl.trainer.role_worker:" in log


def test_balancing_the_ranks_trains_the_same(base_overrides, manifest_file, tmp_path):
    """`trainer.balance_batch` only moves whole prompt groups between the two ranks: with one mini-batch per
    step the gradient is the same sum, so the run matches an unbalanced one step for step (replicated
    engine, `fsdp_size=1`, to cover its gradient all-reduce under Ray as well)."""
    runs = {}
    for balance in ("true", "false"):
        overrides = [o for o in base_overrides if not o.startswith("trainer.run_dir=")]
        train(manifest_file, [], overrides + [
            "trainer.executor=ray", "trainer.n_workers=2", "trainer.ray_num_cpus=2", "actor.ppo_mini_batch_size=4",
            "actor.fsdp.fsdp_size=1", "trainer.test_freq=0", f"trainer.balance_batch={balance}",
            f"trainer.run_dir={tmp_path / balance}"])
        runs[balance] = [r for r in _metrics(tmp_path / balance) if "critic/score/mean" in r]
    assert all("batch/rank_tokens_max_over_mean" in r for r in runs["true"])
    assert not any("batch/rank_tokens_max_over_mean" in r for r in runs["false"])
    for a, b in zip(runs["true"], runs["false"], strict=True):
        for key in ("critic/score/mean", "actor/pg_loss", "actor/grad_norm", "response_length/mean"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key


def test_ppo_with_critic_and_kl(base_overrides, manifest_file, tmp_path):
    train(manifest_file, [], base_overrides + [
        "trainer.executor=local", "algorithm.adv_estimator=gae", "algorithm.use_kl_in_reward=true",
        "critic.optim.lr=1e-3", "critic.micro_batch_size=8", "critic.ppo_mini_batch_size=2",
    ])
    rows = _check_run(tmp_path / "run", 2)
    assert all("critic/vf_loss" in r and "actor/kl_ref" in r for r in rows)


def test_unknown_config_key_suggests(base_overrides, manifest_file):
    with pytest.raises(ConfigError, match="Did you mean 'actor.ppo_mini_batch_size'"):
        train(manifest_file, [], base_overrides + ["actor.ppo_mini_batch=2"])


def test_engine_installed_but_not_in_manifest_says_to_require_it(base_overrides, tmp_path):
    empty = tmp_path / "empty.toml"
    empty.write_text("[plugins]\nrequire = []\n")
    with pytest.raises(ConfigError, match=r"installed polyrl-engine-fsdp provides it: add it to \[plugins\]\.require"):
        train(empty, [], base_overrides)


def test_manifest_requiring_missing_plugin(base_overrides, tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('[plugins]\nrequire = ["polyrl-no-such-plugin>=0.1"]\n')
    with pytest.raises(ManifestError, match="requires 'polyrl-no-such-plugin>=0.1', which is not installed") as err:
        train(bad, [], base_overrides)
    assert "pip install" not in str(err.value)  # not one of polyrl's own: a typo could be someone else's package


def test_grpo_split_placement(base_overrides, manifest_file, tmp_path):
    """The rollout in its own resource pool; weights travel from actor rank 0 over the weight-transfer process
    group (trainer.weight_transfer=auto: collective)."""
    train(manifest_file, [], base_overrides + ["trainer.executor=ray", "trainer.placement=split",
                                               "trainer.n_workers=1", "trainer.rollout_workers=1",
                                               "trainer.ray_num_cpus=2"])
    rows = _check_run(tmp_path / "run", 2)
    # the rollout samples from the synced actor: its log-probs match the actor's recomputation
    assert all(r["rollout/logprob_diff_mean"] < 1e-4 for r in rows)
    assert all(r["perf/actor/max_rss_gb"] > 0.05 and r["perf/rollout/max_rss_gb"] > 0.05 for r in rows)


def test_dapo_dynamic_sampling_and_overlong_penalty(base_overrides, manifest_file, tmp_path):
    """Groups whose samples all got the same reward are dropped and the batch refilled."""
    train(manifest_file, [], base_overrides + [
        "trainer.executor=local", "algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=score",
        "algorithm.filter_groups.max_num_gen_batches=4", "reward.manager=dapo", "reward.overlong_buffer_enable=true",
        "reward.overlong_buffer_len=2",
    ])
    rows = _check_run(tmp_path / "run", 2)
    assert all(r["train/gen_rounds"] >= 1 for r in rows)


def test_on_policy_update_skips_old_log_prob_pass(base_overrides, manifest_file, tmp_path):
    """One epoch over one mini-batch: the update's own detached log-probs are the old ones. The run must
    match one that recomputes them in a separate pass, step for step, without that pass."""
    on_policy = ["trainer.executor=local", "actor.ppo_mini_batch_size=4", "trainer.test_freq=0"]
    runs = {}
    for mode in ("auto", "always"):
        overrides = [o for o in base_overrides if not o.startswith("trainer.run_dir=")]
        train(manifest_file, [], overrides + on_policy + [f"actor.recompute_old_log_prob={mode}",
                                                          f"trainer.run_dir={tmp_path / mode}"])
        runs[mode] = [r for r in _metrics(tmp_path / mode) if "critic/score/mean" in r]
    assert all("timing/old_log_prob" not in r for r in runs["auto"])
    assert all("timing/old_log_prob" in r for r in runs["always"])
    for skipped, recomputed in zip(runs["auto"], runs["always"], strict=True):
        for key in ("critic/score/mean", "actor/pg_loss", "actor/grad_norm", "actor/entropy", "response_length/mean"):
            assert skipped[key] == pytest.approx(recomputed[key], rel=1e-4, abs=1e-6), key
        assert skipped["actor/pg_clipfrac"] == 0.0
        # the trainer-vs-rollout check still runs, inside the update
        assert skipped["rollout/logprob_diff_mean"] < 1e-4


def test_bad_recompute_old_log_prob_value(base_overrides, manifest_file):
    with pytest.raises(ConfigError, match="actor.recompute_old_log_prob='sometimes'"):
        train(manifest_file, [], base_overrides + ["actor.recompute_old_log_prob=sometimes"])
