"""What the megatron engine's start-up checks print: the one-line error and nothing of megatron-core's import
noise (issue 47: eight lines of "Transformer Engine and Apex are not installed" came first)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.timeout(180)
def test_a_layout_error_is_the_only_line_the_dry_run_prints(tmp_path):
    from polyrl.models.tiny import make_tiny_model

    model = make_tiny_model(tmp_path / "tiny", size="tiny", seed=0)
    data = tmp_path / "train.jsonl"
    row = {"prompt": [{"role": "user", "content": "1+2="}], "data_source": "arithmetic",
           "reward_model": {"ground_truth": "3"}}
    data.write_text((json.dumps(row) + "\n") * 8)
    proc = subprocess.run(
        [sys.executable, "-m", "polyrl", "train", "--dry-run", f"model.path={model}", f"data.train_files=[{data}]",
         "data.train_batch_size=4", "actor.ppo_mini_batch_size=2", "rollout.n=2", "actor.engine=megatron",
         "actor.megatron.tensor_model_parallel_size=3", "trainer.n_workers=3", "trainer.logger=[console]",
         f"trainer.run_dir={tmp_path / 'run'}"],
        capture_output=True, text=True, timeout=170, cwd=tmp_path)
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, lines
    assert "actor.megatron.tensor_model_parallel_size (3)" in lines[0]
