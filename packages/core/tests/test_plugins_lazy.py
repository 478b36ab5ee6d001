"""Listing plugins stays light: no torch, tensordict, transformers or ray in the process afterwards.

Registrations are ``"module:attr"`` strings imported on first use, and the packages next to the
built-in hooks modules import their heavy parts lazily, so ``polyrl plugins`` and ``polyrl --help``
answer in well under a second. Each check runs in a fresh interpreter (this test process has torch).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

HEAVY = ("torch", "tensordict", "transformers", "ray", "vllm", "peft")

_SCRIPT = """
import contextlib, io, json, sys
from polyrl.cli import main
argv = json.loads(sys.argv[1])
out = io.StringIO()
with contextlib.redirect_stdout(out):
    try:
        code = main(argv)
    except SystemExit as exc:  # --help exits
        code = exc.code
for module in json.loads(sys.argv[2]):
    __import__(module)
print(json.dumps({"code": code, "out": out.getvalue(), "heavy": sorted(m for m in json.loads(sys.argv[3])
                                                                        if m in sys.modules)}))
"""


def _run(argv: list[str], extra_modules: list[str] = ()) -> dict:
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, json.dumps(argv), json.dumps(list(extra_modules)),
                           json.dumps(HEAVY)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("argv", [["plugins"], ["plugins", "--json"], ["plugins", "-v"], ["--help"]])
def test_listing_imports_nothing_heavy(argv):
    result = _run(argv)
    assert result["code"] == 0
    assert "plugins" in result["out"]  # the listing (or the help naming the verb) was written
    assert result["heavy"] == [], f"`polyrl {' '.join(argv)}` imported {result['heavy']}"


def test_listing_covers_every_installed_plugin():
    """The check above is meaningful only if the listing really loaded the installed plugins' hooks."""
    result = _run(["plugins", "--json"])
    listed = {p["module"] for p in json.loads(result["out"])["plugins"]}
    assert "polyrl.platforms.hooks" in listed and "polyrl.algorithms.hooks" in listed
    for module in ("polyrl_engine_fsdp.hooks", "polyrl_rollout_vllm.hooks", "polyrl_example.hooks",
                   "polyrl_hw_ascend.hooks", "polyrl_hw_rocm.hooks"):
        if importlib.util.find_spec(module.split(".")[0]) is not None:
            assert module in listed


def test_plugin_hooks_modules_import_nothing_heavy():
    """Every hooks module of this repo, imported directly (a manifest ``modules`` entry does that)."""
    from polyrl.plugins import DEFAULT_PLUGINS

    plugins = ("polyrl_engine_fsdp.hooks", "polyrl_rollout_vllm.hooks", "polyrl_example.hooks",
               "polyrl_hw_ascend.hooks", "polyrl_hw_rocm.hooks")
    modules = list(DEFAULT_PLUGINS) + [m for m in plugins if importlib.util.find_spec(m.split(".")[0]) is not None]
    result = _run(["plugins"], modules)
    assert result["heavy"] == [], f"importing {modules} pulled in {result['heavy']}"
