"""Which executor runs a run's worker groups: ``trainer.executor`` = ``auto`` (default), ``ray`` or ``local``.

``local`` runs one rank of every role in the driver process (no Ray, nothing to start: the fastest start and
a debugger that stops anywhere); ``ray`` runs each role group as Ray actors. ``auto`` takes ``local`` unless
the run needs more than one process: ``trainer.n_workers > 1``, ``trainer.placement=split`` (or roles mapped to several pools), an async mode,
or a Ray cluster to join (``trainer.ray_address`` / ``RAY_ADDRESS``). Ray is an extra of the core
(``pip install 'polyrl[ray]'``); a run that needs it without it installed stops before anything starts,
with that line. See docs/running.md, "Executors".
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

from polyrl.errors import ConfigError

#: What installs Ray for polyrl.
RAY_INSTALL = "pip install 'polyrl[ray]'"
#: The values ``trainer.executor`` takes.
EXECUTORS = ("auto", "ray", "local")


def ray_installed() -> bool:
    """Whether ``import ray`` would find Ray (checked without importing it)."""
    try:
        return importlib.util.find_spec("ray") is not None
    except (ImportError, ValueError):  # a broken or half-removed install
        return False


def ray_reason(trainer: Any) -> str | None:
    """The setting of the ``trainer`` block that needs Ray workers (``"trainer.n_workers=2"``), or ``None``."""
    if int(getattr(trainer, "n_workers", 1)) > 1:
        return f"trainer.n_workers={trainer.n_workers}"
    placement = getattr(trainer, "placement", "colocated")
    if isinstance(placement, str):
        if placement == "split":
            return "trainer.placement=split"
    elif hasattr(placement, "values"):  # roles mapped to named pools: more than one pool, or a pool of several
        pools = {str(v) for v in placement.values()}
        sizes = dict(getattr(trainer, "pools", None) or {})
        if len(pools) > 1 or any(int(n) > 1 for n in sizes.values()):
            return f"trainer.placement={dict(placement)}"
    mode = str(getattr(trainer, "async_mode", "sync"))
    if mode not in ("sync", ""):
        return f"trainer.async_mode={mode}"
    address = (str(getattr(trainer, "ray_address", "") or "") or os.environ.get("RAY_ADDRESS", "")).strip()
    if address:
        return f"trainer.ray_address={address}" if getattr(trainer, "ray_address", "") else f"RAY_ADDRESS={address}"
    return None


def resolve_executor(config: Any) -> str:
    """Replace ``trainer.executor=auto`` in ``config`` by ``ray`` or ``local`` (see the module docstring) and
    return it. Raises :class:`~polyrl.errors.ConfigError` for an unknown value, or when the run needs Ray and
    Ray is not installed (one line, with the ``pip install`` line)."""
    trainer = config.trainer
    value = str(trainer.executor).strip().lower()
    if value not in EXECUTORS:
        raise ConfigError(f"config key 'trainer.executor': {trainer.executor!r} is not an executor; choose one of "
                          f"{', '.join(EXECUTORS)}")
    reason = ray_reason(trainer)
    if value == "auto":
        value = "ray" if reason else "local"
    if value == "ray" and not ray_installed():
        why = reason or "trainer.executor=ray"
        raise ConfigError(f"{why} needs Ray worker processes, and Ray is not installed: {RAY_INSTALL} "
                          "(or run in this process: trainer.executor=local, one worker)")
    trainer.executor = value
    return value


__all__ = ["EXECUTORS", "RAY_INSTALL", "ray_installed", "ray_reason", "resolve_executor"]
