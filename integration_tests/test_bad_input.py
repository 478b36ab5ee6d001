"""Bad input to `polyrl train`: a raising reward function, malformed rows, CLI errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from polyrl.errors import DataError
from polyrl.trainer.commands import train


def test_raising_reward_function_gets_fallback_and_is_counted(base_overrides, manifest_file, tmp_path):
    reward = tmp_path / "flaky_reward.py"
    reward.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    if len(solution_str) % 2:\n"
        "        raise RuntimeError('flaky reward')\n"
        "    return 1.0\n"
    )
    train(manifest_file, [], base_overrides + ["trainer.executor=local", f"reward.function={reward}:compute_score",
                                               "trainer.val_before_train=false"])
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    failures = [r.get("reward/failures", 0) for r in rows if "critic/score/mean" in r]
    assert sum(failures) > 0


def test_malformed_row_names_file_and_row(base_overrides, manifest_file, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": [{"role": "user", "content": "1+1="}], "data_source": "arithmetic",
                               "reward_model": {"ground_truth": "2"}}) + "\n" + json.dumps({"data_source": "x"}) + "\n")
    with pytest.raises(DataError) as err:
        train(manifest_file, [], base_overrides + [f"data.train_files=[{bad}]"])
    assert "bad.jsonl" in str(err.value) and "1" in str(err.value) and "prompt" in str(err.value)


def test_cli_unknown_key_exits_2_with_clean_message(base_overrides, manifest_file):
    proc = subprocess.run([sys.executable, "-m", "polyrl", "train", "--manifest", str(manifest_file),
                           *base_overrides, "trainer.totl_steps=1"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "Did you mean 'trainer.total_steps'" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("estimator", ["optimal_token_baseline", "tir_optimal_token_baseline"])
def test_estimator_needing_sum_pi_squared_is_refused_before_workers_start(base_overrides, manifest_file, tmp_path,
                                                                          estimator):
    from polyrl.errors import ConfigError

    with pytest.raises(ConfigError, match="sum_pi_squared"):
        train(manifest_file, [], base_overrides + ["trainer.executor=local", f"algorithm.adv_estimator={estimator}"])
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_broken_platform_plugin_is_one_line_naming_it(base_overrides, tmp_path):
    """A platform plugin that says it is available but has no device: named by ``trainer.device`` it stops the run
    before anything starts, with one line naming the plugin (``auto`` skips it: packages/core/tests/test_platforms.py)."""
    (tmp_path / "ghost_platform.py").write_text(
        "from polyrl import hookimpl\n"
        "from polyrl.platforms import CPUPlatform\n\n\n"
        "class GhostPlatform(CPUPlatform):\n"
        "    name = 'ghost'\n"
        "    device_type = 'meta'\n\n"
        "    def device_count(self):\n"
        "        return 0\n\n\n"
        "@hookimpl\n"
        "def register_platforms(register):\n"
        "    register('ghost', GhostPlatform, priority=99)\n")
    manifest = tmp_path / "ghost.toml"
    manifest.write_text('[plugins]\nrequire = ["polyrl-engine-fsdp>=0.1,<0.2"]\nmodules = ["ghost_platform"]\n')
    env = {**__import__("os").environ, "PYTHONPATH": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-m", "polyrl", "train", "--manifest", str(manifest), *base_overrides,
                           "trainer.device=ghost", "trainer.executor=local"],
                          capture_output=True, text=True, timeout=300, env=env)
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "platform 'ghost'" in err[-1] and "ghost_platform" in err[-1] and "device probe" in err[-1], err
