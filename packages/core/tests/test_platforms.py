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
