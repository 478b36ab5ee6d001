"""The npu platform without Ascend hardware: registration, names, detection order, errors, patches.

What needs an NPU (the conformance suite's device checks) is marked ``npu`` and skips here with the
probe's reason.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from polyrl.errors import ConfigError
from polyrl.platforms import select_platform
from polyrl.plugins import PluginManager
from polyrl.testing import PlatformConformance
from polyrl_hw_ascend.platform import NPUPlatform

sys.path.insert(0, str(Path(__file__).parent))
import fake_torch_npu  # noqa: E402

pytestmark = pytest.mark.smoke  # also run on the package installed alone (make test-packages)

HAS_NPU = NPUPlatform().is_available()


@pytest.mark.npu
@pytest.mark.skipif(not HAS_NPU, reason=f"needs an Ascend NPU with torch-npu: {NPUPlatform().unavailable_reason()}")
class TestNPUConformance(PlatformConformance):
    @pytest.fixture
    def platform(self):
        return NPUPlatform()


def test_placement_and_environment_checks_of_the_suite_pass_without_hardware():
    suite = PlatformConformance()
    suite.test_worker_placement_attributes(NPUPlatform())
    suite.test_worker_env(NPUPlatform())


def test_names_backends_and_resources():
    p = NPUPlatform()
    assert (p.name, p.device_type, p.dist_backend, p.weight_sync_backend) == ("npu", "npu", "hccl", "hccl")
    assert (p.visible_devices_env, p.ray_resource) == ("ASCEND_RT_VISIBLE_DEVICES", "NPU")
    env = p.worker_env()
    assert env["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn" and int(env["HCCL_CONNECT_TIMEOUT"]) >= 600


def test_registered_through_the_entry_point_above_rocm_and_cuda():
    registry = PluginManager(None).registry("platform")
    entries = {e.name: e for e in registry.entries()}
    assert entries["npu"].load() is NPUPlatform
    assert PluginManager(None).get("platform", "ascend") is NPUPlatform
    assert entries["npu"].metadata["priority"] > entries["cuda"].metadata["priority"]
    if "rocm" in entries:
        assert entries["npu"].metadata["priority"] > entries["rocm"].metadata["priority"]


def test_hooks_import_nothing_heavy():
    code = ("import sys, polyrl_hw_ascend, polyrl_hw_ascend.hooks\n"
            "print(sorted(m for m in ('torch', 'torch_npu', 'polyrl_hw_ascend.platform') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]", out.stdout


@pytest.mark.skipif(HAS_NPU, reason="checks the machine without torch-npu")
def test_missing_torch_npu_is_a_clear_error():
    p = NPUPlatform()
    assert not p.is_available()
    assert "torch_npu, which is not installed" in p.unavailable_reason() and "pip install torch-npu" in p.unavailable_reason()
    with pytest.raises(ConfigError, match=r"platform 'npu' \(trainer.device=npu\) is not available.*torch-npu"):
        select_platform("npu", PluginManager(None), environ={})
    with pytest.raises(ImportError, match="pip install torch-npu"):
        p.set_device(0)


def test_torch_npu_that_fails_to_import_names_the_cause(tmp_path, monkeypatch):
    pkg = tmp_path / "torch_npu"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise OSError('libascendcl.so: cannot open shared object file')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    p = NPUPlatform()
    assert not p.is_available()
    assert "torch_npu failed to import (OSError: libascendcl.so" in p.unavailable_reason()
    assert "set_env.sh" in p.unavailable_reason()


def test_no_visible_npu_is_a_clear_error(monkeypatch):
    fake_torch_npu.install(monkeypatch, device_count=0)
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "")
    p = NPUPlatform()
    assert not p.is_available()
    assert "no NPU is visible" in p.unavailable_reason() and "ASCEND_RT_VISIBLE_DEVICES=" in p.unavailable_reason()


def test_detection_order_with_an_npu_present(monkeypatch, tmp_path):
    fake_torch_npu.install(monkeypatch, device_count=2)
    pm = PluginManager(None)
    choice = select_platform("auto", pm, environ={})
    assert choice.name == "npu" and choice.probes["npu"] == "available" and choice.probes["cpu"] == "available"
    assert choice.probes.get("rocm", "not available").startswith("not available")
    assert json.loads(choice.write(tmp_path).read_text())["dist_backend"] == "hccl"
    assert select_platform("auto", pm, environ={"POLYRL_PLATFORM": "cpu"}).name == "cpu"
    assert select_platform("cpu", pm, environ={"POLYRL_PLATFORM": "npu"}).name == "cpu"


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_patches_route_rmsnorm_and_rotary_through_torch_npu_kernels(family):
    """The patched model computes what the original does, through the torch-npu kernels' signatures."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from polyrl_hw_ascend.patches import apply_npu_patches, remove_npu_patches

    fake = fake_torch_npu.make()
    cfg = AutoConfig.for_model(family, vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    ids = torch.randint(0, 64, (2, 9))
    with torch.no_grad():
        want = model(ids).logits
    try:
        patched = apply_npu_patches(fake)
        assert f"{family}.RMSNorm" in patched and f"{family}.rotary" in patched
        assert apply_npu_patches(fake) == patched  # idempotent
        with torch.no_grad():
            got = model(ids).logits
    finally:
        remove_npu_patches()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # 2 layers x (2 norms) + final norm; 2 layers x (q, k)
    assert fake.calls == {"npu_rms_norm": 5, "npu_rotary_mul": 4}, fake.calls
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, want)
    assert fake.calls == {"npu_rms_norm": 5, "npu_rotary_mul": 4}, "remove_npu_patches left a kernel in place"
