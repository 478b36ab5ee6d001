"""Checkpoint tensor names next to transformers' in-memory parameter names.

transformers 5 fuses some families' checkpoint tensors when it loads them: a mixture of experts' per-expert
``mlp.experts.{e}.{gate,up,down}_proj.weight`` (Qwen3-MoE; ``block_sparse_moe.experts.{e}.w1/w3/w2`` in Mixtral)
become ``mlp.experts.gate_up_proj [E, 2I, H]`` and ``mlp.experts.down_proj [E, H, I]``, and ``save_pretrained``
splits them back. Checkpoints, vLLM's loaders and the megatron engine's weight stream use the checkpoint names;
``model.named_parameters()`` has the fused ones. These helpers let a consumer accept either.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import torch

logger = logging.getLogger(__name__)

__all__ = ["CheckpointNameMap", "checkpoint_shapes"]


def _revert(model: Any, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` (in-memory names) as ``save_pretrained`` would name and shape it."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # transformers < 5 keeps checkpoint names in memory
        return state
    return revert_weight_conversion(model, state)


def checkpoint_shapes(model: Any) -> dict[str, tuple[int, ...]]:
    """Checkpoint tensor name -> shape, as ``save_pretrained`` writes ``model`` (a model on the meta device is
    enough: nothing is materialised). Equal to the parameter shapes for families transformers does not fuse; the
    parameter shapes (with a warning) where transformers' reverse conversion fails on meta tensors."""
    state = {name: p for name, p in model.named_parameters()}
    try:
        reverted = _revert(model, state)
    except Exception as exc:  # a conversion that needs real data: the in-memory names are all there is
        logger.warning("checkpoint names of %s unknown (%s): using its parameter names", type(model).__name__, exc)
        reverted = state
    return {name: tuple(t.shape) for name, t in reverted.items()}


class CheckpointNameMap:
    """Where each checkpoint-named tensor of ``model`` lives among its (possibly fused) parameters.

    Built once from an index map: every parameter element gets a global number, and ``save_pretrained``'s own
    reverse conversion of those numbers says which elements each checkpoint tensor is made of. Costs 8 bytes per
    parameter element while it exists; build it only for models whose names differ.
    """

    def __init__(self, model: Any) -> None:
        params = list(model.named_parameters())
        self._params = [p for _, p in params]
        starts, index, offset = [], {}, 0
        for name, p in params:
            starts.append(offset)
            index[name] = torch.arange(offset, offset + p.numel(), dtype=torch.int64).view(p.shape)
            offset += p.numel()
        self._starts = torch.tensor(starts + [offset])
        self._index = _revert(model, index)

    def __contains__(self, name: str) -> bool:
        return name in self._index

    def __iter__(self) -> Iterator[str]:
        return iter(self._index)

    def shape(self, name: str) -> tuple[int, ...]:
        """The checkpoint tensor's shape."""
        return tuple(self._index[name].shape)

    def locate(self, name: str) -> tuple[torch.nn.Parameter, torch.Tensor]:
        """The parameter holding checkpoint tensor ``name``, and the flat positions of its elements in it
        (``param.view(-1)[positions] = tensor.reshape(-1)`` writes it)."""
        flat = self._index[name].reshape(-1)
        which = int(torch.searchsorted(self._starts, flat[:1], right=True)[0]) - 1
        start, end = int(self._starts[which]), int(self._starts[which + 1])
        if int(flat.min()) < start or int(flat.max()) >= end:  # no family transformers converts does this
            raise ValueError(f"checkpoint tensor {name!r} spans several in-memory parameters")
        return self._params[which], flat - start
