"""One rank of a gloo group averaging a toy model's gradients with GradReducer (spawned by test_grad_reduce.py).

Three linear layers, the same weights on every rank, different inputs per rank; two micro-batches, the second's
backward inside ``GradReducer.overlapping`` with one parameter per bucket. With ``skip-last`` rank 1 leaves
the middle layer out of its last micro-batch (its buckets are never ready in that backward), with
``skip-all`` out of both (its gradient is ``None``: zeros). Rank 0 saves the reduced gradients, the
average of every rank's local gradients gathered separately, and how many buckets started inside backward.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch import nn


def main() -> None:
    rank, world, port, out, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from polyrl_engine_fsdp.grad_reduce import GradReducer

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8))
    params = list(model.parameters())
    g = torch.Generator().manual_seed(100 + rank)
    inputs = [torch.randn(4, 8, generator=g) for _ in range(2)]

    def loss(i: int) -> torch.Tensor:
        h = model[0](inputs[i])
        skip = rank == 1 and (mode == "skip-all" or (mode == "skip-last" and i == 1))
        if not skip:
            h = model[1](h)
        return model[2](torch.tanh(h)).square().sum()

    for i in range(2):  # local gradients first, reduced by hand below
        loss(i).backward()
    local = [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in params]
    model.zero_grad(set_to_none=True)
    gathered = [[torch.empty_like(t) for _ in range(world)] for t in local]
    for t, parts in zip(local, gathered):
        dist.all_gather(parts, t)
    expected = [torch.stack(parts).sum(0) / world for parts in gathered]

    reducer = GradReducer(params, world, torch.float32, bucket_bytes=1)  # one parameter per bucket
    loss(0).backward()
    with reducer.overlapping():
        loss(1).backward()
    reducer.finish()
    if rank == 0:
        torch.save({"reduced": [p.grad.clone() for p in params], "expected": expected,
                    "launched_in_backward": reducer.launched_in_backward, "buckets": len(reducer.buckets)}, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
