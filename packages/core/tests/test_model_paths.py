"""model.path: a local folder or a Hub id; unreachable Hub and missing folders fail fast with the key named."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from polyrl.errors import ConfigError
from polyrl.models.paths import check_model_path, is_hub_id


def test_local_folders(tmp_path):
    (tmp_path / "m").mkdir()
    with pytest.raises(ConfigError, match=r"actor\.model\.path=.*config\.json is missing"):
        check_model_path(str(tmp_path / "m"), "actor.model.path")
    (tmp_path / "m" / "config.json").write_text("{}")
    check_model_path(str(tmp_path / "m"), "actor.model.path")
    check_model_path(str(tmp_path), "actor.model.tokenizer_path", needs_config=False)
    with pytest.raises(ConfigError, match=r"critic\.model\.path=.*is a file"):
        check_model_path(str(tmp_path / "m" / "config.json"), "critic.model.path")
    with pytest.raises(ConfigError, match=r"actor\.model\.path=\./nope: no such folder"):
        check_model_path("./nope", "actor.model.path")
    with pytest.raises(ConfigError, match=r"no such folder"):
        check_model_path(str(tmp_path / "missing"), "actor.model.path")


def test_hub_ids_are_told_apart_from_paths():
    assert is_hub_id("Qwen/Qwen2.5-0.5B") and is_hub_id("gpt2")
    assert not is_hub_id("./models/x") and not is_hub_id("/abs/x") and not is_hub_id("a/b/c") and not is_hub_id("~/x")


_SCRIPT = """
import json, sys, time
from polyrl.errors import ConfigError
from polyrl.models.paths import check_model_path
out = {}
for value in sys.argv[1:]:
    start = time.time()
    try:
        check_model_path(value, "actor.model.path")
        out[value] = "ok"
    except ConfigError as exc:
        out[value] = str(exc)
    out[value + ":s"] = time.time() - start
if "org/cached" in sys.argv[1:]:
    from transformers import AutoConfig
    out["model_type"] = AutoConfig.from_pretrained("org/cached").model_type
print(json.dumps(out))
"""


def _check_in_fresh_process(tmp_path, *values: str, **env: str) -> dict:
    """Hub settings are read at import time: each case runs in its own interpreter, with its own HF cache."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    full_env.update(HF_HOME=str(tmp_path / "hf_home"), HF_ENDPOINT="http://127.0.0.1:9", **env)
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, *values], capture_output=True, text=True, timeout=120,
                          env=full_env)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_unreachable_hub_says_so_and_names_the_key(tmp_path):
    out = _check_in_fresh_process(tmp_path, "Qwen/Qwen2.5-0.5B")
    message = out["Qwen/Qwen2.5-0.5B"]
    assert "actor.model.path=Qwen/Qwen2.5-0.5B is not a local folder" in message
    assert "cannot be reached" in message and "set actor.model.path=DIR" in message
    assert out["Qwen/Qwen2.5-0.5B:s"] < 10  # one probe, not transformers' retries


def test_offline_mode_and_cached_hub_ids(tmp_path):
    snapshot = tmp_path / "hf_home" / "hub" / "models--org--cached" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("abc123")
    out = _check_in_fresh_process(tmp_path, "org/cached", "org/elsewhere", HF_HUB_OFFLINE="1")
    assert out["org/cached"] == "ok" and out["model_type"] == "qwen2"  # transformers resolves the id
    assert "HF_HUB_OFFLINE is set" in out["org/elsewhere"] and "actor.model.path=DIR" in out["org/elsewhere"]
