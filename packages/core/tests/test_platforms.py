"""Built-in platforms pass the platform conformance suite."""

from __future__ import annotations

import pytest
import torch

from polyrl.platforms import CPUPlatform, CUDAPlatform, detect_platform
from polyrl.testing import PlatformConformance


class TestCPU(PlatformConformance):
    @pytest.fixture
    def platform(self):
        return CPUPlatform()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
class TestCUDA(PlatformConformance):
    @pytest.fixture
    def platform(self):
        return CUDAPlatform()


def test_detect_prefers_available_highest_priority():
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert detect_platform().name == expected


def test_every_registered_platform_is_named_as_registered():
    from polyrl.plugins import PluginManager

    registry = PluginManager(None, entry_points=False).registry("platform")
    for entry in registry.entries():
        assert entry.load()().name == entry.name


def test_the_suite_fails_a_broken_platform(tmp_path):
    class Broken(CPUPlatform):
        dist_backend = "carrier-pigeon"
        visible_devices_env = "CUDA_VISIBLE_DEVICES"  # but no ray_resource

        def memory_stats(self):
            return {"allocated_gib": -1}

    suite = PlatformConformance()
    for check in (suite.test_names, suite.test_worker_placement_attributes, suite.test_memory_and_cache):
        with pytest.raises(AssertionError):
            check(Broken())
