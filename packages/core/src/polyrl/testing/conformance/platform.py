"""Conformance suite for platforms.

Provide a ``platform`` fixture returning an *available* platform instance (skip the
class where the device is absent; ask the platform, not ``torch.<device>``):

```python
@pytest.mark.skipif(not CUDAPlatform().is_available(), reason="needs a CUDA GPU")
class TestCUDA(PlatformConformance):
    @pytest.fixture
    def platform(self):
        return CUDAPlatform()
```
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

KNOWN_BACKENDS = ("gloo", "nccl", "hccl", "xccl", "mccl", "cncl")


class PlatformConformance:
    """What every platform promises (see :class:`polyrl.protocols.Platform`)."""

    def test_names(self, platform):
        assert isinstance(platform.name, str) and platform.name
        assert isinstance(platform.device_type, str) and platform.device_type
        torch.device(platform.device_type)  # a device type torch knows
        assert platform.dist_backend in KNOWN_BACKENDS, platform.dist_backend
        assert platform.weight_sync_backend in KNOWN_BACKENDS, platform.weight_sync_backend

    def test_worker_env(self, platform):
        env = platform.worker_env()
        assert isinstance(env, dict)
        assert all(isinstance(k, str) and k and isinstance(v, str) for k, v in env.items()), env

    def test_worker_placement_attributes(self, platform):
        # The controller sets visible_devices_env per worker and asks Ray for ray_resource.
        env, resource = platform.visible_devices_env, platform.ray_resource
        assert env is None or (isinstance(env, str) and env.isupper()), env
        assert resource is None or (isinstance(resource, str) and resource), resource
        assert (env is None) == (resource is None), "a device needing a Ray resource also needs a visibility env var"

    def test_available_and_device(self, platform):
        assert platform.is_available()
        assert platform.unavailable_reason() == "", "an available platform gives no reason for being unavailable"
        assert platform.device_count() >= 1
        platform.set_device(0)
        device = platform.current_device()
        assert isinstance(device, torch.device) and device.type == platform.device_type
        assert torch.ones(2, device=device).sum().item() == 2

    def test_memory_and_cache(self, platform):
        platform.set_device(0)
        keep = torch.ones(1024, 1024, device=platform.current_device())
        stats = platform.memory_stats()
        assert isinstance(stats, dict)
        assert all(isinstance(k, str) and isinstance(v, float) for k, v in stats.items()), stats
        assert all(math.isfinite(v) and v >= 0 for v in stats.values()), stats
        del keep
        platform.empty_cache()
        platform.apply_patches()
        platform.apply_patches()  # idempotent

    def test_rng_state_restores_the_device_stream(self, platform, tmp_path):
        """The state survives a checkpoint (``torch.load(weights_only=True)``) and replays the device's draws."""
        platform.set_device(0)
        device = platform.current_device()
        state = platform.rng_state()
        assert isinstance(state, torch.Tensor) and state.dtype == torch.uint8, type(state)
        first = torch.rand(8, device=device)
        assert not torch.equal(torch.rand(8, device=device), first), "the device generator does not advance"
        torch.save({"rng": state}, tmp_path / "rng.pt")
        platform.set_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True)["rng"])
        assert torch.equal(torch.rand(8, device=device), first)

    def test_synchronize(self, platform):
        platform.set_device(0)
        t = torch.arange(4.0, device=platform.current_device()) * 2
        platform.synchronize()
        assert t.sum().item() == 12.0

    def test_dist_backend_runs_a_collective(self, platform, tmp_path):
        """A one-process group on ``dist_backend`` (and on ``weight_sync_backend`` where it differs)
        all-reduces a tensor on ``current_device()``."""
        if dist.is_initialized():
            pytest.skip("a torch.distributed group is already initialised in this process")
        platform.set_device(0)
        device = platform.current_device()
        for i, backend in enumerate(dict.fromkeys((platform.dist_backend, platform.weight_sync_backend))):
            dist.init_process_group(backend, init_method=f"file://{tmp_path / f'pg{i}'}", rank=0, world_size=1)
            try:
                t = torch.full((3,), 2.0, device=device)
                dist.all_reduce(t)
                assert t.device.type == platform.device_type and t.tolist() == [2.0, 2.0, 2.0], backend
            finally:
                dist.destroy_process_group()
