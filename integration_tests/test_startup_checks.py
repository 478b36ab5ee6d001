"""Start-up checks that ``polyrl train --dry-run`` makes and a real run would otherwise fail on later (issue 47):
every configured logger's package, and the prompt column's key."""

from __future__ import annotations

import json
import sys

import pytest

from polyrl.errors import ConfigError, DataError
from polyrl.trainer.commands import train


@pytest.fixture
def no_workers(monkeypatch):
    """Fails the test if any worker group would start (the check must come first)."""
    import polyrl.trainer.ppo as ppo

    def refuse(*args, **kwargs):
        raise AssertionError("workers started")

    monkeypatch.setattr(ppo, "build_role_groups", refuse)


@pytest.mark.parametrize("backend,package", [("wandb", "wandb"), ("mlflow", "mlflow"),
                                             ("tensorboard", "torch.utils.tensorboard")])
def test_dry_run_refuses_a_logger_whose_package_is_missing(backend, package, base_overrides, manifest_file, tmp_path,
                                                           no_workers, monkeypatch):
    """verl's default trainer.logger lists wandb: a dry run that passed must not leave the run to stop on it."""
    monkeypatch.setitem(sys.modules, package, None)  # the import system's own "not installed": ImportError
    overrides = [o for o in base_overrides if not o.startswith("trainer.logger")]
    with pytest.raises(ConfigError) as err:
        train(manifest_file, [], overrides + [f"trainer.logger=[console,{backend}]"], dry_run=True)
    msg = str(err.value)
    assert "\n" not in msg and "trainer.logger" in msg and f"'{backend}'" in msg, msg
    assert "pip install" in msg and "remove it from trainer.logger" in msg, msg
    assert not (tmp_path / "run").exists()
    # the fix the message names (removing it) passes the dry run
    assert train(manifest_file, [], overrides + ["trainer.logger=[console]"], dry_run=True) == {}


def test_dry_run_refuses_an_unknown_logger(base_overrides, manifest_file, no_workers):
    overrides = [o for o in base_overrides if not o.startswith("trainer.logger")]
    with pytest.raises(ConfigError, match=r"trainer.logger.*'tensorbord'"):
        train(manifest_file, [], overrides + ["trainer.logger=[console,tensorbord]"], dry_run=True)


def test_a_missing_prompt_column_suggests_data_prompt_key(base_overrides, manifest_file, tmp_path, no_workers):
    rows = [{"question": "1+2=", "data_source": "arithmetic", "reward_model": {"ground_truth": "3"}}] * 8
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    overrides = [o for o in base_overrides if not o.startswith("data.")]
    overrides += [f"data.train_files=[{data}]", "data.train_batch_size=4", "data.max_prompt_length=32",
                  "data.max_response_length=6"]
    with pytest.raises(DataError) as err:
        train(manifest_file, [], overrides, dry_run=True)
    msg = str(err.value)
    assert "\n" not in msg and "data.prompt_key=question" in msg, msg
