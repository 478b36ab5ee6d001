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


# ---------------------------------------------------------------------- a checkpoint resumed in another mode


def _loader_trainer(batch_groups: int = 4, start: int = 0) -> SimpleNamespace:
    """A trainer whose loader hands out prompts ``start, start + 1, ...`` one batch at a time."""
    counter = iter(range(start, 10_000))
    trainer = _source(batch_groups=batch_groups).trainer
    trainer.next_rows = lambda: [{"uid": f"0-{next(counter)}-x"} for _ in range(batch_groups)]
    trainer.loader = SimpleNamespace(state_dict=lambda: {"epoch": 0, "position": 0})
    return trainer


def _fully_async_state() -> dict:
    """What a fully async run's checkpoint stores: finished groups (prompts 0, 1) and prompts waiting (2, 3, 4)."""
    source = _source()
    source.trainer.loader = SimpleNamespace(state_dict=lambda: {"epoch": 0, "position": 5})
    source.ready.extend([_group(0, version=2), _group(1, version=2)])
    source.todo.extend({"uid": f"0-{p}-x"} for p in (2, 3, 4))
    return source.snapshot().state


def _uids(rows: list[dict]) -> list[str]:
    return [r["uid"] for r in rows]


def test_fully_async_checkpoint_resumed_one_step_off_trains_its_queued_prompts_first():
    from polyrl.trainer.sample_sources import OneStepOffPolicySource

    source = OneStepOffPolicySource(_loader_trainer(start=5))
    source.restore("unused", _fully_async_state())
    # nothing dropped: a checkpoint taken now would still hold the five prompts
    assert _uids(source.snapshot().state["pending_rows"]) == [f"0-{p}-x" for p in range(5)]
    assert _uids(source._rows()) == ["0-0-x", "0-1-x", "0-2-x", "0-3-x"]
    assert _uids(source._rows()) == ["0-4-x", "0-5-x", "0-6-x", "0-7-x"]  # then the loader, in order
    assert _uids(source._rows()) == ["0-8-x", "0-9-x", "0-10-x", "0-11-x"]


def test_one_step_off_checkpoint_resumed_fully_async_generates_its_prefetched_prompts():
    state = {"mode": "one_step_off_policy", "pending_rows": [{"uid": f"0-{p}-x"} for p in (8, 9, 10, 11)]}
    source = _source()
    source.restore("unused", state)
    assert _uids(source.todo) == ["0-8-x", "0-9-x", "0-10-x", "0-11-x"]


def test_sync_run_resumes_an_async_checkpoint_without_losing_prompts():
    from polyrl.trainer.sample_sources import RolloutSource

    source = RolloutSource(_loader_trainer(start=5))
    source.restore("unused", _fully_async_state())
    assert _uids(source._rows()) == ["0-0-x", "0-1-x", "0-2-x", "0-3-x"]
    assert _uids(source.snapshot().state["pending_rows"]) == ["0-4-x"]  # the loader has not moved yet
    assert _uids(source._rows()) == ["0-4-x", "0-5-x", "0-6-x", "0-7-x"]
    # the loader's batch that filled it up was drawn whole: its last prompt is carried (and checkpointed) on
    assert _uids(source.snapshot().state["pending_rows"]) == ["0-8-x"]


# ---------------------------------------------------------------------- staleness bound and sampling seeds


def test_a_staleness_bound_of_two_keeps_groups_two_versions_old_and_drops_older_ones():
    source = _source(batch_groups=3, staleness=2, step=5)
    source.ready.extend([_group(0, version=2), _group(1, version=3), _group(2, version=4), _group(3, version=5)])
    assert _prompts(source.next_batch()) == [1, 2, 3]  # versions 3, 4, 5 against policy 5: staleness 2, 1, 0
    assert source.dropped == 1 and _uids(source.todo) == ["0-0-x"]  # version 2 is 3 behind: generated again


def test_staleness_metrics_are_the_policy_version_minus_each_samples_generating_version():
    from polyrl import batch as batch_ops
    from polyrl.trainer.sample_sources import _staleness_metrics

    batch = TensorDict({"x": torch.zeros(4)}, batch_size=[4])
    batch_ops.set_non_tensor(batch, "gen_version", [5, 5, 4, 3])
    metrics = _staleness_metrics(batch, 5)
    assert metrics == {"async/staleness_mean": 0.75, "async/staleness_max": 2.0, "async/policy_version": 5.0}


def test_a_chunk_that_starts_a_batch_is_sampled_with_the_seed_sync_gives_that_step():
    """Paired seeds: a synchronous run samples step k (``global_step`` k - 1) with ``seed * 1_000_003 + k - 1``;
    fully async samples the chunk holding that step's prompts with the same seed, other chunks with their own."""
    source = _source(batch_groups=4)
    source.trainer.config.trainer.seed = 7
    source.trainer.loader = [None] * 10  # ten steps per epoch
    base = 7 * 1_000_003
    assert source._seed([{"uid": "0-0-a"}]) == base  # step 1's prompts
    assert source._seed([{"uid": "0-8-b"}]) == base + 2  # step 3's
    assert source._seed([{"uid": "1-4-c"}]) == base + 11  # epoch 1, its second batch: step 12
    inside = source._seed([{"uid": "0-10-d"}])  # half-way into step 3's batch
    assert inside not in {base + k for k in range(20)}
