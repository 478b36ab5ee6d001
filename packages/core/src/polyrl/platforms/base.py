"""The built-in CPU and CUDA platforms.

These are the only core modules that call ``torch.cuda``; everything else asks a
:class:`polyrl.protocols.Platform`. Selection lives in :mod:`polyrl.platforms.selection`.
"""

from __future__ import annotations

from typing import Any

import torch


class CPUPlatform:
    """Plain CPU: gloo process groups, nothing to cache or sleep."""

    name = "cpu"
    device_type = "cpu"
    dist_backend = "gloo"
    weight_sync_backend = "gloo"
    visible_devices_env = None
    ray_resource = None

    def is_available(self) -> bool:
        return True

    def unavailable_reason(self) -> str:
        return ""

    def device_count(self) -> int:
        return 1

    def set_device(self, local_rank: int) -> None:
        pass

    def current_device(self) -> torch.device:
        return torch.device("cpu")

    def synchronize(self) -> None:
        pass

    def rng_state(self) -> torch.Tensor:
        return torch.get_rng_state()

    def set_rng_state(self, state: torch.Tensor) -> None:
        torch.set_rng_state(state)

    def empty_cache(self) -> None:
        pass

    def memory_stats(self) -> dict[str, float]:
        try:
            import resource

            return {"max_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}
        except Exception:  # non-POSIX
            return {}

    def worker_env(self) -> dict[str, str]:
        return {}

    def apply_patches(self) -> None:
        pass


class CUDAPlatform:
    """NVIDIA GPUs through torch.cuda and NCCL. ROCm builds of torch also answer to ``torch.cuda``;
    they belong to the ``rocm`` platform (``polyrl-hw-rocm``), so this one declines them."""

    name = "cuda"
    device_type = "cuda"
    dist_backend = "nccl"
    weight_sync_backend = "nccl"
    visible_devices_env = "CUDA_VISIBLE_DEVICES"
    ray_resource = "GPU"

    def is_available(self) -> bool:
        return getattr(torch.version, "hip", None) is None and torch.cuda.is_available()

    def unavailable_reason(self) -> str:
        if getattr(torch.version, "hip", None) is not None:
            return "this is a ROCm build of torch: use the rocm platform (pip install polyrl-hw-rocm)"
        if torch.version.cuda is None:
            return "this torch is built without CUDA (a CPU build): install a CUDA build of torch"
        if not torch.cuda.is_available():
            return "no NVIDIA GPU is visible (check the driver and CUDA_VISIBLE_DEVICES)"
        return ""

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def set_device(self, local_rank: int) -> None:
        count = torch.cuda.device_count()
        if not 0 <= local_rank < count:
            raise RuntimeError(f"{self.name}: device index {local_rank} is out of range: this process sees {count} "
                               f"device(s) ({self.visible_devices_env} and the worker's Ray resources decide which)")
        torch.cuda.set_device(local_rank)

    def current_device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device())

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def rng_state(self) -> torch.Tensor:
        return torch.cuda.get_rng_state()

    def set_rng_state(self, state: torch.Tensor) -> None:
        torch.cuda.set_rng_state(state)

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def record_memory_history(self, enabled: bool) -> None:
        """Start (or stop) keeping the CUDA caching allocator's history (``trainer.profile.memory``)."""
        if enabled:
            torch.cuda.memory._record_memory_history(max_entries=100_000)
        else:
            torch.cuda.memory._record_memory_history(enabled=None)

    def dump_memory_snapshot(self, path: str) -> bool:
        """Write the allocator's history to ``path`` (open it at https://pytorch.org/memory_viz)."""
        torch.cuda.memory._dump_snapshot(path)
        return True

    def memory_stats(self) -> dict[str, float]:
        gib = 2**30
        return {
            "allocated_gib": torch.cuda.memory_allocated() / gib,
            "reserved_gib": torch.cuda.memory_reserved() / gib,
            "max_allocated_gib": torch.cuda.max_memory_allocated() / gib,
        }

    def worker_env(self) -> dict[str, str]:
        return {}

    def apply_patches(self) -> None:
        pass


def get_platform(name: str, plugins: Any = None) -> Any:
    """The platform registered as ``name`` (``cpu``, ``cuda``, a plugin's ``npu``...); an error if it is
    not available here. See :func:`polyrl.platforms.selection.select_platform`."""
    from polyrl.platforms.selection import select_platform

    return select_platform(name, plugins).platform


def detect_platform(plugins: Any = None) -> Any:
    """``POLYRL_PLATFORM`` if set, else the available platform with the highest ``priority`` metadata
    (CPU is the fallback). See :func:`polyrl.platforms.selection.select_platform`."""
    from polyrl.platforms.selection import select_platform

    return select_platform("auto", plugins).platform
