"""Placement helpers of the trainer."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from polyrl.trainer.role_groups import _RAY_SOCKET_SUFFIX, _UNIX_SOCKET_MAX, ray_temp_dir


def test_ray_temp_dir_is_under_the_run_dir_when_it_fits():
    short = Path(tempfile.mkdtemp(prefix="p"))  # pytest's tmp_path is itself too deep
    try:
        run = short / "r"
        assert ray_temp_dir(run) == run / "ray" and (run / "ray").is_dir()
    finally:
        shutil.rmtree(short)


def test_ray_temp_dir_of_a_deep_run_dir_keeps_socket_paths_short(tmp_path):
    run = tmp_path.joinpath(*(["deeply-nested-folder"] * 4))
    chosen = ray_temp_dir(run)
    try:
        assert chosen != run / "ray" and chosen.is_dir()
        assert len(str(chosen).encode()) + _RAY_SOCKET_SUFFIX <= _UNIX_SOCKET_MAX
    finally:
        shutil.rmtree(chosen)


class _Ranks:
    """A worker group's ``call_all("memory_stats")`` over ranks that report their own platform's numbers."""

    def __init__(self, *stats):
        self.stats, self.world_size = list(stats), len(stats)

    def call_all(self, method, *args):
        assert method == "memory_stats"
        return self.stats


def test_memory_metrics_per_group_are_the_largest_over_its_ranks():
    from polyrl.platforms import CPUPlatform
    from polyrl.trainer.role_groups import RoleGroups

    actor = _Ranks({"max_allocated_gib": 1.5, "reserved_gib": 2.0}, {"max_allocated_gib": 3.0, "reserved_gib": 1.0})
    rollout = _Ranks({"max_rss_gib": 0.5, "other_gib": 1.0})
    split = RoleGroups(actor, rollout, None, None, False, weight_sync=object())
    assert split.memory_metrics() == {
        "perf/actor/max_memory_allocated_gb": 3.0, "perf/actor/memory_reserved_gb": 2.0,
        "perf/rollout/max_rss_gb": 0.5, "perf/rollout/other_gib": 1.0}
    cpu = CPUPlatform().memory_stats()
    colocated = RoleGroups(_Ranks(cpu), None, None, None, True, weight_sync=object())
    colocated.rollout = colocated.actor
    assert set(colocated.memory_metrics()) == {"perf/colocated/max_rss_gb"}
