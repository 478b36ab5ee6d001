"""Device platforms. The built-ins are ``cpu`` and ``cuda``; NPU and ROCm come as plugins.

:func:`detect_platform` picks the available platform with the highest priority;
``trainer.device=NAME`` in a config picks one by name.
"""

from __future__ import annotations

from polyrl.platforms.base import CPUPlatform, CUDAPlatform, detect_platform, get_platform

__all__ = ["CPUPlatform", "CUDAPlatform", "detect_platform", "get_platform"]
