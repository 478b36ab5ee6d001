"""The README's first install lines are the light route and work as written (issue 47: they started with
``make dist``, which builds the whole development venv: Ray, megatron-core, diffusion, lint and docs tools)."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _install_commands() -> list[list[str]]:
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Install\n", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block, "README's Install section has no bash block"
    lines = [ln.split("  #", 1)[0].strip() for ln in block.group(1).splitlines()]
    return [shlex.split(ln) for ln in lines if ln and not ln.startswith("#")]


def test_the_first_install_lines_are_torch_cpu_then_the_two_packages():
    commands = _install_commands()
    assert all(c[:2] == ["pip", "install"] for c in commands), commands  # no make, no development venv
    torch, packages = commands
    assert torch[2].startswith("torch==") and "https://download.pytorch.org/whl/cpu" in torch  # CPU torch first
    paths = [a for a in packages[2:] if not a.startswith("-")]
    assert [Path(p).name for p in paths] == ["core", "engine-fsdp"], paths
    for p in paths:
        assert (ROOT / p / "pyproject.toml").is_file(), p


@pytest.mark.timeout(240)
def test_the_two_packages_build_from_the_paths_the_readme_names(tmp_path):
    """What pip does with those paths: build a wheel with the package's own build backend (hatchling), no make, no
    development tools. (Built here without build isolation: CI has no index; pip on a fresh machine fetches
    hatchling into an isolated build environment.)"""
    paths = [a for a in _install_commands()[1][2:] if not a.startswith("-")]
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet",
                           "--wheel-dir", str(tmp_path), *paths], cwd=ROOT, capture_output=True, text=True,
                          timeout=230)
    assert proc.returncode == 0, proc.stderr[-2000:]
    wheels = sorted(p.name for p in tmp_path.glob("*.whl"))
    assert [w.split("-")[0] for w in wheels] == ["polyrl", "polyrl_engine_fsdp"], wheels
    with zipfile.ZipFile(next(tmp_path.glob("polyrl-*.whl"))) as whl:
        assert "polyrl/cli.py" in whl.namelist()
