"""`polyrl export` of a run directory someone else made runs nothing from it unless the user says so on the
command line (docs/security.md): a pickle payload planted in a checkpoint (its file manifest recomputed, as
an attacker would), a config that turns on ``trust_remote_code`` for a model folder shipped in the download,
a manifest lock that names modules to import, a config that names a Ray cluster to join.

Each payload would visibly run: it creates a marker file.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from polyrl.errors import CheckpointError, ConfigError
from polyrl.trainer.commands import export, train


class _Payload:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.fixture(scope="module")
def trained_run(tiny_model, arithmetic_files, parity_reward, tmp_path_factory) -> Path:
    """A one-step run of the tiny model with one checkpoint (local executor)."""
    root = tmp_path_factory.mktemp("untrusted")
    manifest = root / "polyrl.toml"
    manifest.write_text('[plugins]\nrequire = ["polyrl-engine-fsdp"]\n')
    run = root / "run"
    train(manifest, [], [
        f"reward.function={parity_reward}:compute_score", f"model.path={tiny_model}",
        f"data.train_files=[{arithmetic_files['train']}]", "data.train_batch_size=4", "data.max_prompt_length=32",
        "data.max_response_length=6", "actor.engine=fsdp", "actor.ppo_mini_batch_size=4", "rollout.n=2",
        "trainer.total_steps=1", "trainer.save_freq=1", "trainer.progress_bar=false", "trainer.logger=[jsonl]",
        "trainer.executor=local", "trainer.val_before_train=false", f"trainer.run_dir={run}"])
    return run


@pytest.fixture
def download(trained_run, tmp_path) -> Path:
    """A copy of the run, as if downloaded: the test changes it."""
    run = tmp_path / "downloaded"
    shutil.copytree(trained_run, run, ignore=shutil.ignore_patterns(".polyrl.lock"))
    return run


def _cli(args: list[str], env_path: Path | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if env_path is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(env_path), env.get("PYTHONPATH", "")) if p)
    return subprocess.run([sys.executable, "-m", "polyrl", *args], env=env, capture_output=True, text=True,
                          timeout=600)


def _edit_config(run: Path, **keys: object) -> None:
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(run / "config.yaml")
    for key, value in keys.items():
        OmegaConf.update(cfg, key.replace("__", "."), value)
    (run / "config.yaml").write_text(OmegaConf.to_yaml(cfg))


def test_a_planted_metadata_payload_is_refused_and_runs_nothing(download, tmp_path):
    from polyrl.checkpoint_io import write_file_manifest

    step = download / "checkpoints" / "step_1"
    marker = tmp_path / "pwned"
    (step / "actor" / ".metadata").write_bytes(pickle.dumps(_Payload(str(marker))))
    write_file_manifest(step / "actor")  # the attacker fixes the manifests too: they detect damage, not intent
    write_file_manifest(step)
    with pytest.raises(CheckpointError, match=r"step_1/actor/\.metadata .*not allowed"):
        export(step, tmp_path / "hf")
    assert not marker.exists(), "exporting the checkpoint ran code stored in it"
    assert not (tmp_path / "hf").exists()


def test_a_damaged_checkpoint_is_refused_before_anything_starts(download, tmp_path):
    shard = download / "checkpoints" / "step_1" / "actor" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match=r"damaged: .*__0_0\.distcp is \d+ bytes where \d+ were written"):
        export(download / "checkpoints" / "step_1", tmp_path / "hf")


def test_trust_remote_code_in_the_run_config_needs_the_flag(download, tiny_model, tmp_path):
    marker = tmp_path / "pwned"
    shipped = download / "model"  # a model folder inside the download, with code transformers would import
    shutil.copytree(tiny_model, shipped)
    config = json.loads((shipped / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "planted.PlantedConfig"}
    (shipped / "config.json").write_text(json.dumps(config))
    (shipped / "planted.py").write_text(
        f"open({str(marker)!r}, 'w').close()\n"
        "from transformers import Qwen2Config\n\nclass PlantedConfig(Qwen2Config):\n    pass\n")
    _edit_config(download, actor__model__path=str(shipped), actor__model__trust_remote_code=True)
    ckpt = download / "checkpoints" / "step_1"
    proc = _cli(["export", str(ckpt), "--to", str(tmp_path / "hf")])
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(err) == 1, proc.stderr[-3000:]
    assert "actor.model.trust_remote_code=true" in err[0] and "--trust-remote-code" in err[0]
    assert not marker.exists()
    with contextlib.suppress(Exception):  # asked for on the command line: transformers runs the shipped code
        export(ckpt, tmp_path / "hf2", trust_remote_code=True)
    assert marker.exists(), "the test's payload never ran even when allowed: it proves nothing"


def test_modules_in_the_manifest_lock_need_the_flag(download, tmp_path):
    marker = tmp_path / "pwned"
    code = tmp_path / "site"
    code.mkdir()
    (code / "polyrl_planted_plugin.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    lock = download / "manifest.lock.toml"
    lock.write_text(lock.read_text().replace("modules = []", 'modules = ["polyrl_planted_plugin"]'))
    assert "polyrl_planted_plugin" in lock.read_text()
    ckpt = download / "checkpoints" / "step_1"
    proc = _cli(["export", str(ckpt), "--to", str(tmp_path / "hf")], env_path=code)
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(err) == 1, proc.stderr[-3000:]
    assert "polyrl_planted_plugin" in err[0] and "--allow-run-modules" in err[0]
    assert not marker.exists()
    proc = _cli(["export", str(ckpt), "--to", str(tmp_path / "hf"), "--allow-run-modules"], env_path=code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert marker.exists() and (tmp_path / "hf" / "config.json").exists()


def test_the_run_configs_ray_cluster_is_not_joined(download, tmp_path, monkeypatch):
    from polyrl.trainer import role_groups as workers

    _edit_config(download, trainer__executor="ray", trainer__ray_address="ray://203.0.113.7:10001")
    seen = {}

    def stop_before_starting(config, **kw):
        seen["address"] = config.trainer.ray_address
        raise ConfigError("stopped by the test")

    monkeypatch.setattr(workers, "open_role_group", stop_before_starting)
    with pytest.raises(ConfigError, match="stopped by the test"):
        export(download / "checkpoints" / "step_1", tmp_path / "hf")
    assert seen == {"address": ""}
