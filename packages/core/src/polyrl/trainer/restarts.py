"""Restarts: a run that lost a worker (its process or its node) resumes from its last checkpoint by itself.

``trainer.max_restarts`` (default 0: the run stops with one line naming the lost worker, and resumes when started
again) lets :func:`fit_with_restarts` catch :class:`~polyrl.controller.deadlines.WorkerLostError` (or Ray's error for a lost actor) up to that many
times. Each time the failed run has already torn its worker groups down (``fit`` stops them on any error); the
driver waits up to ``trainer.restart_wait_s`` for the cluster to offer the run's layout again (the pools' CPUs and
accelerators; a local Ray is simply started afresh), builds a new trainer from the same config and fits it with
``trainer.resume=auto``: it continues from the newest whole checkpoint, the lines the lost attempt logged after it
are dropped and those steps run again, so the history holds every step once, as an uninterrupted run's would.
A layout that does not come back in time stops the run with one line saying what is missing. See docs/cluster.md,
"Deadlines and restarts".
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from polyrl.controller.deadlines import lost_worker_in
from polyrl.errors import ConfigError

log = logging.getLogger("polyrl")

#: Seconds between two looks at the cluster's resources while waiting for the layout.
POLL_S = 1.0
#: Seconds a node listed as alive has to run a small task before it counts as gone (at most what is left of the wait).
PROBE_S = 30.0


def fit_with_restarts(make_trainer: Callable[[int], Any]) -> dict[str, float]:
    """``make_trainer(attempt).fit()``, made again (``attempt`` 1, 2, ...) after a lost worker while
    ``trainer.max_restarts`` allows; the last attempt's metrics."""
    from polyrl.controller.worker_group import placement_deadline

    attempt = 0
    trainer = make_trainer(attempt)
    placement_left: float | None = None  # a restart: what is left of trainer.restart_wait_s for its placement
    while True:
        limit = int(trainer.config.trainer.max_restarts)
        try:
            if placement_left is None:
                return trainer.fit()
            with placement_deadline(placement_left, "what was left of trainer.restart_wait_s after the layout came "
                                    "back"):
                return trainer.fit()
        except Exception as exc:
            # Ray's own actor error where a call did not go through the deadline-aware wait (a rollout or weight
            # sync call that met the lost node first) is a lost worker too
            lost = lost_worker_in(exc)
            if lost is None or (lost is exc and attempt >= limit):
                raise
        if attempt >= limit:
            raise lost  # outside the except block: the CLI prints this line, not Ray's error it replaces
        attempt += 1
        log.warning("restart %d of %d (trainer.max_restarts): %s", attempt, limit, lost)
        waited = time.monotonic()
        wait_for_layout(trainer, lost_node=lost.node_id)
        # the groups' placement waits no longer than the restart's wait has left (not Ray's own 600 s)
        placement_left = float(trainer.config.trainer.restart_wait_s) - (time.monotonic() - waited)
        trainer = make_trainer(attempt)


def wait_for_layout(trainer: Any, lost_node: str = "") -> None:
    """Wait up to ``trainer.restart_wait_s`` until the Ray cluster the run joins has the resources of its pools
    again (nothing to wait for with a local Ray: a new one starts); raise :class:`ConfigError` saying what is
    missing when it does not. ``lost_node``: the node of the lost worker; while Ray still lists it as alive it
    counts only if a task runs there."""
    from polyrl.controller.cluster import alive_resources, cluster_address, node_answers

    cfg = trainer.config
    address = cluster_address(cfg)
    if not address:
        return
    import ray

    from polyrl.trainer.placement import check_pools_fit
    from polyrl.trainer.role_groups import run_platform

    wait_s = float(cfg.trainer.restart_wait_s)
    accelerator = run_platform(cfg).ray_resource
    deadline = time.monotonic() + wait_s
    started = not ray.is_initialized()
    if started:
        from polyrl.controller.cluster import check_reachable

        check_reachable(address)
        ray.init(address=address, logging_level=logging.WARNING)
    try:
        gone: set[str] = set()

        def fits(excluded: set[str]) -> int:
            resources, alive = alive_resources(excluded)
            check_pools_fit(trainer.placement, resources, accelerator)
            return alive

        while True:
            try:  # without the lost node first: a replacement that joined needs no probe of the old one
                alive = fits(gone | ({lost_node} if lost_node else set()))
            except ConfigError:
                if lost_node and lost_node not in gone:  # needed: does it still run tasks (a lost process only)?
                    listed = any(n.get("NodeID") == lost_node and n.get("Alive") for n in ray.nodes())
                    probe = min(PROBE_S, max(1.0, deadline - time.monotonic()))
                    if listed and not node_answers(lost_node, probe):
                        gone.add(lost_node)  # dead, whatever Ray lists for now
                try:
                    alive = fits(gone)
                except ConfigError as exc:
                    if time.monotonic() >= deadline:
                        raise ConfigError(f"trainer.max_restarts: the run's layout cannot be placed again after "
                                          f"waiting {wait_s:g} s (trainer.restart_wait_s): {exc}; the last checkpoint "
                                          "is whole: run again once the cluster has the nodes") from None
                    time.sleep(POLL_S)
                    continue
            log.info("the cluster offers the run's layout again (%d node(s) alive): restarting", alive)
            return
    finally:
        if started:
            ray.shutdown()  # the new attempt joins with its own settings (start_ray)


__all__ = ["fit_with_restarts", "wait_for_layout"]
