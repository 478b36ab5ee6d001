"""Device platforms. The built-ins are ``cpu`` and ``cuda``; NPU and ROCm come as plugins
(``polyrl-hw-ascend``, ``polyrl-hw-rocm``).

:func:`select_platform` applies the order ``trainer.device=NAME`` > ``POLYRL_PLATFORM`` > probing
(highest priority first) > ``cpu``; :func:`setup_worker_device` binds a worker to its device.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from polyrl.lazy import lazy_getattr

if TYPE_CHECKING:
    from polyrl.platforms.base import CPUPlatform, CUDAPlatform, detect_platform, get_platform
    from polyrl.platforms.devices import assign_visible_devices, node_local_ranks, setup_worker_device
    from polyrl.platforms.selection import PLATFORM_ENV, PlatformChoice, select_platform

# Imported on first use (PEP 562), so that loading the hooks module next to this package
# (``polyrl plugins``) does not import torch.
_EXPORTS = {
    "CPUPlatform": "polyrl.platforms.base",
    "CUDAPlatform": "polyrl.platforms.base",
    "detect_platform": "polyrl.platforms.base",
    "get_platform": "polyrl.platforms.base",
    "PLATFORM_ENV": "polyrl.platforms.selection",
    "PlatformChoice": "polyrl.platforms.selection",
    "select_platform": "polyrl.platforms.selection",
    "assign_visible_devices": "polyrl.platforms.devices",
    "node_local_ranks": "polyrl.platforms.devices",
    "setup_worker_device": "polyrl.platforms.devices",
}


__getattr__ = lazy_getattr(__name__, _EXPORTS)


__all__ = ["PLATFORM_ENV", "CPUPlatform", "CUDAPlatform", "PlatformChoice", "assign_visible_devices", "detect_platform",
           "get_platform", "node_local_ranks", "select_platform", "setup_worker_device"]
