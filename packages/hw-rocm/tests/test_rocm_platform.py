"""The rocm platform without AMD hardware: registration, names, detection against cuda, errors,
and the visible-devices mapping on a real local Ray.

What needs an AMD GPU (the conformance suite's device checks) is marked ``rocm`` and skips here with the
probe's reason.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile

import pytest
import torch

from polyrl.errors import ConfigError
from polyrl.platforms import CUDAPlatform, select_platform
from polyrl.plugins import PluginManager
from polyrl.testing import PlatformConformance
from polyrl_hw_rocm.platform import ROCmPlatform

pytestmark = pytest.mark.smoke  # also run on the package installed alone (make test-packages)

HAS_ROCM = ROCmPlatform().is_available()


@pytest.mark.rocm
@pytest.mark.skipif(not HAS_ROCM, reason=f"needs an AMD GPU with ROCm torch: {ROCmPlatform().unavailable_reason()}")
class TestROCmConformance(PlatformConformance):
    @pytest.fixture
    def platform(self):
        return ROCmPlatform()


def test_placement_and_environment_checks_of_the_suite_pass_without_hardware():
    suite = PlatformConformance()
    suite.test_worker_placement_attributes(ROCmPlatform())
    suite.test_worker_env(ROCmPlatform())


def test_names_backends_and_resources():
    p = ROCmPlatform()
    assert (p.name, p.device_type, p.dist_backend, p.weight_sync_backend) == ("rocm", "cuda", "nccl", "nccl")
    assert (p.visible_devices_env, p.ray_resource) == ("HIP_VISIBLE_DEVICES", "GPU")


def test_worker_env_keeps_cuda_visible_devices_in_step_with_hip(monkeypatch):
    monkeypatch.setenv("HIP_VISIBLE_DEVICES", "3")
    assert ROCmPlatform().worker_env() == {"VLLM_WORKER_MULTIPROC_METHOD": "spawn", "CUDA_VISIBLE_DEVICES": "3"}
    monkeypatch.delenv("HIP_VISIBLE_DEVICES")
    assert "CUDA_VISIBLE_DEVICES" not in ROCmPlatform().worker_env()


def test_registered_through_the_entry_point_between_npu_and_cuda():
    pm = PluginManager(None)
    entries = {e.name: e for e in pm.registry("platform").entries()}
    assert entries["rocm"].load() is ROCmPlatform and pm.get("platform", "amd") is ROCmPlatform
    assert entries["cuda"].metadata["priority"] < entries["rocm"].metadata["priority"]
    if "npu" in entries:
        assert entries["rocm"].metadata["priority"] < entries["npu"].metadata["priority"]


def test_hooks_import_nothing_heavy():
    code = ("import sys, polyrl_hw_rocm, polyrl_hw_rocm.hooks\n"
            "print(sorted(m for m in ('torch', 'polyrl_hw_rocm.platform') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]", out.stdout


@pytest.mark.skipif(HAS_ROCM, reason="checks a machine without ROCm")
def test_a_torch_without_hip_is_a_clear_error():
    p = ROCmPlatform()
    assert not p.is_available()
    assert "not a ROCm build (torch.version.hip is None)" in p.unavailable_reason()
    with pytest.raises(ConfigError, match=r"platform 'rocm' \(trainer.device=rocm\) is not available.*rocm"):
        select_platform("rocm", PluginManager(None), environ={})


def _pretend_rocm(monkeypatch, devices: int) -> None:
    monkeypatch.setattr(torch.version, "hip", "6.4.0", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: devices > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: devices)


def test_detection_takes_rocm_for_a_hip_build_and_cuda_declines_it(monkeypatch):
    _pretend_rocm(monkeypatch, devices=2)
    assert not CUDAPlatform().is_available()
    choice = select_platform("auto", PluginManager(None), environ={})
    assert choice.name == "rocm" and choice.probes["cuda"].startswith("not available"), choice
    assert select_platform("auto", PluginManager(None), environ={"POLYRL_PLATFORM": "cpu"}).name == "cpu"


def test_hip_build_without_a_visible_gpu_names_the_variables(monkeypatch):
    _pretend_rocm(monkeypatch, devices=0)
    monkeypatch.setenv("HIP_VISIBLE_DEVICES", "")
    reason = ROCmPlatform().unavailable_reason()
    assert "sees no AMD GPU" in reason and "HIP_VISIBLE_DEVICES=" in reason and "ROCR_VISIBLE_DEVICES=" in reason


def test_gpu_workers_on_ray_get_hip_visible_devices():
    """Ray assigns ``GPU`` ids; each worker's HIP_VISIBLE_DEVICES names its own (set by Ray's AMD manager on
    an AMD node, by the platform here where Ray sees no AMD GPU and sets only CUDA_VISIBLE_DEVICES)."""
    ray = pytest.importorskip("ray")
    from polyrl.controller.worker_group import RayWorkerGroup

    class Probe:
        def __init__(self, *, rank: int, world_size: int) -> None:
            import os

            from polyrl.platforms import assign_visible_devices
            from polyrl_hw_rocm.platform import ROCmPlatform

            p = ROCmPlatform()
            index = assign_visible_devices(p, local_rank=int(os.environ["LOCAL_RANK"]))
            self.seen = {"ids": ray.get_runtime_context().get_accelerator_ids()["GPU"], "index": index,
                         "hip": os.environ.get("HIP_VISIBLE_DEVICES"), "env": p.worker_env(),
                         "local_rank": os.environ["LOCAL_RANK"]}

        def ready(self) -> bool:
            return True

        def report(self) -> dict:
            return self.seen

        def close(self) -> None:
            pass

    temp = tempfile.mkdtemp(prefix="prl-rocm-", dir="/tmp")
    ray.init(num_cpus=2, num_gpus=2, _temp_dir=temp, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"RAY_AUTH_MODE": "disabled", "OMP_NUM_THREADS": "1"}})
    try:
        group = RayWorkerGroup(Probe, 2, resources_per_worker={"CPU": 1, "GPU": 1}, name="rocm-probe")
        seen = group.call_all("report")
        group.shutdown()
    finally:
        ray.shutdown()
        shutil.rmtree(temp, ignore_errors=True)
    assert sorted(s["ids"][0] for s in seen) == ["0", "1"] and [s["local_rank"] for s in seen] == ["0", "1"]
    for s in seen:
        assert s["hip"] == s["ids"][0] and s["index"] == 0, s
        assert s["env"]["CUDA_VISIBLE_DEVICES"] == s["ids"][0], s
