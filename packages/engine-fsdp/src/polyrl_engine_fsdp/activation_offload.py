"""Activation offload (``fsdp.activation_offload``): the tensors autograd saves in the forward pass for the backward
pass wait in CPU memory instead of the accelerator's.

Built on :func:`torch.autograd.graph.saved_tensors_hooks` (what ``torch.autograd.graph.save_on_cpu`` uses), with
two differences: parameters (FSDP's gathered weights, which FSDP frees and gathers again itself) and small tensors
stay where they are, and on an accelerator the copies go through pinned memory without blocking the host.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

#: Tensors smaller than this stay on the device: copying them saves nothing worth a transfer.
MIN_BYTES = 1 << 16


def _is_parameter(tensor: torch.Tensor) -> bool:
    return isinstance(tensor, nn.Parameter) or isinstance(getattr(tensor, "_base", None), nn.Parameter)


def offload_activations(device: torch.device, min_bytes: int = MIN_BYTES) -> Any:
    """A context manager: activations saved while it is active are kept on the CPU until backward needs them.

    On a CPU device the copies are real but save nothing (the activations were in CPU memory already); the
    option is for accelerators.
    """
    pin = device.type != "cpu"

    def pack(tensor: torch.Tensor) -> Any:
        if _is_parameter(tensor) or tensor.numel() * tensor.element_size() < min_bytes or tensor.is_sparse:
            return tensor
        host = torch.empty(tensor.size(), dtype=tensor.dtype, device="cpu", pin_memory=pin)
        host.copy_(tensor, non_blocking=pin)
        return (tensor.device, host)

    def unpack(packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        where, host = packed
        return host.to(where, non_blocking=pin)

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)
