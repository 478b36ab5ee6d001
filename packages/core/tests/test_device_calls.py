"""No package calls a device module directly: ``torch.cuda`` / ``torch.npu`` belong to platform modules.

Engines, rollouts and the trainer ask their :class:`polyrl.protocols.Platform`, so one plugin brings a
new accelerator everywhere. This scans the source (not docs or comments: the syntax tree) of every
package in the repository and names each stray call by file and line.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]

#: Where device calls are the point: the platform implementations.
PLATFORM_MODULES = {
    "packages/core/src/polyrl/platforms/base.py",
    "packages/hw-ascend/src/polyrl_hw_ascend/platform.py",
    "packages/hw-ascend/src/polyrl_hw_ascend/patches.py",
    "packages/hw-rocm/src/polyrl_hw_rocm/platform.py",
    # emulates torch.cuda for megatron-core on the cpu platform only (it stands in for the device module)
    "packages/engine-megatron/src/polyrl_engine_megatron/cpu_emulation.py",
}
DEVICE_MODULES = ("cuda", "npu")


def source_files(repo: Path = REPO) -> list[Path]:
    """Every package's ``src`` tree and the examples' code (tests excluded)."""
    roots = [*repo.glob("packages/*/src"), *repo.glob("examples")]
    files = {p for root in roots for p in root.rglob("*.py")}
    return sorted(p for p in files if "tests" not in p.relative_to(repo).parts)


def stray_device_calls(path: Path, source: str | None = None) -> list[str]:
    """``file:line: what`` for every direct device-module use in ``path``."""
    tree = ast.parse(path.read_text() if source is None else source, filename=str(path))
    found = []
    for node in ast.walk(tree):
        what = None
        if (isinstance(node, ast.Attribute) and node.attr in DEVICE_MODULES
                and isinstance(node.value, ast.Name) and node.value.id == "torch"):
            what = f"torch.{node.attr}"
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in DEVICE_MODULES and not node.args and not node.keywords):
            what = f".{node.func.attr}() (move tensors with .to(platform.current_device()))"
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names = [a.name for a in node.names] + ([node.module] if isinstance(node, ast.ImportFrom) else [])
            bad = [n for n in names if n and (n.split(".")[0] == "torch_npu" or n in ("torch.cuda", "torch.npu"))]
            what = f"import {bad[0]}" if bad else None
        if what:
            found.append((node.lineno, f"{path}:{node.lineno}: {what}"))
    return [hit for _, hit in sorted(found)]


def test_no_stray_device_calls():
    files = source_files()
    assert any("polyrl_engine_fsdp" in str(p) for p in files), "the scan must cover the engine-fsdp plugin"
    stray = [hit for p in files if str(p.relative_to(REPO)) not in PLATFORM_MODULES
             for hit in stray_device_calls(p.relative_to(REPO), p.read_text())]
    assert not stray, ("direct device calls outside platform modules; ask the platform instead "
                       "(platform.rng_state(), synchronize(), empty_cache(), current_device()...):\n"
                       + "\n".join(stray))


def test_allow_list_names_existing_files():
    missing = [m for m in PLATFORM_MODULES if not (REPO / m).exists()]
    assert not missing, f"stale entries in PLATFORM_MODULES: {missing}"


@pytest.mark.parametrize("code,expected", [
    ("import torch\ntorch.cuda.synchronize()\n", "x.py:2: torch.cuda"),
    ("import torch\nok = 1\nif torch.npu.is_available(): pass\n", "x.py:3: torch.npu"),
    ("t = t.cuda()\n", "x.py:1: .cuda()"),
    ("import torch_npu\n", "x.py:1: import torch_npu"),
    ("from torch.cuda import amp\n", "x.py:1: import torch.cuda"),
])
def test_the_scan_finds_each_kind(code, expected):
    hits = stray_device_calls(Path("x.py"), code)
    assert hits and hits[0].startswith(expected), hits


def test_the_scan_ignores_docs_and_other_attributes():
    code = '"""Never call ``torch.cuda`` directly."""\n# torch.cuda.empty_cache()\nx = torch.version.hip\ny = t.to("cuda")\n'
    assert stray_device_calls(Path("x.py"), code) == []
