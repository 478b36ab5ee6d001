"""Several batch rows per sample: the trainer's seam for agent loops that return one output per step.

Most agent loops return one trajectory per sample, and the trainer's batch has ``len(rows) * n`` rows. A step-wise
loop (``stepwise``) returns one output per environment step, so a sample owns several consecutive rows (the first
has ``step_index`` 0, :func:`polyrl.agent_loops.runner.sample_of_rows`). Here each row gets its sample's fields
(``uid``: GRPO's and GiGPO's episode group), and the batch is padded to whole mini-batches with rows that train
nothing (``response_mask`` 0, a ``uid`` of their own), since the number of rows varies with the episodes' lengths.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from tensordict import TensorDict

from polyrl import batch as batch_ops

#: Per-episode fields zeroed on padding rows, so ``env/*`` metrics and rewards count no padding.
_ZEROED = ("tool_reward", "episode_end", "episode_success", "episode_steps", "step_rewards")


def expand_to_rows(batch: TensorDict, samples: Sequence[dict], ids: Sequence[str]) -> tuple[list[dict], list[str]]:
    """``(samples, sample ids)`` with one entry per row of ``batch``: unchanged when each sample has one row,
    else repeated over each sample's rows, the ids suffixed ``/step<t>``."""
    from polyrl.agent_loops.runner import sample_of_rows

    owner = sample_of_rows(batch, len(samples))
    if owner is None:
        return list(samples), list(ids)
    steps = batch["step_index"].tolist()
    return [samples[i] for i in owner], [f"{ids[i]}/step{int(t)}" for i, t in zip(owner, steps)]


def group_slices(batch: TensorDict, groups: int, n: int) -> list[slice]:
    """The rows of each of ``groups`` prompt groups (``n`` samples each) in a batch generated for them, in order:
    ``n`` rows each, or with step rows every row of the group's samples (``fully_async`` queues groups so)."""
    from polyrl.agent_loops.runner import sample_of_rows

    owner = sample_of_rows(batch, groups * n)
    if owner is None:
        return [slice(g * n, (g + 1) * n) for g in range(groups)]
    bounds = [0] * (groups + 1)
    for row, sample in enumerate(owner):
        bounds[sample // n + 1] = row + 1
    return [slice(bounds[g], bounds[g + 1]) for g in range(groups)]


def step_row_divisor(config: Any, use_critic: bool) -> int:
    """The multiple a batch of step rows is padded to: whole mini-batches of the actor (and critic) update."""
    n = int(config.rollout.n)
    divisor = int(config.actor.ppo_mini_batch_size) * n
    if use_critic:
        divisor = math.lcm(divisor, int(config.critic.ppo_mini_batch_size) * n)
    return max(1, divisor)


def pad_step_rows(batch: TensorDict, divisor: int) -> TensorDict:
    """``batch`` with rows appended up to a multiple of ``divisor`` when it holds step rows (an ``episode_end``
    field); each added row copies the last one with ``response_mask`` 0, the per-episode fields 0, a ``uid`` of its
    own (a group of one: no estimator mixes it with real rows) and ``step_padding`` 1 (0 on real rows)."""
    rows = batch.batch_size[0]
    if "episode_end" not in batch.keys():
        return batch
    batch["step_padding"] = torch.zeros(rows)
    missing = -rows % divisor
    if not missing:
        return batch
    pad = batch[torch.full((missing,), rows - 1, dtype=torch.long)].clone()
    pad["response_mask"] = torch.zeros_like(pad["response_mask"])
    pad["step_padding"] = torch.ones(missing)
    for key in _ZEROED:
        if key in pad.keys():
            pad[key] = torch.zeros_like(pad[key])
    out = batch_ops.concat([batch, pad])
    uids = batch_ops.non_tensor(out, "uid", None)
    if uids is not None:
        batch_ops.set_non_tensor(out, "uid", list(uids[:rows]) + [f"{uids[rows - 1]}#pad{k}" for k in range(missing)])
    ids = batch_ops.non_tensor(out, "sample_id", None)
    if ids is not None:
        batch_ops.set_non_tensor(out, "sample_id", list(ids[:rows]) + [f"{ids[rows - 1]}#pad{k}" for k in range(missing)])
    return out
