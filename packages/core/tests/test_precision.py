"""The 16-bit dtype warning (polyrl.platforms.precision): a real probe of this CPU's matrix products, the warning's
wording for a slow dtype, and the hf rollout logging it for ``rollout.dtype``."""

from __future__ import annotations

import logging

import pytest
import torch

from polyrl.platforms import precision
from polyrl.platforms.precision import cpu_matmul_slowdown, slow_dtype_warning, warn_if_slow_dtype


@pytest.fixture
def fresh(monkeypatch):
    """An empty probe cache and warned-keys set for the test (the module keeps them per process)."""
    monkeypatch.setattr(precision, "_SLOWDOWN", {})
    monkeypatch.setattr(precision, "_WARNED", set())
    return precision._SLOWDOWN


def _has_bf16_kernels() -> bool:
    return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def _has_avx512() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return "avx512f" in f.read()
    except OSError:
        return True  # unknown: make no claim below


def test_the_probe_agrees_with_the_cpus_kernels(fresh):
    """The measured bfloat16 / float32 ratio of this CPU: under the limit where oneDNN has bf16 kernels, far over it
    on an AVX2-only CPU (measured 50x on one)."""
    ratio = cpu_matmul_slowdown(torch.bfloat16)
    assert ratio > 0 and fresh[torch.bfloat16] == ratio
    if _has_bf16_kernels():
        assert ratio <= precision.SLOWDOWN_LIMIT, ratio
        assert slow_dtype_warning(torch.bfloat16, torch.device("cpu"), "rollout.dtype") is None
    elif not _has_avx512():
        assert ratio > 5 * precision.SLOWDOWN_LIMIT, ratio
        assert "rollout.dtype=float32" in slow_dtype_warning(torch.bfloat16, torch.device("cpu"), "rollout.dtype")


def test_no_probe_for_float32_or_an_accelerator(fresh):
    assert slow_dtype_warning(torch.float32, torch.device("cpu"), "rollout.dtype") is None
    assert slow_dtype_warning(torch.bfloat16, torch.device("cuda", 0), "rollout.dtype") is None
    assert fresh == {}  # nothing measured


def test_warning_names_the_key_the_ratio_and_the_fix(fresh, caplog):
    fresh[torch.bfloat16] = 50.3  # what an AVX2-only host measured
    fresh[torch.float16] = 1.2
    with caplog.at_level(logging.WARNING, logger="polyrl.platforms"):
        message = warn_if_slow_dtype(torch.bfloat16, torch.device("cpu"), "actor.fsdp.param_dtype")
        warn_if_slow_dtype(torch.bfloat16, torch.device("cpu"), "actor.fsdp.param_dtype")  # once per key
        assert warn_if_slow_dtype(torch.float16, torch.device("cpu"), "rollout.dtype") is None
    assert message is not None and message.startswith("actor.fsdp.param_dtype=bfloat16: ")
    assert "50x slower" in message and "set actor.fsdp.param_dtype=float32" in message
    assert [r.getMessage() for r in caplog.records] == [message]


def test_the_hf_rollout_warns_for_a_slow_rollout_dtype(fresh, tmp_path, caplog):
    from transformers import AutoTokenizer

    from polyrl.config.roles import RolloutConfig
    from polyrl.models.tiny import make_tiny_model
    from polyrl.rollout.hf import HFRollout

    path = make_tiny_model(tmp_path / "model", size="tiny", seed=0)
    tok = AutoTokenizer.from_pretrained(path)
    fresh[torch.bfloat16] = 40.0
    with caplog.at_level(logging.WARNING, logger="polyrl.platforms"):
        HFRollout(RolloutConfig(dtype="bfloat16"), model_path=str(path), tokenizer=tok)
        HFRollout(RolloutConfig(dtype="float32"), model_path=str(path), tokenizer=tok)
    warnings = [r.getMessage() for r in caplog.records if r.name == "polyrl.platforms"]
    assert len(warnings) == 1 and warnings[0].startswith("rollout.dtype=bfloat16: ")
