"""Copies of an engine's trained weights: the EMA (Flow-GRPO's and DiffusionNFT's ``EMAModuleWrapper`` rule) and
DiffusionNFT's old policy (its soft update ``old = decay * old + (1 - decay) * w``).

A copy holds one tensor per trainable parameter, shaped and placed like the parameter (under FSDP2 a ``DTensor``
with this rank's shard: every operation here is elementwise, so no rank talks to another). The
:class:`~polyrl_diffusion.engine.DiffusersEngine` keeps them, swaps one in to sample or export with it, and saves
them with its checkpoints.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

__all__ = ["WeightCopy", "ema_decay", "old_policy_decay"]


def ema_decay(step: int, decay: float) -> float:
    """The EMA's decay after optimizer step ``step`` (counted from 1): ``min((1 + step) / (10 + step), decay)``, the
    reference's warm-up (``EMAModuleWrapper.get_current_decay``)."""
    return min((1 + step) / (10 + step), decay)


def old_policy_decay(step: int, start: int, rate: float, maximum: float) -> float:
    """DiffusionNFT's old-policy decay after ``step`` optimizer steps (its ``return_decay``): 0 before ``start``,
    then ``min((step - start) * rate, maximum)``. Its ``decay_type`` 0, 1, 2 are ``(0, 0, 0)``,
    ``(0, 0.001, 0.5)`` and ``(75, 0.0075, 0.999)``."""
    if step < start:
        return 0.0
    return min((step - start) * rate, maximum)


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t`` (the local shard of a DTensor; ``t`` itself otherwise)."""
    return t.to_local() if hasattr(t, "to_local") else t


class WeightCopy:
    """A copy of ``params`` (``(name, parameter)`` pairs, the engine's trainable parameters).

    ``ema``: ``(decay, update_interval)`` makes it an EMA that :meth:`after_optimizer_step` updates.
    """

    def __init__(self, params: Sequence[tuple[str, torch.Tensor]], *, ema: tuple[float, int] | None = None) -> None:
        with torch.no_grad():
            self.tensors = {name: p.detach().clone() for name, p in params}
        self.ema = ema

    @torch.no_grad()
    def lerp_(self, params: Sequence[tuple[str, torch.Tensor]], weight: float) -> None:
        """``copy += weight * (w - copy)`` for every parameter (``weight = 1 - decay``)."""
        for name, p in params:
            self.tensors[name].lerp_(p.detach(), float(weight))

    def after_optimizer_step(self, params: Sequence[tuple[str, torch.Tensor]], step: int) -> None:
        """The EMA update after optimizer step ``step`` (counted from 1): every ``update_interval`` steps
        (``(step + 1) % update_interval == 0``) with decay :func:`ema_decay`. No-op for a copy that is not an EMA."""
        if self.ema is None:
            return
        decay, interval = self.ema
        if (step + 1) % interval == 0:
            self.lerp_(params, 1.0 - ema_decay(step, decay))

    @contextmanager
    def swapped_in(self, params: Sequence[tuple[str, torch.Tensor]]) -> Iterator[None]:
        """The parameters hold this copy inside the block, their own values again after it."""
        with torch.no_grad():
            saved = [p.detach().clone() for _, p in params]
            for name, p in params:
                p.copy_(self.tensors[name])
        try:
            yield
        finally:
            with torch.no_grad():
                for (_, p), value in zip(params, saved):
                    p.copy_(value)

    def to(self, device: Any) -> None:
        """Move the copy (with the engine's offload / onload)."""
        self.tensors = {name: t.to(device) for name, t in self.tensors.items()}

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's part of every tensor, on the CPU (for a checkpoint)."""
        return {name: _local(t).detach().cpu().clone() for name, t in self.tensors.items()}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore what :meth:`state_dict` returned; a ``KeyError`` / ``ValueError`` names a tensor that does not fit."""
        missing = sorted(set(self.tensors) - set(state))
        if missing:
            raise KeyError(f"weight copy: the checkpoint has no tensor for {missing[:3]}")
        for name, t in self.tensors.items():
            local = _local(t)
            if tuple(local.shape) != tuple(state[name].shape):
                raise ValueError(f"weight copy: {name} has shape {tuple(state[name].shape)} in the checkpoint, "
                                 f"{tuple(local.shape)} here")
            local.copy_(state[name].to(local.device, local.dtype))
