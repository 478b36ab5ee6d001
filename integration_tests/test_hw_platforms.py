"""A GRPO run on each accelerator platform plugin: the same trainer, engine and rollout, chosen by name.

Each test runs only where its platform's probe finds the device (markers ``npu`` / ``rocm``) and
skips elsewhere with the probe's reason. The CPU side of the same path (selection, ``platform.json``,
worker binding) runs in every suite: packages/core/tests/test_platforms.py and the plugins' tests.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from polyrl.trainer.commands import train


def _reason(module: str, cls: str) -> tuple[bool, str]:
    if importlib.util.find_spec(module) is None:
        return False, f"{module} is not installed"
    platform = getattr(importlib.import_module(f"{module}.platform"), cls)()
    return platform.is_available(), platform.unavailable_reason()


NPU, NPU_WHY = _reason("polyrl_hw_ascend", "NPUPlatform")
ROCM, ROCM_WHY = _reason("polyrl_hw_rocm", "ROCmPlatform")


def _run_on(device: str, distribution: str, base_overrides: list[str], tmp_path: Path) -> dict:
    manifest = tmp_path / "polyrl.toml"
    manifest.write_text(f'[plugins]\nrequire = ["polyrl-engine-fsdp>=0.1,<0.2", "{distribution}"]\n')
    train(manifest, [], base_overrides + ["trainer.executor=ray", "trainer.n_workers=1", f"trainer.device={device}"])
    run = tmp_path / "run"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "critic/score/mean" in r] == [1, 2]
    return json.loads((run / "platform.json").read_text())


@pytest.mark.npu
@pytest.mark.skipif(not NPU, reason=f"needs an Ascend NPU: {NPU_WHY}")
def test_grpo_on_npu(base_overrides, tmp_path):
    chosen = _run_on("npu", "polyrl-hw-ascend", base_overrides, tmp_path)
    assert chosen["name"] == "npu" and chosen["dist_backend"] == "hccl"


@pytest.mark.rocm
@pytest.mark.skipif(not ROCM, reason=f"needs an AMD GPU with ROCm torch: {ROCM_WHY}")
def test_grpo_on_rocm(base_overrides, tmp_path):
    chosen = _run_on("rocm", "polyrl-hw-rocm", base_overrides, tmp_path)
    assert chosen["name"] == "rocm" and chosen["dist_backend"] == "nccl"
