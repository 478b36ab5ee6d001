"""megatron-core's model-parallel state on top of an existing torch.distributed default group.

The worker (or a test) creates the default group (``polyrl.distributed.init_distributed``; gloo on CPU);
:func:`init_parallel_state` splits it into megatron's tensor-, context-, expert-, pipeline- and data-parallel
groups (order ``tp-cp-ep-dp-pp``: consecutive ranks form a tensor-parallel group, then context-parallel) and
seeds megatron's RNG tracker.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from polyrl.errors import ConfigError

logger = logging.getLogger(__name__)

_layout: tuple[int, int, int, int, int | None] | None = None
#: The default process group the parallel state was built on (a new one makes that state stale).
_world: Any = None


@dataclass(frozen=True)
class ParallelInfo:
    """Where this rank sits in the (tensor, context, pipeline, data) layout, and in the expert layout."""

    tp: int
    pp: int
    dp: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    cp: int = 1
    cp_rank: int = 0
    ep: int = 1
    ep_rank: int = 0
    etp: int = 1
    etp_rank: int = 0

    @property
    def is_first_stage(self) -> bool:
        """Holds the embedding (pre-process)."""
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        """Holds the final norm and the output layer / value head (post-process)."""
        return self.pp_rank == self.pp - 1

    @property
    def collects_output(self) -> bool:
        """The one rank of its data-parallel group whose results the controller keeps."""
        return self.tp_rank == 0 and self.cp_rank == 0 and self.is_last_stage


def parallel_info() -> ParallelInfo:
    """This rank's coordinates; needs :func:`init_parallel_state` first."""
    from megatron.core import parallel_state as ps

    return ParallelInfo(
        tp=ps.get_tensor_model_parallel_world_size(), pp=ps.get_pipeline_model_parallel_world_size(),
        dp=ps.get_data_parallel_world_size(), tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_rank=ps.get_pipeline_model_parallel_rank(), dp_rank=ps.get_data_parallel_rank(),
        cp=ps.get_context_parallel_world_size(), cp_rank=ps.get_context_parallel_rank(),
        ep=ps.get_expert_model_parallel_world_size(), ep_rank=ps.get_expert_model_parallel_rank(),
        etp=ps.get_expert_tensor_parallel_world_size(), etp_rank=ps.get_expert_tensor_parallel_rank(),
    )


def init_parallel_state(tp: int = 1, pp: int = 1, *, cp: int = 1, ep: int = 1, etp: int | None = None,
                        seed: int = 1234, cpu: bool | None = None, key: str = "actor.megatron") -> ParallelInfo:
    """Create megatron's parallel groups for ``tp`` x ``cp`` x ``pp`` (data parallel: the rest of the world), with
    ``ep``-way expert parallelism (expert tensor parallelism ``etp``, default ``tp``), and seed its RNG tracker.

    Needs the torch.distributed default group. ``cpu`` (default: the default group's backend is gloo) applies
    :func:`~polyrl_engine_megatron.cpu_emulation.apply_cpu_emulation` first. Calling it again with the same
    layout returns the current coordinates; another layout while one is set up is a ``RuntimeError``
    (call :func:`destroy_parallel_state` first). A layout that does not divide the world size is a ConfigError
    naming the ``{key}`` keys (checked before any group is created).
    """
    global _layout, _world
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("init_parallel_state needs torch.distributed's default process group: call "
                           "polyrl.distributed.init_distributed (or torch.distributed.init_process_group) first")
    world = dist.get_world_size()
    if min(tp, pp, cp, ep) < 1 or world % (tp * cp * pp):
        raise ConfigError(f"{key}.tensor_model_parallel_size ({tp}) x {key}.context_parallel_size ({cp}) x "
                          f"{key}.pipeline_model_parallel_size ({pp}) must divide the role's world size ({world})")
    if world % ((etp or tp) * ep * pp):
        raise ConfigError(f"{key}.expert_model_parallel_size ({ep}) x expert tensor parallel ({etp or tp}) x "
                          f"{key}.pipeline_model_parallel_size ({pp}) must divide the role's world size ({world})")
    layout = (tp, pp, cp, ep, etp)
    if _layout is not None and _world is not dist.group.WORLD:
        # the default group it was built on is gone (a worker that left it, then a new one in this process):
        # its groups are stale, build them again
        destroy_parallel_state()
    if _layout is not None:
        if _layout != layout:
            raise RuntimeError(f"megatron's parallel state is set up for (tp, pp, cp, ep, etp)={_layout}; "
                               f"call destroy_parallel_state() before {layout}")
        return parallel_info()
    if cpu is None:
        cpu = dist.get_backend() == "gloo"
    from polyrl_engine_megatron.cpu_emulation import apply_cpu_emulation, check_megatron_core

    if cpu:
        apply_cpu_emulation()
    else:
        check_megatron_core()
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 context_parallel_size=cp, expert_model_parallel_size=ep,
                                 expert_tensor_parallel_size=etp)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    _layout, _world = layout, dist.group.WORLD
    info = parallel_info()
    logger.debug("megatron parallel state: %s", info)
    return info


def destroy_parallel_state() -> None:
    """Tear down megatron's parallel groups and RNG tracker (the default group stays). Safe to call twice."""
    global _layout
    if _layout is None:
        return
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    ps.destroy_model_parallel()
    tensor_parallel.get_cuda_rng_tracker().reset()
    _layout = None
