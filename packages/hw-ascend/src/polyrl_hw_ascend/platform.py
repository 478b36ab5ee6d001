"""The ``npu`` platform: Huawei Ascend NPUs through torch-npu (``torch.npu``) and HCCL.

``torch_npu`` is imported by :meth:`NPUPlatform.is_available` and the device calls, never when this
module or the plugin's hooks load, so a machine without it lists and skips the platform cheaply.
"""

from __future__ import annotations

import logging
import os
from types import ModuleType
from typing import Any

import torch

logger = logging.getLogger("polyrl_hw_ascend")

INSTALL_HINT = ("install torch-npu matching your torch release and CANN toolkit (pip install torch-npu==<torch "
                "version>; see docs/platforms.md) and source CANN's set_env.sh")


def import_torch_npu() -> ModuleType:
    """``torch_npu`` (which also registers ``torch.npu``); an ``ImportError`` naming what to install."""
    try:
        import torch_npu
    except ModuleNotFoundError as exc:
        if exc.name != "torch_npu":
            raise ImportError(f"torch_npu is installed but failed to import ({exc}): {INSTALL_HINT}") from exc
        raise ImportError(f"the npu platform needs torch_npu, which is not installed: {INSTALL_HINT}") from exc
    except Exception as exc:  # CANN libraries missing or mismatched: torch_npu raises at import
        raise ImportError(f"torch_npu failed to import ({type(exc).__name__}: {exc}): {INSTALL_HINT}") from exc
    return torch_npu


class NPUPlatform:
    """Ascend NPUs: ``torch.npu`` devices, HCCL for training and weight sync, ``ASCEND_RT_VISIBLE_DEVICES``
    and the Ray resource ``NPU`` for placement, and torch-npu kernels for transformers models."""

    name = "npu"
    device_type = "npu"
    dist_backend = "hccl"
    weight_sync_backend = "hccl"
    visible_devices_env = "ASCEND_RT_VISIBLE_DEVICES"
    ray_resource = "NPU"

    def __init__(self) -> None:
        self._why_unavailable = ""

    # ------------------------------------------------------------------ probing
    def _npu(self) -> Any:
        import_torch_npu()
        return torch.npu

    def is_available(self) -> bool:
        try:
            npu = self._npu()
        except ImportError as exc:
            self._why_unavailable = str(exc)
            return False
        if not npu.is_available() or npu.device_count() < 1:
            visible = os.environ.get(self.visible_devices_env, "<unset>")
            self._why_unavailable = (f"torch_npu imports but no NPU is visible to this process "
                                     f"({self.visible_devices_env}={visible}; check npu-smi info, and that the Ray "
                                     f"worker asked for the NPU resource)")
            return False
        self._why_unavailable = ""
        return True

    def unavailable_reason(self) -> str:
        """Why :meth:`is_available` answered False (probes first if it was never asked)."""
        if not self._why_unavailable:
            self.is_available()
        return self._why_unavailable

    # ------------------------------------------------------------------ device
    def device_count(self) -> int:
        return self._npu().device_count()

    def set_device(self, local_rank: int) -> None:
        npu = self._npu()
        count = npu.device_count()
        if not 0 <= local_rank < count:
            raise RuntimeError(f"npu: device index {local_rank} is out of range: this process sees {count} NPU(s) "
                               f"({self.visible_devices_env}={os.environ.get(self.visible_devices_env, '<unset>')})")
        npu.set_device(local_rank)

    def current_device(self) -> torch.device:
        return torch.device("npu", self._npu().current_device())

    def synchronize(self) -> None:
        self._npu().synchronize()

    def rng_state(self) -> torch.Tensor:
        return self._npu().get_rng_state()

    def set_rng_state(self, state: torch.Tensor) -> None:
        self._npu().set_rng_state(state)

    def empty_cache(self) -> None:
        self._npu().empty_cache()

    def memory_stats(self) -> dict[str, float]:
        npu, gib = self._npu(), 2**30
        return {
            "allocated_gib": npu.memory_allocated() / gib,
            "reserved_gib": npu.memory_reserved() / gib,
            "max_allocated_gib": npu.max_memory_allocated() / gib,
        }

    # ------------------------------------------------------------------ processes and models
    def worker_env(self) -> dict[str, str]:
        """What a worker (and vllm-ascend as its rollout) needs; set only where the user did not."""
        return {
            # vLLM's own worker processes must be spawned: a forked child of a process that touched
            # the NPU has no usable device context.
            "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
            # HCCL gives up on link set-up after 120 s by default; ranks that load a large model at
            # different speeds need longer (the process group itself waits 30 minutes).
            "HCCL_CONNECT_TIMEOUT": "1800",
        }

    def apply_patches(self) -> None:
        """torch-npu kernels for transformers' RMSNorm and rotary embedding (see :mod:`.patches`)."""
        from polyrl_hw_ascend.patches import apply_npu_patches

        apply_npu_patches(import_torch_npu())
