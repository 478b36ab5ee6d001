"""Shared fixtures for cross-package runs: a tiny model, arithmetic data and a base run config."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# polyrl's fixtures (real_model_dir: the real SmolLM2-135M-Instruct, built once per run; tiny_model_dir...)
pytest_plugins = ["polyrl.testing"]


def pytest_configure(config):
    config.addinivalue_line("markers", "vllm: needs vLLM (runs in .venv-vllm)")
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU")
    config.addinivalue_line("markers", "npu: needs an Ascend NPU with torch-npu (polyrl-hw-ascend)")
    config.addinivalue_line("markers", "rocm: needs an AMD GPU with a ROCm build of torch (polyrl-hw-rocm)")
    config.addinivalue_line("markers", "slow: a longer end-to-end run")


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
def parity_reward(tmp_path_factory) -> Path:
    """A reward with variance even for a random model (so advantages and gradients are non-zero)."""
    path = tmp_path_factory.mktemp("reward") / "parity_reward.py"
    path.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return {'score': float(sum(map(ord, solution_str)) % 2), 'acc': 0.0}\n"
    )
    return path


@pytest.fixture
def base_overrides(tiny_model, arithmetic_files, parity_reward, tmp_path) -> list[str]:
    """A 2-step GRPO run of the tiny model, small enough for a test."""
    return [
        f"reward.function={parity_reward}:compute_score",
        f"model.path={tiny_model}",
        f"data.train_files=[{arithmetic_files['train']}]",
        f"data.val_files=[{arithmetic_files['val']}]",
        "data.train_batch_size=4",
        "data.max_prompt_length=32",
        "data.max_response_length=6",
        "actor.engine=fsdp",
        "actor.ppo_mini_batch_size=2",
        "actor.micro_batch_size=8",
        "actor.optim.lr=1e-3",
        "rollout.n=4",
        "trainer.total_steps=2",
        "trainer.progress_bar=false",
        "trainer.logger=[jsonl]",
        f"trainer.run_dir={tmp_path / 'run'}",
    ]


@pytest.fixture
def manifest_file(tmp_path) -> Path:
    path = tmp_path / "polyrl.toml"
    path.write_text('[plugins]\nrequire = ["polyrl-engine-fsdp>=0.1,<0.2"]\n')
    return path
