"""Placement on a real local Ray with the custom resource ``NPU``: what each worker sees.

No NPU is needed: Ray hands out ``NPU`` ids like any accelerator, the worker group computes node-local
ranks, and the platform's visibility variable is set per worker; the device probe then fails in the
worker with a message that names the variable.
"""

from __future__ import annotations

import shutil
import tempfile

import pytest

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def npu_ray():
    temp = tempfile.mkdtemp(prefix="prl-npu-", dir="/tmp")  # Ray's socket paths must stay short
    ray.init(num_cpus=2, resources={"NPU": 2}, _temp_dir=temp, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"RAY_AUTH_MODE": "disabled", "OMP_NUM_THREADS": "1"}})
    yield
    ray.shutdown()
    shutil.rmtree(temp, ignore_errors=True)


def _probe_class():
    class Probe:
        """Binds like a polyrl worker would, then reports what it saw."""

        def __init__(self, *, rank: int, world_size: int) -> None:
            import os

            from polyrl.platforms import assign_visible_devices
            from polyrl_hw_ascend.platform import NPUPlatform

            self.seen = {"rank": rank, "LOCAL_RANK": os.environ.get("LOCAL_RANK"),
                         "LOCAL_WORLD_SIZE": os.environ.get("LOCAL_WORLD_SIZE"),
                         "ray_ids": ray.get_runtime_context().get_accelerator_ids()["NPU"],
                         "env_before": os.environ.get("ASCEND_RT_VISIBLE_DEVICES")}
            self.seen["index"] = assign_visible_devices(NPUPlatform(), local_rank=int(os.environ["LOCAL_RANK"]))
            self.seen["env_after"] = os.environ.get("ASCEND_RT_VISIBLE_DEVICES")

        def ready(self) -> bool:
            return True

        def report(self) -> dict:
            return self.seen

        def setup_error(self) -> str:
            from polyrl.platforms import setup_worker_device

            try:
                setup_worker_device("npu", local_rank=int(self.seen["LOCAL_RANK"]))
            except RuntimeError as exc:
                return str(exc)
            return ""

        def close(self) -> None:
            pass

    return Probe


@pytest.mark.parametrize("ray_sets_it", [True, False], ids=["ray-sets-visibility", "noset-controller-sets-it"])
def test_each_worker_sees_its_own_npu(npu_ray, ray_sets_it):
    from polyrl.controller.worker_group import RayWorkerGroup

    env = {} if ray_sets_it else {"RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES": "1"}
    group = RayWorkerGroup(_probe_class(), 2, resources_per_worker={"CPU": 1, "NPU": 1}, env=env, name="npu-probe")
    try:
        seen = group.call_all("report")
        errors = group.call_all("setup_error")
    finally:
        group.shutdown()
    assert [s["LOCAL_RANK"] for s in seen] == ["0", "1"] and {s["LOCAL_WORLD_SIZE"] for s in seen} == {"2"}
    ids = [s["ray_ids"] for s in seen]
    assert sorted(i[0] for i in ids) == ["0", "1"] and all(len(i) == 1 for i in ids), ids
    for s in seen:
        assert s["env_before"] == (s["ray_ids"][0] if ray_sets_it else None), s
        assert s["env_after"] == s["ray_ids"][0] and s["index"] == 0, s
    for s, err in zip(seen, errors):
        assert "platform 'npu' is not available in this process" in err and "torch_npu" in err, err
        assert f"ASCEND_RT_VISIBLE_DEVICES={s['ray_ids'][0]}" in err, err
