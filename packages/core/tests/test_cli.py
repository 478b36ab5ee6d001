"""The polyrl CLI: --version, plugins (text and JSON), clean errors."""

from __future__ import annotations

import json
import subprocess
import sys

from polyrl.__about__ import __version__


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "polyrl", *args], capture_output=True, text=True, timeout=120)


def test_version():
    assert run("--version").stdout.strip() == f"polyrl {__version__}"


def test_plugins_json_lists_builtins_and_their_names():
    proc = run("plugins", "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    by_name = {p["name"]: p for p in data["plugins"]}
    algo = by_name["polyrl.algorithms.hooks"]
    assert algo["distribution"] == "polyrl" and algo["version"] == __version__
    assert "register_advantage_estimators" in algo["hooks"]
    assert "grpo" in algo["registered"]["advantage_estimator"]


def test_plugins_text_with_manifest(tmp_path):
    m = tmp_path / "m.toml"
    m.write_text("[plugins]\nrequire = []\n")
    proc = run("plugins", "--manifest", str(m))
    assert proc.returncode == 0 and "advantage_estimator: gae" in proc.stdout


def test_bad_manifest_is_a_clean_error(tmp_path):
    m = tmp_path / "m.toml"
    m.write_text("[plugins]\nrequire = [\n")
    proc = run("plugins", "--manifest", str(m))
    assert proc.returncode == 2 and "malformed TOML" in proc.stderr and "Traceback" not in proc.stderr
