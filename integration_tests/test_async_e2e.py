"""Asynchronous training (``trainer.async_mode``, docs/async.md) end to end: real Ray, the FSDP engine, the
built-in hf rollout on its own worker (split placement: one rollout worker, one actor worker).

- one-step off-policy and fully async runs learn a small task as well as the synchronous run (within a
  stated margin), with the staleness of every trained sample within its bound;
- fully async with each ``trainer.weight_transfer`` (collective from a background thread, object store)
  generates every sample on the weights its version tag names (a staleness bound of 0: no log-prob gap);
- dynamic sampling (``algorithm.filter_groups``) in fully async fills whole batches, no prompt twice;
- a fully async run SIGKILLed mid-step and resumed trains every prompt exactly once (checked by sample
  ids), and the groups that were waiting in the queue at the checkpoint are trained from the checkpoint.

The task: arithmetic prompts (as in the quickstart) with a reward for answering with digits, which the
random tiny model learns in a few steps (the quickstart's exact-answer reward needs an SFT warm-up first).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from polyrl.errors import ConfigError
from polyrl.trainer.commands import train

STEPS = 14
#: Held-out accuracy an async run may lose against the synchronous run (absolute; 64 sampled answers each).
MARGIN = 0.25


@pytest.fixture(scope="module")
def digits_reward(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("reward") / "digits_reward.py"
    path.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    text = solution_str[:6]\n"
        "    frac = sum(c.isdigit() for c in text) / max(1, len(text)) if text else 0.0\n"
        "    return {'score': frac, 'acc': float(frac >= 0.5)}\n"
    )
    return path


def _overrides(base: list[str], reward: Path, run: Path, steps: int, mode: str) -> list[str]:
    keep = [o for o in base if not o.startswith(("trainer.run_dir", "trainer.total_steps", "reward.function",
                                                 "actor.ppo_mini_batch_size", "actor.optim.lr"))]
    return keep + [
        f"reward.function={reward}:compute_score", f"trainer.run_dir={run}", f"trainer.total_steps={steps}",
        "actor.ppo_mini_batch_size=4", "actor.optim.lr=1e-2", "trainer.executor=ray", "trainer.placement=split",
        "trainer.n_workers=1", "trainer.rollout_workers=1", "trainer.ray_num_cpus=2", "trainer.val_before_train=false",
        f"trainer.test_freq={steps}", "rollout.val_n=4", f"trainer.async_mode={mode}",
    ]


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _samples(run: Path) -> dict[int, dict]:
    lines = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines() if line.strip()]
    steps = [r["step"] for r in lines]
    assert len(steps) == len(set(steps)), steps  # each step logged once
    return {r["step"]: r for r in lines}


def _expected_ids(step: int, batch: int, n: int) -> set[str]:
    """The sample ids of step ``step`` when prompt groups are trained in the loader's order (epoch 0)."""
    return {f"0-{p}/{j}" for p in range((step - 1) * batch, step * batch) for j in range(n)}


@pytest.fixture
def shared_ray():
    """One local Ray for several runs in this process (each run then starts only its workers)."""
    import ray

    env = {k: os.environ[k] for k in ("OMP_NUM_THREADS", "RAY_AUTH_MODE", "TOKENIZERS_PARALLELISM") if k in os.environ}
    ray.init(address="local", num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1",
             runtime_env={"env_vars": env})
    try:
        yield
    finally:
        ray.shutdown()


def test_async_modes_learn_like_sync(base_overrides, manifest_file, digits_reward, tmp_path, shared_ray):
    accuracy = {}
    for mode in ("sync", "one_step_off_policy", "fully_async"):
        run = tmp_path / mode
        train(manifest_file, [], _overrides(base_overrides, digits_reward, run, STEPS, mode))
        rows = _rows(run)
        train_rows = [r for r in rows if "critic/score/mean" in r]
        assert [r["step"] for r in train_rows] == list(range(1, STEPS + 1))
        accuracy[mode] = train_rows[-1]["val/arithmetic/mean@4"]
        if mode == "sync":
            assert not (run / "samples.jsonl").exists()
            continue
        # staleness within the bound (1 for both modes here), measured per sample and in the metrics
        samples = _samples(run)
        for step, line in samples.items():
            stale = [step - 1 - v for v in line["gen_version"]]
            assert max(stale) <= 1 and min(stale) >= 0, (mode, step, stale)
        assert all(r["async/staleness_max"] <= 1 for r in train_rows)
        assert max(r["async/staleness_max"] for r in train_rows) == 1  # generation really ran ahead
        # the version tags match the weights that generated: a step whose samples all came from the policy it
        # trains sees no gap between the rollout's log-probs and the actor's; a step with stale samples does
        for r in train_rows:
            fresh = r["async/staleness_max"] == 0
            assert (r["rollout/logprob_diff_mean"] < 1e-3) == fresh, (mode, r["step"], r["rollout/logprob_diff_mean"])
        assert any("rollout_corr/" in k or "rollout_is" in k for k in train_rows[-1]), sorted(train_rows[-1])
        ids = [i for line in samples.values() for i in line["sample_ids"]]
        assert len(ids) == len(set(ids)) == STEPS * 4 * 4  # no sample trained twice
    # every mode learned (the random model answers with digits about 5% of the time) ...
    assert accuracy["sync"] >= 0.4, accuracy
    for mode in ("one_step_off_policy", "fully_async"):
        # ... and the async ones as well as the synchronous run, within the margin
        assert accuracy[mode] >= accuracy["sync"] - MARGIN, accuracy


@pytest.mark.timeout(300)
@pytest.mark.parametrize("transfer", ["collective", "object_store"])
def test_fully_async_weights_reach_the_rollout(transfer, base_overrides, manifest_file, digits_reward, tmp_path,
                                               shared_ray):
    """``fully_async`` with each ``trainer.weight_transfer``: with a staleness bound of 0 every trained group must
    come from the policy being trained, so each step's samples carry that version's tag and the rollout's
    log-probs equal the actor's. Weights that did not arrive, arrived late or under the wrong tag would leave
    a gap of about 0.1-0.3 nats per token (one update at this lr)."""
    run = tmp_path / transfer
    train(manifest_file, [], _overrides(base_overrides, digits_reward, run, 3, "fully_async") + [
        f"trainer.weight_transfer={transfer}", "trainer.async_max_staleness=0", "trainer.test_freq=0"])
    rows = [r for r in _rows(run) if "critic/score/mean" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for step, line in _samples(run).items():
        assert set(line["gen_version"]) == {step - 1}, (step, line["gen_version"])
    for r in rows:
        assert r["rollout/logprob_diff_mean"] < 1e-3, (r["step"], r["rollout/logprob_diff_mean"])
    # generation ran ahead of the trainer (groups of the previous version were dropped), so the check bites
    assert rows[-1]["async/dropped_stale_groups"] > 0


@pytest.mark.timeout(300)
def test_fully_async_dynamic_sampling(base_overrides, manifest_file, digits_reward, tmp_path, shared_ray):
    """``algorithm.filter_groups`` in ``fully_async`` (refused before): groups whose samples all scored alike are
    dropped and the step takes the missing groups from the queue until its batch is full, training no prompt
    twice."""
    run = tmp_path / "filtered"
    train(manifest_file, [], _overrides(base_overrides, digits_reward, run, 2, "fully_async") + [
        "algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=score",
        "algorithm.filter_groups.max_num_gen_batches=0", "trainer.test_freq=0"])
    rows = [r for r in _rows(run) if "critic/score/mean" in r]
    assert [r["step"] for r in rows] == [1, 2]
    assert max(r["train/gen_rounds"] for r in rows) > 1  # groups were filtered out and replaced
    samples = _samples(run)
    ids = [i for line in samples.values() for i in line["sample_ids"]]
    assert len(ids) == len(set(ids)) == 2 * 4 * 4  # full batches, nothing trained twice


def _start(manifest: Path, overrides: list[str], fault: str | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("POLYRL_FAULT_AT", None)
    if fault:
        env["POLYRL_FAULT_AT"] = fault
    return subprocess.run([sys.executable, "-m", "polyrl", "train", "--manifest", str(manifest), *overrides],
                          env=env, capture_output=True, text=True, timeout=600)


def test_fully_async_sigkill_and_resume_trains_each_sample_once(base_overrides, manifest_file, digits_reward,
                                                                 tmp_path):
    run = tmp_path / "killed"
    # a staleness bound that never drops (so groups are trained in the loader's order: one rollout worker,
    # a first-in first-out queue) and in-flight generation aborted at every weight update
    args = _overrides(base_overrides, digits_reward, run, 4, "fully_async") + [
        "trainer.save_freq=1", "trainer.max_checkpoints=0", "trainer.test_freq=0", "trainer.async_max_staleness=4",
        "trainer.async_inflight=abort", "trainer.async_chunk_groups=1", "trainer.async_queue_groups=6"]
    proc = _start(manifest_file, args, "update:3")
    assert proc.returncode == -9, proc.stderr[-3000:]
    state = json.loads((run / "checkpoints" / "step_2" / "trainer_state.json").read_text())["rollout_source"]
    queued = {g["row"]["uid"].rpartition("-")[0]: g["version"] for g in state["groups"]}
    assert queued or state["rows"], state  # the checkpoint caught samples ahead of the trainer
    proc = _start(manifest_file, args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    samples = _samples(run)
    assert sorted(samples) == [1, 2, 3, 4]
    for step, line in samples.items():  # every prompt once, none lost, none twice, in the loader's order
        assert len(line["sample_ids"]) == len(set(line["sample_ids"]))
        assert set(line["sample_ids"]) == _expected_ids(step, 4, 4), step
        assert all(step - 1 - v <= 4 for v in line["gen_version"])
    # groups waiting in the queue at the checkpoint were trained from it (with the version that generated them)
    trained = {i.partition("/")[0]: v for line in samples.values() for i, v in zip(line["sample_ids"], line["gen_version"])}
    resumed = [p for p in queued if p in trained]  # the queue may also hold groups beyond step 4's
    assert resumed, (queued, trained)
    for prompt in resumed:
        assert trained[prompt] == queued[prompt], (prompt, queued[prompt], trained[prompt])
    steps = [r["step"] for r in _rows(run) if "critic/score/mean" in r]
    assert steps == [1, 2, 3, 4]


def test_async_mode_needs_split_placement(base_overrides, manifest_file):
    with pytest.raises(ConfigError, match="trainer.placement=split"):
        train(manifest_file, [], base_overrides + ["trainer.async_mode=fully_async", "trainer.executor=local"])
    with pytest.raises(ConfigError, match="trainer.async_mode='sometimes'"):
        train(manifest_file, [], base_overrides + ["trainer.async_mode=sometimes"])
