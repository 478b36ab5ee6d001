"""Fixtures of the recipes' tests: a tiny model, the quickstart's arithmetic prompts, rewards and a base run.

Everything here needs only ``polyrl``, ``polyrl-recipes`` and ``polyrl-engine-fsdp``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

pytest_plugins = ["polyrl.testing"]

sys.path.insert(0, str(Path(__file__).parent))
from recipes_testkit import CONTROL_REWARD, DIGITS_REWARD  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    from polyrl.models.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("model") / "tiny", size="tiny", seed=0)


@pytest.fixture(scope="session")
def arithmetic_files(tmp_path_factory) -> dict[str, Path]:
    from polyrl.data.synthetic import make_arithmetic_rows, write_jsonl

    root = tmp_path_factory.mktemp("data")
    rows = make_arithmetic_rows(96, seed=0, max_operand=9, ops="+")
    write_jsonl(rows[:80], root / "train.jsonl")
    write_jsonl(rows[80:], root / "val.jsonl")
    return {"train": root / "train.jsonl", "val": root / "val.jsonl"}


@pytest.fixture(scope="session")
def rewards(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("reward")
    (root / "digits_reward.py").write_text(DIGITS_REWARD)
    (root / "control_reward.py").write_text(CONTROL_REWARD)
    return {"digits": root / "digits_reward.py", "control": root / "control_reward.py"}


@pytest.fixture(scope="session")
def manifest(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("manifest") / "polyrl.toml"
    path.write_text('[plugins]\nrequire = ["polyrl-engine-fsdp>=0.1,<0.2", "polyrl-recipes>=0.1,<0.2"]\n')
    return path


@pytest.fixture
def base_overrides(tiny_model, arithmetic_files, rewards, tmp_path) -> list[str]:
    """GRPO-sized run of the tiny model in this process (``trainer.executor=local``): 4 prompts x 4 samples per
    step, one optimizer step per step, no validation, no checkpoints."""
    return [
        f"model.path={tiny_model}", f"reward.function={rewards['digits']}:compute_score",
        f"data.train_files=[{arithmetic_files['train']}]", f"data.val_files=[{arithmetic_files['val']}]",
        "data.train_batch_size=4", "data.max_prompt_length=32", "data.max_response_length=6",
        "actor.ppo_mini_batch_size=4", "actor.micro_batch_size=16", "actor.optim.lr=1e-2", "rollout.n=4",
        "trainer.total_steps=2", "trainer.progress_bar=false", "trainer.logger=[jsonl]",
        f"trainer.run_dir={tmp_path / 'run'}", "trainer.executor=local", "trainer.test_freq=0",
        "trainer.val_before_train=false", "trainer.save_freq=0", "trainer.seed=1",
    ]
