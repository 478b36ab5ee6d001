"""Conformance suite for platforms. Provide a ``platform`` fixture (an available platform)."""

from __future__ import annotations

import torch


class PlatformConformance:
    """What every platform promises (see :class:`polyrl.protocols.Platform`)."""

    def test_names(self, platform):
        assert platform.name and platform.device_type and platform.dist_backend in ("gloo", "nccl", "hccl", "xccl")

    def test_available_and_device(self, platform):
        assert platform.is_available()
        assert platform.device_count() >= 1
        platform.set_device(0)
        device = platform.current_device()
        assert isinstance(device, torch.device) and device.type == platform.device_type
        assert torch.ones(2, device=device).sum().item() == 2

    def test_memory_and_cache(self, platform):
        platform.empty_cache()
        stats = platform.memory_stats()
        assert all(isinstance(v, float) for v in stats.values())
        platform.apply_patches()
        platform.apply_patches()  # idempotent
