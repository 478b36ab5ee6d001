"""Which platform a run uses, and why.

Order, first match wins:

1. ``trainer.device=NAME`` in the config (anything but ``auto``);
2. the ``POLYRL_PLATFORM`` environment variable (e.g. set once in an Ascend container image);
3. each registered platform probes the machine (``is_available()``), highest ``priority`` metadata
   first: ``npu`` (torch_npu imports and an NPU is visible) and ``rocm`` (``torch.version.hip`` is set
   and a GPU is visible) from their plugins, then ``cuda``;
4. ``cpu``, which is always available.

A platform named explicitly (1 or 2) must be available, or the run stops with the reason. The choice is
logged and the trainer writes it into the run directory as ``platform.json``.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from polyrl.errors import ConfigError

logger = logging.getLogger("polyrl.platforms")

#: Environment variable naming the platform when the config says ``trainer.device=auto``.
PLATFORM_ENV = "POLYRL_PLATFORM"


@dataclass(frozen=True)
class PlatformChoice:
    """The platform a process uses, how it was chosen, and what every probe answered."""

    platform: Any
    reason: str
    probes: dict[str, str] = field(default_factory=dict)

    @property
    def name(self) -> str:
        """The chosen platform's registered name."""
        return self.platform.name

    def describe(self) -> dict[str, Any]:
        """A JSON-ready summary: name, reason, backends, placement names and the probes."""
        p = self.platform
        return {
            "name": p.name,
            "reason": self.reason,
            "device_type": p.device_type,
            "dist_backend": p.dist_backend,
            "weight_sync_backend": getattr(p, "weight_sync_backend", p.dist_backend),
            "weight_ipc": getattr(p, "weight_ipc", "none"),
            "visible_devices_env": p.visible_devices_env,
            "ray_resource": p.ray_resource,
            "probes": dict(self.probes),
        }

    def write(self, run_dir: str | Path) -> Path:
        """Write :meth:`describe` to ``run_dir/platform.json``; returns the path."""
        path = Path(run_dir) / "platform.json"
        path.write_text(json.dumps(self.describe(), indent=2) + "\n")
        return path


def unavailable_reason(platform: Any) -> str:
    """Why ``platform`` is not available here: its own ``unavailable_reason()`` where it has one."""
    explain = getattr(platform, "unavailable_reason", None)
    reason = explain() if callable(explain) else ""
    return reason or "its is_available() returned False"


def _named(name: str, source: str, pm: Any) -> PlatformChoice:
    platform = pm.get("platform", name)()  # an unknown name lists the registered ones and the pip line
    if not platform.is_available():
        raise ConfigError(f"platform '{name}' ({source}) is not available on this machine: "
                          f"{unavailable_reason(platform)}. Choose another with trainer.device=NAME "
                          f"(or unset {PLATFORM_ENV}); trainer.device=auto detects one.")
    return PlatformChoice(platform, source)


def select_platform(device: str = "auto", plugins: Any = None,
                    environ: Mapping[str, str] | None = None) -> PlatformChoice:
    """The platform for ``device`` (a registered name or ``auto``), with the reason, logged at INFO.

    ``plugins`` is the plugin manager to read the ``platform`` registry from (default: the process's);
    ``environ`` defaults to ``os.environ``.
    """
    from polyrl.platforms.base import CPUPlatform
    from polyrl.plugins import get_plugin_manager

    pm = plugins or get_plugin_manager()
    env = os.environ if environ is None else environ
    device = (device or "auto").strip()
    if device != "auto":
        choice = _named(device, f"trainer.device={device}", pm)
    elif env.get(PLATFORM_ENV, "").strip() not in ("", "auto"):
        name = env[PLATFORM_ENV].strip()
        choice = _named(name, f"{PLATFORM_ENV}={name}", pm)
    else:
        probes: dict[str, str] = {}
        entries = sorted(pm.registry("platform").entries(), key=lambda e: -int(e.metadata.get("priority", 0)))
        choice = None
        for entry in entries:
            platform = entry.load()()
            if platform.is_available():
                probes[entry.name] = "available"
                if choice is None:
                    choice = PlatformChoice(platform, f"detected: '{entry.name}' is the available platform with "
                                                      f"the highest priority ({entry.metadata.get('priority', 0)})")
            else:
                probes[entry.name] = f"not available: {unavailable_reason(platform)}"
        if choice is None:
            choice = PlatformChoice(CPUPlatform(), "fallback: no registered platform is available")
        choice = PlatformChoice(choice.platform, choice.reason, probes)
    logger.info("platform %s (%s)", choice.name, choice.reason)
    return choice
