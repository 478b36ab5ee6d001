"""The fully async queue's trainer side (``StreamingSource.next_batch``) without Ray: what a step takes."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from tensordict import TensorDict

from polyrl.trainer.sample_sources import StreamingSource, _Group


def _source(batch_groups: int = 4, staleness: int = 1, step: int = 3) -> StreamingSource:
    trainer = SimpleNamespace(
        global_step=step,
        config=SimpleNamespace(
            rollout=SimpleNamespace(n=2),
            data=SimpleNamespace(train_batch_size=batch_groups),
            trainer=SimpleNamespace(async_max_staleness=staleness, async_inflight="finish", async_queue_groups=0,
                                    rollout_workers=1, async_chunk_groups=0),
        ),
    )
    return StreamingSource(trainer)


def _group(prompt: int, version: int) -> _Group:
    batch = TensorDict({"prompt": torch.full((2,), prompt)}, batch_size=[2])
    return _Group({"uid": f"0-{prompt}-x"}, batch, version)


def _prompts(batch: TensorDict) -> list[int]:
    return batch["prompt"].tolist()[::2]


def test_a_later_dynamic_sampling_round_takes_only_the_missing_groups():
    source = _source()
    source.ready.extend(_group(p, version=3) for p in range(6))
    assert _prompts(source.next_batch()) == [0, 1, 2, 3]  # a whole batch by default
    assert _prompts(source.next_batch(1)) == [4]  # the groups still missing, the rest stays queued
    assert [g.row["uid"] for g in source.ready] == ["0-5-x"]


def test_too_stale_groups_are_dropped_and_their_prompts_generated_again():
    source = _source(batch_groups=2, staleness=1, step=3)
    source.ready.extend([_group(0, version=1), _group(1, version=2), _group(2, version=3)])
    assert _prompts(source.next_batch(2)) == [1, 2]
    assert source.dropped == 1 and [r["uid"] for r in source.todo] == ["0-0-x"]
