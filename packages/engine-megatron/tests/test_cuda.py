"""The megatron engine on one CUDA GPU (no CPU emulation): the Engine conformance suite, nccl, TP=PP=1.

Runs where a GPU is at hand: ``pytest -m gpu packages/engine-megatron/tests/test_cuda.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from polyrl.testing import EngineConformance

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from engine_dist import role_config  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from polyrl.models.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("m") / "tiny", size="tiny", seed=0, num_key_value_heads=2)


def _cuda_engine(model_dir: str, role: str = "actor", model_type: str = "causal_lm", **kw):
    from polyrl_engine_megatron.engine import MegatronEngine

    from polyrl.platforms import CUDAPlatform

    platform = CUDAPlatform()
    platform.set_device(0)
    return MegatronEngine(role_config(model_dir, **kw), role=role, model_type=model_type, platform=platform)


class TestMegatronConformanceOnCUDA(EngineConformance):
    @pytest.fixture
    def engine_factory(self, model_dir):
        return lambda role="actor", model_type="causal_lm", **kw: _cuda_engine(str(model_dir), role, model_type, **kw)

    def test_parameters_live_on_the_gpu(self, model_dir):
        engine = _cuda_engine(str(model_dir))
        assert {p.device.type for p in engine.model.parameters()} == {"cuda"}
