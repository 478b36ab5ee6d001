"""Whether a 16-bit dtype is worth it on this CPU: a warning before a run decodes or trains 50x slower.

On a CPU without native bfloat16 matrix kernels (no AVX512-BF16 or AMX: an AVX2-only host) torch's bfloat16
products fall back to a slow path. Measured on such a host (2 cores of an AMD EPYC with AVX2 only, torch 2.13.0):
one thread multiplied 1024^3 at 0.95 GFLOP/s in bfloat16 against 48 GFLOP/s in float32, and the hf rollout's
decode step of the small benchmark model took 1.7 s instead of tens of milliseconds. verl's configs ask for
bfloat16 (``rollout.dtype``, ``actor.fsdp.param_dtype``), so a moved verl job would crawl without a word.

:func:`slow_dtype_warning` measures it instead of reading CPU flags: one 256^3 product in the dtype against one in
float32 on the current threads (the faster of three each, measured once per process and dtype, about 0.1 s on a
host without the kernels and a millisecond on one with them), and words a warning when the 16-bit product is more
than :data:`SLOWDOWN_LIMIT` times slower. Callers log it where they turn the configured dtype into a model
(:class:`polyrl.rollout.hf.HFRollout`, the FSDP engine).
"""

from __future__ import annotations

import logging
import time
from typing import Any

logger = logging.getLogger("polyrl.platforms")

#: A 16-bit product this many times slower than a float32 one gets the warning (a CPU with native kernels runs
#: bfloat16 1.5-3x faster than float32; without them it was 50x slower).
SLOWDOWN_LIMIT = 2.0

_SLOWDOWN: dict[Any, float] = {}
_WARNED: set[str] = set()


def cpu_matmul_slowdown(dtype: Any) -> float:
    """How many times longer a 256^3 matrix product takes in ``dtype`` than in float32 on this CPU, on the
    current torch threads (measured once per process and dtype)."""
    import torch

    if dtype not in _SLOWDOWN:
        def best(dt: Any) -> float:
            gen = torch.Generator().manual_seed(0)
            a = torch.randn(256, 256, generator=gen).to(dt)
            b = torch.randn(256, 256, generator=gen).to(dt)
            a @ b
            times = []
            for _ in range(3):
                start = time.perf_counter()
                a @ b
                times.append(time.perf_counter() - start)
            return min(times)

        _SLOWDOWN[dtype] = best(dtype) / max(best(torch.float32), 1e-9)
    return _SLOWDOWN[dtype]


def slow_dtype_warning(dtype: Any, device: Any, key: str) -> str | None:
    """The warning for config ``key`` asking for ``dtype`` on ``device``, or ``None`` when the dtype is not a 16-bit
    one on a CPU, or when this CPU multiplies it no more than :data:`SLOWDOWN_LIMIT` times slower than float32."""
    import torch

    if getattr(device, "type", str(device)) != "cpu" or dtype not in (torch.bfloat16, torch.float16):
        return None
    ratio = cpu_matmul_slowdown(dtype)
    if ratio <= SLOWDOWN_LIMIT:
        return None
    name = str(dtype).removeprefix("torch.")
    return (f"{key}={name}: a {name} matrix product ran {ratio:.0f}x slower than a float32 one on this CPU "
            f"(it has no native {name} kernels, such as AVX512-BF16 or AMX), so this run will decode and train "
            f"far slower than in float32; set {key}=float32 (docs/platforms.md#16-bit-dtypes-on-a-cpu)")


def warn_if_slow_dtype(dtype: Any, device: Any, key: str) -> str | None:
    """Log :func:`slow_dtype_warning` once per ``key`` in this process; returns it (or ``None``)."""
    message = slow_dtype_warning(dtype, device, key)
    if message is not None and key not in _WARNED:
        _WARNED.add(key)
        logger.warning(message)
    return message


__all__ = ["SLOWDOWN_LIMIT", "cpu_matmul_slowdown", "slow_dtype_warning", "warn_if_slow_dtype"]
