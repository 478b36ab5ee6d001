"""Coming from verl, end to end: a verl-layout config trains like the native one, runs that cannot score their
data stop at start-up, failing rewards stop a run, generations are kept, and ``--dry-run`` stops before workers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from polyrl.errors import ConfigError, RewardError
from polyrl.trainer.commands import train

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "examples" / "quickstart"
ARR = "actor_rollout_ref"


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


def test_verl_layout_quickstart_trains_to_the_native_metrics(tiny_model, arithmetic_files, tmp_path):
    """examples/quickstart/grpo.yaml and grpo_verl.yaml, shortened the same way in each layout: same metrics."""
    native = tmp_path / "native"
    mapped = tmp_path / "verl"
    train(QUICKSTART / "polyrl.toml", [QUICKSTART / "grpo.yaml"], [
        f"model.path={tiny_model}", f"data.train_files=[{arithmetic_files['train']}]",
        f"data.val_files=[{arithmetic_files['val']}]", "data.train_batch_size=4", "data.val_max_samples=8",
        "actor.ppo_mini_batch_size=2", "rollout.n=4", "rollout.val_n=2", "trainer.total_steps=2",
        "trainer.test_freq=2", "trainer.executor=local", "trainer.logger=[jsonl]", f"trainer.run_dir={native}"])
    train(QUICKSTART / "polyrl.toml", [QUICKSTART / "grpo_verl.yaml"], [
        f"{ARR}.model.path={tiny_model}", f"data.train_files={arithmetic_files['train']}",  # one file: no list
        f"data.val_files={arithmetic_files['val']}", "data.train_batch_size=4", "data.val_max_samples=8",
        f"{ARR}.actor.ppo_mini_batch_size=2", f"{ARR}.rollout.n=4", f"{ARR}.rollout.val_kwargs.n=2",
        "trainer.total_training_steps=2", "trainer.test_freq=2", "+trainer.executor=local", "trainer.logger=[file]",
        f"trainer.default_local_dir={mapped}", "+trainer.progress_bar=false"])
    a, b = _metrics(native), _metrics(mapped)
    assert [r["step"] for r in a] == [r["step"] for r in b] == [0, 1, 2]
    measured = ("timing/", "throughput/", "perf/")  # wall times and memory of this machine, not the training
    for ra, rb in zip(a, b):
        keys = {k for k in ra if not k.startswith(measured) and k != "time"}
        assert keys == {k for k in rb if not k.startswith(measured) and k != "time"}
        for key in keys:
            assert ra[key] == pytest.approx(rb[key], rel=1e-6, abs=1e-9), (ra["step"], key)
    assert any("actor/pg_loss" in r for r in a)


@pytest.fixture
def no_workers(monkeypatch):
    """Fails the test if any worker group would start (the check must come first)."""
    import polyrl.trainer.ppo as ppo

    def refuse(*args, **kwargs):
        raise AssertionError("workers started")

    monkeypatch.setattr(ppo, "build_role_groups", refuse)


def _rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("mistake", ["truth_in_another_column", "custom_data_source"])
def test_silent_zero_mistakes_fail_at_start_up_in_one_line(mistake, base_overrides, manifest_file, tmp_path,
                                                           no_workers):
    prompt = [{"role": "user", "content": "1+2="}]
    if mistake == "truth_in_another_column":  # verl's rows keep it under reward_model.ground_truth
        row = {"prompt": prompt, "data_source": "arithmetic", "answer": "3"}
        needles = ["'reward_model.ground_truth'", "'arithmetic'", "data.ground_truth_key=answer"]
    else:  # a data source no built-in reward function scores, and no reward.function
        row = {"prompt": prompt, "data_source": "my_task", "reward_model": {"ground_truth": "3"}}
        needles = ["'my_task'", "reward.function", "column 'data_source'"]
    data = _rows(tmp_path / "rows.jsonl", [row] * 8)
    overrides = [o for o in base_overrides if not o.startswith(("reward.function", "data."))]
    overrides += [f"data.train_files=[{data}]", "data.train_batch_size=4", "data.max_prompt_length=32",
                  "data.max_response_length=6"]
    with pytest.raises(ConfigError) as err:
        train(manifest_file, [], overrides)  # executor ray (the default): no worker, no Ray started
    msg = str(err.value)
    assert "\n" not in msg and all(n in msg for n in needles), msg
    assert not (tmp_path / "run").exists()
    # the fix the message names works: the run gets past the check (stopped at the workers by the fixture)
    fix = "data.ground_truth_key=answer" if mistake == "truth_in_another_column" else \
        "reward.function=arithmetic"
    with pytest.raises(AssertionError, match="workers started"):
        train(manifest_file, [], overrides + [fix])
    # and from the command line: one line, exit 2
    proc = subprocess.run([sys.executable, "-m", "polyrl", "train", "--manifest", str(manifest_file), *overrides],
                          capture_output=True, text=True, timeout=120)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and needles[0] in lines[0], proc.stderr


def test_max_failed_steps_stops_the_run_and_keeps_the_last_checkpoint(base_overrides, manifest_file, tmp_path):
    from polyrl.trainer.checkpoint import CheckpointManager, read_state

    reward = tmp_path / "breaks.py"
    reward.write_text(  # steps 1 and 2 score (16 samples each), then every call raises
        "CALLS = [0]\n"
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    CALLS[0] += 1\n"
        "    if CALLS[0] > 32:\n"
        "        raise RuntimeError('the reward service is down')\n"
        "    return float(len(solution_str) % 2)\n")
    run = tmp_path / "run"
    common = [o for o in base_overrides if not o.startswith(("reward.function", "trainer.total_steps"))]
    common += ["trainer.executor=local", "trainer.val_before_train=false", "trainer.save_freq=1",
               "trainer.total_steps=6", "reward.max_failed_steps=2", "reward.num_workers=0"]
    with pytest.raises(RewardError) as err:
        train(manifest_file, [], common + [f"reward.function={reward}:compute_score"])
    msg = str(err.value)
    assert "steps 3-4" in msg and "reward.max_failed_steps=2" in msg and "step_3" in msg
    rows = {r["step"]: r for r in _metrics(run)}
    assert sorted(rows) == [1, 2, 3, 4]
    assert [rows[s]["reward/all_failed"] for s in (1, 2, 3, 4)] == [0.0, 0.0, 1.0, 1.0]
    manager = CheckpointManager(run)
    assert manager.latest() == run / "checkpoints" / "step_3" and not (run / "checkpoints" / "step_4").exists()
    assert read_state(manager.latest())["global_step"] == 3
    # intact: a run with a working reward resumes from it
    good = tmp_path / "good.py"
    good.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n")
    train(manifest_file, [], common + [f"reward.function={good}:compute_score", "trainer.total_steps=5",
                                       "trainer.resume_override=[reward.function,trainer.total_steps]"])
    rows = {r["step"]: r for r in _metrics(run)}
    assert sorted(rows) == [1, 2, 3, 4, 5] and rows[5]["reward/all_failed"] == 0.0


@pytest.fixture
def offline_trackers(tmp_path, monkeypatch):
    """W&B offline and MLflow's file store, everything under tmp_path (as the tracker tests do)."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    for var in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb_home" / var.lower()))
    for var in ("WANDB_API_KEY", "MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_RUN_ID"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "")
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE")
    monkeypatch.setenv("NETRC", str(tmp_path / "no.netrc"))
    yield
    wandb = sys.modules.get("wandb")
    if wandb is not None:
        wandb.teardown()


def test_generation_dumps_hold_what_was_trained_and_reach_the_trackers(base_overrides, manifest_file, tiny_model,
                                                                       tmp_path, monkeypatch, offline_trackers):
    pytest.importorskip("tensorboard")
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    from transformers import AutoTokenizer

    from polyrl.controller.worker_group import LocalWorkerGroup
    from polyrl.trainer.generations import read_jsonl

    trained: list = []
    dispatch = LocalWorkerGroup.dispatch

    def spy(self, method, batch, **kwargs):
        if method == "update_actor":
            trained.append(batch.clone())
        return dispatch(self, method, batch, **kwargs)

    monkeypatch.setattr(LocalWorkerGroup, "dispatch", spy)
    run = tmp_path / "run"
    train(manifest_file, [], base_overrides + [
        "trainer.executor=local", "trainer.rollout_data_dir=rollouts", "trainer.test_freq=2", "data.val_max_samples=6",
        "trainer.log_val_generations=4", "trainer.logger=[jsonl,tensorboard,wandb,mlflow]"])
    tok = AutoTokenizer.from_pretrained(tiny_model)

    # training: the JSONL of step s is the batch the actor was updated on, row for row, token for token
    assert len(trained) == 2
    for step, batch in enumerate(trained, start=1):
        rows = read_jsonl(run / "rollouts" / f"{step}.jsonl")
        assert len(rows) == batch.batch_size[0] == 16
        width = batch["responses"].shape[1]
        for i, row in enumerate(rows):
            valid = batch["attention_mask"][i, -width:].bool()
            assert row["response"] == tok.decode(batch["responses"][i][valid].tolist(), skip_special_tokens=False)
            p_valid = batch["attention_mask"][i, :-width].bool()
            assert row["prompt"] == tok.decode(batch["prompts"][i][p_valid].tolist(), skip_special_tokens=False)
            assert row["response_length"] == int(valid.sum())
            assert row["score"] == pytest.approx(float(batch["token_level_scores"][i].sum()))
            mask = batch["response_mask"][i].float()
            adv = float((batch["advantages"][i] * mask).sum() / mask.sum().clamp(min=1))
            assert row["advantage"] == pytest.approx(adv, abs=1e-6)
            assert row["step"] == step and row["kind"] == "train"
        assert len({r["sample_id"] for r in rows}) == 16  # every sample its own id
        assert len({r["uid"] for r in rows}) == 4  # 4 prompts x rollout.n=4

    # validation (before training and at step 2): on by default, under the run directory
    for step in (0, 2):
        val = read_jsonl(run / "generations" / "validation" / f"{step}.jsonl")
        assert len(val) == 6 and all(r["kind"] == "validation" and "score" in r and r["response"] for r in val)

    # the first trainer.log_val_generations rows, in each tracker's offline files
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    acc = EventAccumulator(str(run / "tensorboard"), size_guidance={"tensors": 0})
    acc.Reload()
    events = acc.Tensors("val/generations/text_summary")
    assert [e.step for e in events] == [0, 2]
    text = tensor_util.make_ndarray(events[-1].tensor_proto).item().decode()
    assert len([ln for ln in text.splitlines() if ln.startswith("| ")]) == 1 + 4  # header + 4 rows
    val2 = read_jsonl(run / "generations" / "validation" / "2.jsonl")
    assert val2[0]["sample_id"] in text

    [table] = (run / "wandb").glob("offline-run-*/files/media/table/val/generations_2_*.table.json")
    wb = json.loads(table.read_text())
    assert wb["columns"][:2] == ["step", "sample_id"] and len(wb["data"]) == 4
    assert wb["data"][0][wb["columns"].index("response")] == val2[0]["response"]

    [artifact] = (run / "mlruns").glob("*/*/artifacts/generations/val_generations_step_2.json")
    ml = json.loads(artifact.read_text())
    assert ml["data"] == wb["data"]


def test_dry_run_checks_everything_and_starts_nothing(base_overrides, manifest_file, tmp_path, no_workers, caplog):
    common = base_overrides + ["trainer.n_workers=2"]  # executor ray: would start Ray and 2 workers
    with caplog.at_level("INFO", logger="polyrl"):
        assert train(manifest_file, [], common, dry_run=True) == {}
    assert "every start-up check passed" in caplog.text and not (tmp_path / "run").exists()
    with pytest.raises(Exception, match="nope.jsonl"):
        train(manifest_file, [], common + [f"data.val_files=[{tmp_path / 'nope.jsonl'}]"], dry_run=True)
    bad = subprocess.run([sys.executable, "-m", "polyrl", "train", "--manifest", str(manifest_file), "--dry-run",
                          *common, "rollout.tensor_parallel_size=3"], capture_output=True, text=True, timeout=120)
    lines = [ln for ln in bad.stderr.splitlines() if ln.strip()]
    assert bad.returncode == 2 and len(lines) == 1 and "rollout.tensor_parallel_size=3" in lines[0], bad.stderr
    assert not (tmp_path / "run").exists()
