"""Gradient averaging for the replicated layout (``fsdp.fsdp_size=1``: a whole model on every rank).

:class:`GradReducer` averages every trainable gradient over the ranks in flat buckets, as DDP does. With
``overlap`` it launches each bucket's all-reduce (``async_op=True``) from the parameters' post-accumulate-grad
hooks while backward is still running, so the reduction of the last layers' gradients overlaps the backward
of the first ones; :meth:`GradReducer.finish` then waits for them before the optimizer step. Without
``overlap`` every bucket is launched after backward. The sums are the same either way: an all-reduce sums
each element over the ranks whatever bucket it travels in.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist

#: Bucket size (bytes in ``reduce_dtype``), DDP's default ``bucket_cap_mb``: small enough that the first
#: bucket is ready early in backward, large enough that the per-call cost of a collective stays small.
DEFAULT_BUCKET_BYTES = 25 << 20


class GradReducer:
    """Averages the gradients of ``params`` over the default process group's ``world`` ranks.

    Buckets hold the parameters in reverse order (the order backward produces their gradients: the last
    layers first) and are always launched in the same order on every rank (bucket ``i`` only once buckets
    ``0 .. i-1`` have been), so the ranks' collectives pair up even when one rank's backward finishes its
    gradients in a different order (another forward path, a parameter it did not use).
    """

    def __init__(self, params: list[torch.nn.Parameter], world: int, reduce_dtype: torch.dtype,
                 bucket_bytes: int | None = None) -> None:
        bucket_bytes = bucket_bytes or DEFAULT_BUCKET_BYTES
        self.params = params
        self.world = world
        self.reduce_dtype = reduce_dtype
        self.buckets: list[list[torch.nn.Parameter]] = []
        size = bucket_bytes  # start a new bucket for the first parameter
        for p in reversed(params):
            if size >= bucket_bytes:
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(p)
            size += p.numel() * reduce_dtype.itemsize
        self._bucket_of = {id(p): i for i, bucket in enumerate(self.buckets) for p in bucket}
        self._remaining: list[int] = []
        self._pending: list[tuple[dist.Work | None, torch.Tensor, list[torch.nn.Parameter]]] = []
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        #: Buckets launched from a hook during the last :meth:`overlapping` backward (for tests and benchmarks).
        self.launched_in_backward = 0

    @contextlib.contextmanager
    def overlapping(self) -> Iterator[None]:
        """Around the last micro-batch's backward: each bucket's all-reduce starts as soon as its gradients and
        every earlier bucket's are accumulated. Call :meth:`finish` after it."""
        self._remaining = [len(bucket) for bucket in self.buckets]
        self._pending = []
        self.launched_in_backward = 0
        self._handles = [p.register_post_accumulate_grad_hook(self._ready) for p in self.params]
        try:
            yield
        finally:
            for handle in self._handles:
                handle.remove()
            self._handles = []

    def _ready(self, param: torch.Tensor) -> None:
        i = self._bucket_of[id(param)]
        self._remaining[i] -= 1
        while len(self._pending) < len(self.buckets) and self._remaining[len(self._pending)] == 0:
            self._launch(len(self._pending))
            self.launched_in_backward += 1

    def _launch(self, i: int) -> None:
        bucket = self.buckets[i]
        for p in bucket:  # a parameter this rank gave no gradient contributes zeros: every rank reduces the same
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        flat = torch.cat([p.grad.reshape(-1).to(self.reduce_dtype) for p in bucket])
        self._pending.append((dist.all_reduce(flat, async_op=True), flat, bucket))

    def finish(self) -> None:
        """Launch the buckets backward did not (all of them without :meth:`overlapping`), wait for every one,
        and write the averages back into the parameters' ``.grad``."""
        while len(self._pending) < len(self.buckets):
            self._launch(len(self._pending))
        for work, flat, bucket in self._pending:
            if work is not None:
                work.wait()
            flat.div_(self.world)
            offset = 0
            for p in bucket:
                assert p.grad is not None
                p.grad.copy_(flat[offset : offset + p.numel()].view_as(p.grad))
                offset += p.numel()
        self._pending = []
