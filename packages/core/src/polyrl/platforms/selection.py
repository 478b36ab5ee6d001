"""Which platform a run uses, and why.

Order, first match wins:

1. ``trainer.device=NAME`` in the config (anything but ``auto``);
2. the ``POLYRL_PLATFORM`` environment variable (e.g. set once in an Ascend container image);
3. each registered platform probes the machine (``is_available()``), highest ``priority`` metadata
   first: ``npu`` (torch_npu imports and an NPU is visible) and ``rocm`` (``torch.version.hip`` is set
   and a GPU is visible) from their plugins, then ``cuda``;
4. ``cpu``, which is always available.

A platform named explicitly (1 or 2) must be available, or the run stops with the reason. A probe that
raises, or a platform that says it is available but whose device does not answer (``device_count()`` raises
or is 0), is reported naming its plugin: a one-line ``ConfigError`` when the platform was named, a warning
and the next candidate with ``auto``. The choice is logged and the trainer writes it into the run directory
as ``platform.json``.
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
    """Why ``platform`` is not available here: its ``unavailable_reason()`` (declared on
    :class:`~polyrl.protocols.Platform`; a platform written before it was may lack it), never raising."""
    try:
        reason = platform.unavailable_reason()
    except AttributeError:
        reason = ""
    except Exception as exc:  # a broken plugin must not turn an explanation into a traceback
        reason = f"(its unavailable_reason() raised {type(exc).__name__}: {_one_line(exc)})"
    return reason or "its is_available() returned False"


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


def probe_platform(platform: Any) -> str | None:
    """``None`` when ``platform`` is available and its device answers; otherwise why not, in one line: it says
    it is unavailable (with its reason), its ``is_available()`` raised, or it says it is available but
    ``device_count()`` raises or is 0 (a device it does not have). CPU platforms have no device to count."""
    try:
        available = bool(platform.is_available())
    except Exception as exc:
        return f"its is_available() raised {type(exc).__name__}: {_one_line(exc)}"
    if not available:
        return f"not available: {unavailable_reason(platform)}"
    if getattr(platform, "device_type", "cpu") == "cpu":
        return None
    try:
        count = int(platform.device_count())
    except Exception as exc:
        return f"it says it is available, but its device probe (device_count()) raised {type(exc).__name__}: " \
               f"{_one_line(exc)}"
    if count < 1:
        return f"it says it is available, but its device probe found no {platform.device_type} device " \
               "(device_count() is 0)"
    return None


def _plugin_of(pm: Any, name: str) -> str:
    """``plugin 'x' (dist version)`` that registered platform ``name``, for messages."""
    try:
        return str(pm.entry("platform", name).plugin.describe())
    except Exception:  # the registry could not say; the platform's name is in the message anyway
        return "its plugin"


def _build(pm: Any, name: str, source: str) -> Any:
    """Construct the platform registered as ``name``; a constructor that raises is a ConfigError naming the
    plugin (an unknown name lists the registered ones and the pip line)."""
    factory = pm.get("platform", name)
    try:
        return factory()
    except Exception as exc:
        raise ConfigError(f"platform '{name}' ({source}, {_plugin_of(pm, name)}) failed to start: "
                          f"{type(exc).__name__}: {_one_line(exc)}") from None


def _named(name: str, source: str, pm: Any) -> PlatformChoice:
    platform = _build(pm, name, source)
    problem = probe_platform(platform)
    if problem is None:
        return PlatformChoice(platform, source)
    if problem.startswith("not available: "):
        raise ConfigError(f"platform '{name}' ({source}) is not available on this machine: "
                          f"{problem[len('not available: '):]}. Choose another with trainer.device=NAME "
                          f"(or unset {PLATFORM_ENV}); trainer.device=auto detects one.")
    raise ConfigError(f"platform '{name}' ({source}, {_plugin_of(pm, name)}) cannot be used: {problem}. Fix or "
                      f"block that plugin, or choose another platform with trainer.device=NAME.")


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
            try:
                platform = entry.load()()
            except Exception as exc:
                problem: str | None = f"it failed to start: {type(exc).__name__}: {_one_line(exc)}"
            else:
                problem = probe_platform(platform)
            if problem is None:
                probes[entry.name] = "available"
                if choice is None:
                    choice = PlatformChoice(platform, f"detected: '{entry.name}' is the available platform with "
                                                      f"the highest priority ({entry.metadata.get('priority', 0)})")
            elif problem.startswith("not available: "):
                probes[entry.name] = problem
            else:  # a broken probe or a device that does not answer: reported, and the next candidate is tried
                probes[entry.name] = f"error: {problem}"
                logger.warning("platform '%s' (%s) is skipped: %s", entry.name, entry.plugin.describe(), problem)
        if choice is None:
            choice = PlatformChoice(CPUPlatform(), "fallback: no registered platform is available")
        choice = PlatformChoice(choice.platform, choice.reason, probes)
    logger.info("platform %s (%s)", choice.name, choice.reason)
    return choice
