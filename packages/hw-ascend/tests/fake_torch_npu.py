"""A stand-in for ``torch_npu`` on machines without Ascend hardware: the same kernel signatures,
computed in plain torch, and a ``torch.npu`` module with a configurable device count.

It lets the tests check what the platform does around torch-npu (probing, error messages, which
kernels the patches call with which arguments); what the kernels compute on an NPU is hardware work.
"""

from __future__ import annotations

import importlib.machinery
import sys
import types

import torch


def make() -> types.ModuleType:
    """A fake ``torch_npu`` module with the two kernels the patches use; ``.calls`` counts their calls."""
    calls: dict[str, int] = {"npu_rms_norm": 0, "npu_rotary_mul": 0}

    def npu_rms_norm(x, gamma, epsilon=1e-6):
        calls["npu_rms_norm"] += 1
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + epsilon)
        return (gamma * (xf * rstd).to(x.dtype)), rstd

    def npu_rotary_mul(x, r1, r2):
        calls["npu_rotary_mul"] += 1
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * r1 + rotated * r2

    module = types.ModuleType("torch_npu")
    module.__spec__ = importlib.machinery.ModuleSpec("torch_npu", None)
    module.npu_rms_norm, module.npu_rotary_mul, module.calls = npu_rms_norm, npu_rotary_mul, calls
    return module


def install(monkeypatch, device_count: int = 2) -> types.ModuleType:
    """Put a fake ``torch_npu`` in ``sys.modules`` and a fake ``torch.npu``; returns the fake module."""
    module = make()
    npu = types.SimpleNamespace(is_available=lambda: device_count > 0, device_count=lambda: device_count)
    monkeypatch.setitem(sys.modules, "torch_npu", module)
    monkeypatch.setattr(torch, "npu", npu, raising=False)
    return module
