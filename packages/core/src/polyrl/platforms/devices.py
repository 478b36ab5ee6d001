"""Binding a worker process to its device: node-local ranks, visible devices, ``set_device``.

How it fits with Ray. A worker group asks Ray for one ``platform.ray_resource`` per worker (``GPU`` for
CUDA and ROCm, the custom resource ``NPU`` for Ascend; start Ray on an Ascend node with
``ray start --resources='{"NPU": 8}'`` where Ray does not detect the NPUs itself). For the accelerators
it knows, Ray sets the visible-devices variable of each actor to the ids it assigned before the actor's
code runs: ``CUDA_VISIBLE_DEVICES`` for NVIDIA, ``HIP_VISIBLE_DEVICES`` for AMD, and
``ASCEND_RT_VISIBLE_DEVICES`` for ``NPU``. :func:`assign_visible_devices` then makes sure that
``platform.visible_devices_env`` lists this worker's ids (it sets it where Ray left it unset, e.g. under
``RAY_EXPERIMENTAL_NOSET_*_VISIBLE_DEVICES``, unless the user set that variable) and returns the index
of the worker's device among the devices the process sees, which is what ``set_device`` takes. Outside
Ray (the local executor) the process sees what it was started with and binds its node-local rank.

The worker group computes each worker's node-local rank (its position among the group's workers on
the same node) and hands it over as ``LOCAL_RANK``, like ``torchrun`` does.
"""

from __future__ import annotations

import logging
import os
from collections.abc import MutableMapping, Sequence
from typing import Any

logger = logging.getLogger("polyrl.platforms")


def node_local_ranks(node_ids: Sequence[str]) -> list[int]:
    """For rank ``i`` on node ``node_ids[i]``: its position among the ranks on the same node."""
    seen: dict[str, int] = {}
    ranks = []
    for node in node_ids:
        ranks.append(seen.get(node, 0))
        seen[node] = ranks[-1] + 1
    return ranks


def ray_accelerator_ids(resource: str | None) -> list[str]:
    """The ids of ``resource`` Ray assigned to this process (``[]`` outside a Ray worker or for a
    resource Ray does not track per device)."""
    if not resource:
        return []
    try:
        import ray

        if not ray.is_initialized():
            return []
        ids = ray.get_runtime_context().get_accelerator_ids().get(resource, [])
    except Exception:  # not a Ray worker (the driver of a local run)
        return []
    return [str(i) for i in ids]


def assign_visible_devices(platform: Any, *, local_rank: int, assigned: Sequence[str] | None = None,
                           environ: MutableMapping[str, str] | None = None) -> int:
    """Make this worker's devices visible and return the index to pass to ``platform.set_device``.

    ``assigned`` are the device ids this worker holds on its node (default: what Ray assigned for
    ``platform.ray_resource``). Without any (CPU, the local executor) the answer is ``local_rank``.
    Call it before the process touches the device: the device runtime reads the variable once.
    """
    env = os.environ if environ is None else environ
    var = platform.visible_devices_env
    ids = list(ray_accelerator_ids(platform.ray_resource) if assigned is None else assigned)
    if not var or not ids:
        return local_rank
    current = env.get(var)
    if current is None or current.strip() == "":
        env[var] = ",".join(ids)
        logger.info("%s=%s (the %s ids Ray assigned to this worker)", var, env[var], platform.ray_resource)
        return 0
    visible = [v.strip() for v in current.split(",") if v.strip()]
    if visible[: len(ids)] == ids:  # Ray (or the user) narrowed visibility to this worker's devices
        return 0
    if ids[0] in visible:  # every device of the node visible: bind the one assigned to this worker
        return visible.index(ids[0])
    raise RuntimeError(
        f"{var}={current} does not include device {ids[0]}, which Ray assigned to this worker "
        f"(resource {platform.ray_resource}): unset {var} in the worker environment or make it list the node's devices")


def setup_worker_device(device: str, plugins: Any = None, *, local_rank: int,
                        environ: MutableMapping[str, str] | None = None) -> tuple[Any, int]:
    """Pick the platform, make the worker's devices visible, set the platform's worker environment,
    check availability, apply patches and bind the device. Returns ``(platform, device index)``.

    With a named ``device`` the platform is constructed before it probes the device, so the visible
    devices are in place before the device runtime starts; ``auto`` probes first (the trainer resolves
    ``auto`` on the driver and hands workers the name, so this path is for ad-hoc workers).
    """
    from polyrl.platforms.selection import select_platform, unavailable_reason
    from polyrl.plugins import get_plugin_manager

    env = os.environ if environ is None else environ
    pm = plugins or get_plugin_manager()
    if device in ("", "auto", None):
        platform = select_platform("auto", pm, env).platform
    else:
        platform = pm.get("platform", device)()
    index = assign_visible_devices(platform, local_rank=local_rank, environ=env)
    env["LOCAL_RANK"] = str(local_rank)
    for key, value in platform.worker_env().items():
        env.setdefault(key, value)
    if not platform.is_available():
        raise RuntimeError(
            f"worker (local rank {local_rank}): platform '{platform.name}' is not available in this process: "
            f"{unavailable_reason(platform)} ({platform.visible_devices_env}="
            f"{env.get(platform.visible_devices_env or '', '<unset>')})")
    platform.apply_patches()
    platform.set_device(index)
    return platform, index
