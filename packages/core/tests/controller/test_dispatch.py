"""Dispatch by data-parallel rank: a tensor-parallel-like group (two ranks, one data-parallel group) gets one
shard, computes it once and returns it once. Real Ray actors; the layout is what each rank reports."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from polyrl.controller.worker_group import DPLayout, RayWorkerGroup


class _ShardedWorker:
    """Reports a layout of ``world_size // group`` data-parallel groups of ``group`` ranks; the last rank of
    each group collects (like Megatron's last pipeline stage)."""

    def __init__(self, *, rank: int, world_size: int, group: int) -> None:
        self.rank, self.world_size, self.group = rank, world_size, group

    def ready(self) -> bool:
        return True

    def dp_layout(self, method: str) -> tuple[int, int, bool]:
        if method == "by_rank":
            return self.rank, self.world_size, True
        return self.rank // self.group, self.world_size // self.group, self.rank % self.group == self.group - 1

    def compute(self, batch: TensorDict) -> TensorDict:
        out = batch.clone()
        out["rank"] = torch.full((batch.batch_size[0],), self.rank)
        return out

    def by_rank(self, batch: TensorDict) -> TensorDict:
        return self.compute(batch)

    def rows_seen(self, batch: TensorDict) -> list[int]:
        return batch["row"].tolist()

    def close(self) -> None:
        pass


def test_a_two_rank_group_computes_each_shard_once(ray_local):
    group = RayWorkerGroup(_ShardedWorker, 2, resources_per_worker={"CPU": 0.5}, name="tp2", group=2)
    try:
        batch = TensorDict({"row": torch.arange(6)}, batch_size=[6])
        assert group.dp_size("compute") == 1
        out = group.dispatch("compute", batch)
        assert out["row"].tolist() == list(range(6))  # every row once: no duplicates from the other rank
        assert set(out["rank"].tolist()) == {1}  # the collector's result is the one kept
        seen = group.call_each("rows_seen", [(batch,), (batch,)])
        assert seen[0] == seen[1]
        # a method no engine serves splits by rank: two shards, both results kept
        by_rank = group.dispatch("by_rank", batch)
        assert by_rank["row"].tolist() == list(range(6)) and by_rank["rank"].tolist() == [0, 0, 0, 1, 1, 1]
    finally:
        group.shutdown()


def test_layout_reports_are_checked():
    assert DPLayout.of([(0, 2, True), (1, 2, True)], "m").dp_size == 2
    with pytest.raises(RuntimeError, match="disagree on the data-parallel size"):
        DPLayout.of([(0, 2, True), (0, 1, True)], "m")
    with pytest.raises(RuntimeError, match="exactly one rank that collects"):
        DPLayout.of([(0, 1, True), (0, 1, True)], "m")
    with pytest.raises(RuntimeError, match="exactly one rank that collects"):
        DPLayout.of([(0, 2, True), (0, 2, False)], "m")
    with pytest.raises(RuntimeError, match="do not fit"):
        DPLayout.of([(2, 2, True), (1, 2, True)], "m")
    layout = DPLayout.of([(1, 2, False), (1, 2, True), (0, 2, True), (0, 2, False)], "m")
    assert layout.gather(["a", "b", "c", "d"]) == ["c", "b"]
