"""torch-npu kernels for transformers models, applied when the ``npu`` platform starts a worker.

What is patched (in the modeling modules of Llama, Mistral, Qwen2 and Qwen3, where present):

- ``<Model>RMSNorm.forward`` -> ``torch_npu.npu_rms_norm`` (one fused kernel instead of a float32
  variance, rsqrt and two multiplies);
- the module's ``apply_rotary_pos_emb`` -> ``torch_npu.npu_rotary_mul`` on query and key (the fused
  "rotate half" kernel).

Attention needs no patch: on a machine with torch_npu, transformers runs ``attn_implementation="sdpa"``
on torch-npu's fused SDPA and maps ``flash_attention_2`` to ``torch_npu.npu_fusion_attention`` itself.
Patches are applied once per process and can be undone with :func:`remove_npu_patches`.
"""

from __future__ import annotations

import importlib
import logging
from types import ModuleType
from typing import Any

logger = logging.getLogger("polyrl_hw_ascend")

#: transformers model families whose RMSNorm and rotary embedding match torch-npu's kernels.
MODEL_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")

_originals: dict[tuple[Any, str], Any] = {}
_patched: list[str] = []


def _rms_norm_forward(torch_npu: ModuleType) -> Any:
    def forward(self: Any, hidden_states: Any) -> Any:
        return torch_npu.npu_rms_norm(hidden_states, self.weight, epsilon=self.variance_epsilon)[0]

    return forward


def _apply_rotary_pos_emb(torch_npu: ModuleType) -> Any:
    def apply_rotary_pos_emb(q: Any, k: Any, cos: Any, sin: Any, unsqueeze_dim: int = 1) -> tuple[Any, Any]:
        cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
        return torch_npu.npu_rotary_mul(q, cos, sin), torch_npu.npu_rotary_mul(k, cos, sin)

    return apply_rotary_pos_emb


def _replace(owner: Any, attr: str, new: Any) -> None:
    _originals.setdefault((owner, attr), getattr(owner, attr))
    setattr(owner, attr, new)


def apply_npu_patches(torch_npu: ModuleType) -> list[str]:
    """Patch the model families' RMSNorm and rotary embedding to torch-npu kernels; returns what was
    patched (``["qwen2.RMSNorm", "qwen2.rotary", ...]``). Idempotent."""
    if _originals:
        return list(_patched)
    patched = _patched
    for family in MODEL_FAMILIES:
        try:
            module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
        except ImportError:  # an older transformers without this family
            continue
        norm = next((getattr(module, n) for n in dir(module) if n.lower() == f"{family}rmsnorm"), None)
        if norm is not None:
            _replace(norm, "forward", _rms_norm_forward(torch_npu))
            patched.append(f"{family}.RMSNorm")
        if hasattr(module, "apply_rotary_pos_emb"):
            _replace(module, "apply_rotary_pos_emb", _apply_rotary_pos_emb(torch_npu))
            patched.append(f"{family}.rotary")
    logger.info("torch-npu kernels patched into transformers: %s", ", ".join(patched) or "nothing")
    return list(patched)


def remove_npu_patches() -> None:
    """Undo :func:`apply_npu_patches` (tests; a process that leaves the NPU)."""
    while _originals:
        (owner, attr), original = _originals.popitem()
        setattr(owner, attr, original)
    _patched.clear()
