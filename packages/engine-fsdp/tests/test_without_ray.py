"""polyrl and this engine without Ray (``polyrl[ray]`` not installed): ``train``, ``sft`` and ``export`` run on the
local executor, a clean console, and a config that asks for Ray workers gets one line with the install line.

In ``make test-packages`` these run in a venv where Ray is not installed at all; in the development venv Ray is
made unimportable (``sys.modules["ray"] = None``, which is what Python does for a module that is absent).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from polyrl.testing.console import console_noise

pytestmark = pytest.mark.smoke

#: Runs the polyrl CLI in a fresh interpreter where ``import ray`` fails.
NO_RAY_CLI = "import sys; sys.modules['ray'] = None; from polyrl.cli import main; raise SystemExit(main(sys.argv[1:]))"


@pytest.fixture(scope="module")
def run_files(tmp_path_factory):
    from polyrl.data.synthetic import make_arithmetic_rows, write_jsonl
    from polyrl.models.tiny import make_tiny_model

    root = tmp_path_factory.mktemp("no-ray")
    model = make_tiny_model(root / "tiny", size="tiny", seed=0)
    rows = make_arithmetic_rows(48, seed=0, max_operand=9, ops="+")
    write_jsonl(rows[:40], root / "train.jsonl")
    write_jsonl(rows[40:], root / "val.jsonl")
    write_jsonl([dict(r, response=str(r["reward_model"]["ground_truth"])) for r in rows], root / "sft.jsonl")
    manifest = root / "polyrl.toml"
    manifest.write_text('[plugins]\nrequire = ["polyrl-engine-fsdp>=0.1,<0.2"]\n')
    return {"root": root, "model": Path(model), "manifest": manifest}


def _train_args(files: dict, run: Path) -> list[str]:
    return ["train", "--manifest", str(files["manifest"]), f"model.path={files['model']}",
            f"data.train_files=[{files['root'] / 'train.jsonl'}]", f"data.val_files=[{files['root'] / 'val.jsonl'}]",
            "data.train_batch_size=4", "data.max_prompt_length=32", "data.max_response_length=4",
            "actor.ppo_mini_batch_size=4", "actor.micro_batch_size=16", "actor.optim.lr=1e-2", "rollout.n=2",
            "trainer.total_steps=2", "trainer.save_freq=1", "trainer.test_freq=2", f"trainer.run_dir={run}"]


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", NO_RAY_CLI, *args], capture_output=True, text=True, timeout=300)


def test_train_runs_locally_with_a_clean_console_and_a_finished_run_says_so(run_files):
    run = run_files["root"] / "run"
    first = _cli(*_train_args(run_files, run))
    assert first.returncode == 0, first.stderr
    assert console_noise(first.stderr + first.stdout) == [], first.stderr
    err = first.stderr
    assert "step 2:" in err and "polyrl train: finished at step 2 of 2" in err
    assert "last checkpoint: " in err and "polyrl export " in err and "polyrl serve " in err
    assert "executor: local" in (run / "config.yaml").read_text()  # auto, one worker: the local executor
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]

    again = _cli(*_train_args(run_files, run))  # the same command once more: nothing to do
    assert again.returncode == 0, again.stderr
    assert "already finished at step 2 of 2" in again.stderr and "nothing to train" in again.stderr
    assert "step 1:" not in again.stderr and console_noise(again.stderr) == []
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == steps


def test_export_and_sft_without_ray(run_files, monkeypatch, capfd):
    import torch
    from transformers import AutoModelForCausalLM

    from polyrl.cli import main

    monkeypatch.setitem(sys.modules, "ray", None)
    run = run_files["root"] / "run-export"
    assert main(_train_args(run_files, run) + ["trainer.total_steps=1", "trainer.test_freq=0",
                                                "trainer.val_before_train=false"]) == 0
    out = run_files["root"] / "exported"
    assert main(["export", str(run / "checkpoints" / "step_1"), "--to", str(out)]) == 0
    trained = AutoModelForCausalLM.from_pretrained(out)
    base = AutoModelForCausalLM.from_pretrained(run_files["model"])
    ids = torch.tensor([[3, 7, 11, 5]])
    with torch.no_grad():
        assert not torch.allclose(trained(ids).logits, base(ids).logits, atol=1e-5)  # the step's update is in it

    sft_run = run_files["root"] / "sft"
    assert main(["sft", "--manifest", str(run_files["manifest"]), f"model.path={run_files['model']}",
                 f"data.train_files=[{run_files['root'] / 'sft.jsonl'}]", "data.train_batch_size=8",
                 "data.max_prompt_length=32", "data.max_response_length=4", "actor.micro_batch_size=8",
                 "trainer.total_steps=2", f"trainer.run_dir={sft_run}", "trainer.progress_bar=false"]) == 0
    assert (sft_run / "hf" / "config.json").exists()
    err = capfd.readouterr().err
    assert "polyrl sft: finished 2 steps" in err


@pytest.mark.parametrize("setting", ["trainer.n_workers=2", "trainer.executor=ray", "trainer.placement=split"])
def test_asking_for_ray_workers_without_ray_is_one_line_with_the_install_line(run_files, monkeypatch, capfd,
                                                                              setting):
    from polyrl.cli import main

    monkeypatch.setitem(sys.modules, "ray", None)
    run = run_files["root"] / f"ray-{setting}"
    assert main(_train_args(run_files, run) + [setting]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert setting in err[0] and "pip install 'polyrl[ray]'" in err[0]
    assert not run.exists()  # stopped before anything started or was written
