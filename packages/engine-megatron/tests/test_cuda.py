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


# ---------------------------------------------------------------------------- long sequences and experts on CUDA

needs_two = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")


def test_packed_chunked_and_offloaded_steps_on_one_gpu(model_dir, tmp_path):
    """Packed sequences (the engine's own attention, sdpa kernels), log-probs 3 tokens at a time and activation
    offload (pinned host memory) give the step of megatron's attention over padded rows with unchunked logits, on
    one GPU. Peak memory: benchmarks/bench_long_megatron.py."""
    from test_megatron_engine import _run_group

    runs = _run_group(1, model_dir, tmp_path, ["train:tp1unchunked", "train:tp1packed_chunk3", "train:tp1offload"],
                      extra_env={"ENGINE_DIST_CUDA": "1"})
    from test_context_and_expert_parallel import _same_step

    ref = runs["train:tp1unchunked"][0]
    _same_step(runs["train:tp1packed_chunk3"], ref)
    _same_step(runs["train:tp1offload"], ref)


@needs_two
def test_context_and_expert_parallel_on_two_gpus(model_dir, tmp_path):
    """CP=2 (padded and packed) and EP=2 on a tiny Qwen3-MoE over nccl = the one-GPU steps."""
    from test_context_and_expert_parallel import _same_step
    from test_megatron_engine import _run_group

    env = {"ENGINE_DIST_CUDA": "1"}
    two = _run_group(2, model_dir, tmp_path, ["train:cp2", "train:cp2packed", "moe:qwen3_moe:ep2"], extra_env=env)
    one = _run_group(1, model_dir, tmp_path, ["train:tp1", "moe:qwen3_moe:tp1"], extra_env=env)
    _same_step(two["train:cp2"], one["train:tp1"][0])
    _same_step(two["train:cp2packed"], one["train:tp1"][0])
    _same_step(two["moe:qwen3_moe:ep2"], one["moe:qwen3_moe:tp1"][0])
