"""The built-in CPU and CUDA platforms and platform selection."""

from __future__ import annotations

from typing import Any

import torch

from polyrl.errors import ConfigError


class CPUPlatform:
    """Plain CPU: gloo process groups, nothing to cache or sleep."""

    name = "cpu"
    device_type = "cpu"
    dist_backend = "gloo"
    visible_devices_env = None
    ray_resource = None

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return 1

    def set_device(self, local_rank: int) -> None:
        pass

    def current_device(self) -> torch.device:
        return torch.device("cpu")

    def empty_cache(self) -> None:
        pass

    def memory_stats(self) -> dict[str, float]:
        try:
            import resource

            return {"max_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}
        except Exception:  # non-POSIX
            return {}

    def apply_patches(self) -> None:
        pass


class CUDAPlatform:
    """NVIDIA GPUs through torch.cuda and NCCL."""

    name = "cuda"
    device_type = "cuda"
    dist_backend = "nccl"
    visible_devices_env = "CUDA_VISIBLE_DEVICES"
    ray_resource = "GPU"

    def is_available(self) -> bool:
        return torch.cuda.is_available() and getattr(torch.version, "hip", None) is None

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def set_device(self, local_rank: int) -> None:
        torch.cuda.set_device(local_rank % max(1, torch.cuda.device_count()))

    def current_device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device())

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def memory_stats(self) -> dict[str, float]:
        gib = 2**30
        return {
            "allocated_gib": torch.cuda.memory_allocated() / gib,
            "reserved_gib": torch.cuda.memory_reserved() / gib,
            "max_allocated_gib": torch.cuda.max_memory_allocated() / gib,
        }

    def apply_patches(self) -> None:
        pass


def get_platform(name: str, plugins: Any = None) -> Any:
    """The platform registered as ``name`` (``cpu``, ``cuda``, a plugin's ``npu``...)."""
    from polyrl.plugins import get_plugin_manager

    pm = plugins or get_plugin_manager()
    platform = pm.get("platform", name)()
    if not platform.is_available():
        raise ConfigError(f"platform '{name}' is not available on this machine (trainer.device={name})")
    return platform


def detect_platform(plugins: Any = None) -> Any:
    """The available platform with the highest ``priority`` metadata (CPU is the fallback)."""
    from polyrl.plugins import get_plugin_manager

    pm = plugins or get_plugin_manager()
    registry = pm.registry("platform")
    for entry in sorted(registry.entries(), key=lambda e: -int(e.metadata.get("priority", 0))):
        platform = entry.load()()
        if platform.is_available():
            return platform
    return CPUPlatform()
