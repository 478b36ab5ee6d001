"""The actor and critic updates: mini-batches, epochs, and when an update is on-policy.

One PPO update of a role (``actor`` or ``critic``) makes ``<role>.ppo_epochs`` passes over the rows this
rank holds, one optimizer step per mini-batch of ``<role>.ppo_mini_batch_size`` prompts (times
``rollout.n`` samples, split over the data-parallel ranks). When that is a single pass over a single
mini-batch the policy being trained is the one that generated the batch: the update is *on-policy*, and the
trainer may skip the old-log-prob pass (verl's ``dp_actor`` does the same). The role worker
(:class:`polyrl.trainer.role_worker.Worker`) runs these; a plugin worker reuses them through its
``run_update_epochs`` / ``mini_batch_rows`` / ``update_is_on_policy`` methods.
"""

from __future__ import annotations

from typing import Any

import torch
from tensordict import TensorDict

__all__ = ["mini_batch_rows", "run_update_epochs", "single_update_pass"]


def mini_batch_rows(mini_batch_size: int, n: int, dp_size: int) -> int:
    """Rows of one mini-batch on one data-parallel rank: ``mini_batch_size`` prompts x ``n`` samples over
    ``dp_size`` ranks (the trainer checks before any worker starts that they divide)."""
    return int(mini_batch_size) * int(n) // max(1, int(dp_size))


def single_update_pass(epochs: int, mini_batch: int, batch: int) -> bool:
    """Whether an update of ``epochs`` passes over ``batch`` rows in mini-batches of ``mini_batch`` rows (or
    prompts: any one unit for both) is a single optimizer step on the whole batch: the on-policy case, where
    the policy being trained is still the one that generated the batch."""
    return int(epochs) == 1 and int(mini_batch) >= int(batch)


def run_update_epochs(engine: Any, batch: TensorDict, rows: int, epochs: int, loss_fn: Any, *, shuffle: bool,
                      seed: int, temperature: float = 1.0) -> dict[str, float]:
    """``epochs`` passes over ``batch``, one ``engine.train_batch(mini_batch, loss_fn, temperature=...)`` per
    mini-batch of ``rows`` rows (a trailing part smaller than ``rows`` is left out); metrics averaged over the
    optimizer steps. With ``shuffle`` each pass takes the rows in an order drawn from ``seed`` and the epoch
    (give every data-parallel rank its own seed, e.g. its ``dp_rank``)."""
    size = batch.batch_size[0]
    rows = max(1, min(rows, size))
    sums: dict[str, float] = {}
    steps = 0
    for epoch in range(epochs):
        order = torch.randperm(size, generator=torch.Generator().manual_seed(seed * 1000 + epoch)) if shuffle else None
        data = batch[order] if order is not None else batch
        for start in range(0, size - rows + 1, rows):
            metrics = engine.train_batch(data[start : start + rows], loss_fn, temperature=temperature)
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + float(v)
            steps += 1
    return {k: v / max(1, steps) for k, v in sums.items()}
