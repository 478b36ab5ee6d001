"""The CPU emulation of megatron-core: pinned versions, scoping, RNG semantics, and a real training step
(megatron's DDP, optimizers, grad clipping, pipeline schedule) in TP=1 x DP=2, TP=2 and PP=2 over gloo.

If a megatron-core upgrade breaks the emulation, these tests fail: the version pin first, then the step."""

from __future__ import annotations

import importlib.metadata
import sys
from pathlib import Path

import pytest
import torch
from polyrl_engine_megatron import cpu_emulation
from polyrl_engine_megatron.cpu_emulation import TESTED_MEGATRON_CORE, apply_cpu_emulation, check_megatron_core

from polyrl.errors import ConfigError

sys.path.insert(0, str(Path(__file__).parent))
from test_convert import run_pair  # noqa: E402


def test_installed_megatron_core_is_a_tested_version():
    # an upgrade without re-running these tests (and adding the version to TESTED_MEGATRON_CORE) fails here
    assert check_megatron_core() in TESTED_MEGATRON_CORE
    assert importlib.metadata.version("megatron-core") in TESTED_MEGATRON_CORE


def test_untested_or_missing_megatron_core_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.99.0")
    monkeypatch.delenv(cpu_emulation.ALLOW_UNTESTED_ENV, raising=False)
    with pytest.raises(ConfigError) as e:
        check_megatron_core()
    assert "0.99.0" in str(e.value) and "0.16.1" in str(e.value) and "pip install --no-deps megatron-core==" in str(e.value)
    monkeypatch.setenv(cpu_emulation.ALLOW_UNTESTED_ENV, "1")
    assert check_megatron_core() == "0.99.0"

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    with pytest.raises(ConfigError, match="not installed"):
        check_megatron_core()


def test_emulation_is_idempotent_and_scoped_to_megatron():
    apply_cpu_emulation()
    apply_cpu_emulation()
    assert cpu_emulation.cpu_emulation_active()
    random = sys.modules["megatron.core.tensor_parallel.random"]
    assert random.torch.cuda.current_device() == torch.device("cpu")
    assert random.torch.zeros(2, device="cuda").device.type == "cpu"
    # the rest of the process still sees a machine without CUDA, and tensor methods are the real ones
    assert torch.cuda.current_device is not random.torch.cuda.current_device
    with pytest.raises((AssertionError, RuntimeError)):
        torch.cuda.current_device()
    assert torch.zeros(1).type() == "torch.FloatTensor"
    with pytest.raises((AssertionError, RuntimeError)):
        torch.zeros(1).cuda()
    # a megatron module imported after the emulation is patched as it loads
    assert "megatron.core.energy_monitor" not in sys.modules
    import megatron.core.energy_monitor as late

    assert late.torch.cuda.current_device() == torch.device("cpu")


def test_rng_tracker_forks_the_cpu_generator():
    apply_cpu_emulation()
    from megatron.core import tensor_parallel

    tensor_parallel.model_parallel_cuda_manual_seed(123, tp_rank=1, ep_rank=0, etp_rank=0, force_reset_rng=True)
    tracker = tensor_parallel.get_cuda_rng_tracker()
    torch.manual_seed(5)
    expected_outside = torch.rand(3)
    torch.manual_seed(5)
    with tracker.fork():  # megatron's tensor-parallel stream: seed + 2718 + tp_rank
        first = torch.rand(3)
    after = torch.rand(3)
    with tracker.fork():
        second = torch.rand(3)
    assert torch.equal(first, torch.rand(3, generator=torch.Generator().manual_seed(123 + 2718 + 1)))
    assert not torch.equal(first, second)  # the forked stream advances
    assert torch.equal(after, expected_outside)  # and the default stream is left where it was


@pytest.fixture(scope="module")
def step(tmp_path_factory) -> list[dict]:
    return run_pair(tmp_path_factory.mktemp("train"), "train")


def test_one_training_step_agrees_across_layouts(step):
    r0, r1 = step
    for r in step:
        assert r["torch_cuda_untouched"]
        assert all(r[f"{k}/ok"] for k in ("tp1pp1", "tp2pp1", "tp1pp2"))
    norms = [r[f"{k}/grad_norm"] for r in step for k in ("tp1pp1", "tp2pp1", "tp1pp2")]
    assert max(norms) - min(norms) < 1e-5 * max(norms) and norms[0] > 0
    # DP=2: each rank's loss over its half of the rows; the mean is the TP=2 / PP=2 loss over all rows
    dp_loss = (r0["tp1pp1/loss"] + r1["tp1pp1/loss"]) / 2
    assert r0["tp2pp1/loss"] == pytest.approx(dp_loss, rel=1e-6)
    assert r1["tp1pp2/loss"] == pytest.approx(dp_loss, rel=1e-6) and "tp1pp2/loss" not in r0
    base, initial = r0["tp1pp1/weights"], r0["initial"]
    assert max(float((base[k] - initial[k]).abs().max()) for k in initial) > 1e-3  # the step moved weights
    for r in step:
        for layout in ("tp1pp1", "tp2pp1", "tp1pp2"):
            w = r[f"{layout}/weights"]
            assert set(w) == set(initial)
            # Adam's first step is lr * sign-like: float-order noise in tiny gradients shows up at 1e-4 * lr scale
            assert max(float((w[k] - base[k]).abs().max()) for k in base) < 1e-4
