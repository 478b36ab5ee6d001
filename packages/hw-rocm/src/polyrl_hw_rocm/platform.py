"""The ``rocm`` platform: AMD GPUs through a ROCm build of torch.

A ROCm build answers to ``torch.cuda`` (device type ``cuda``) and runs the ``nccl`` backend on RCCL, so
the device calls are the CUDA platform's; what differs is detection (``torch.version.hip``), the
visible-devices variable, and the switches ROCm's vLLM and SGLang builds need.
"""

from __future__ import annotations

import os

import torch

from polyrl.platforms.base import CUDAPlatform

INSTALL_HINT = "install a ROCm build of torch (pip install torch --index-url https://download.pytorch.org/whl/rocmX.Y)"


class ROCmPlatform(CUDAPlatform):
    """AMD GPUs: ``cuda`` devices of a HIP build of torch, RCCL through the ``nccl`` backend,
    ``HIP_VISIBLE_DEVICES`` and the Ray resource ``GPU`` for placement."""

    name = "rocm"
    device_type = "cuda"  # ROCm builds of torch name HIP devices "cuda"
    dist_backend = "nccl"  # RCCL, under torch's nccl backend name
    weight_sync_backend = "nccl"
    # Ray's AMD accelerator manager sets HIP_VISIBLE_DEVICES for actors that ask for GPU (and refuses
    # to start where only ROCR_VISIBLE_DEVICES is set).
    visible_devices_env = "HIP_VISIBLE_DEVICES"
    ray_resource = "GPU"

    def is_available(self) -> bool:
        return self.unavailable_reason() == ""

    def unavailable_reason(self) -> str:
        """``""`` when a ROCm torch sees a GPU; otherwise what is missing."""
        if getattr(torch.version, "hip", None) is None:
            return f"this torch ({torch.__version__}) is not a ROCm build (torch.version.hip is None): {INSTALL_HINT}"
        if not torch.cuda.is_available() or torch.cuda.device_count() < 1:
            shown = ", ".join(f"{v}={os.environ.get(v, '<unset>')}"
                              for v in ("HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES"))
            return f"torch {torch.version.hip} (HIP) sees no AMD GPU ({shown}; check rocm-smi and /dev/kfd access)"
        return ""

    def worker_env(self) -> dict[str, str]:
        """What ROCm's vLLM and SGLang builds need in a worker; set only where the user did not."""
        env = {
            # vLLM's worker processes must be spawned, not forked, once the parent touched the GPU.
            "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
        }
        hip = os.environ.get("HIP_VISIBLE_DEVICES")
        if hip:
            # vLLM's ROCm platform (and SGLang, which reads CUDA_VISIBLE_DEVICES to count devices) needs
            # CUDA_VISIBLE_DEVICES to agree with HIP_VISIBLE_DEVICES.
            env["CUDA_VISIBLE_DEVICES"] = hip
        return env
