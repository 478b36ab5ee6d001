"""What every engine-backed rollout does with the weights ``update_weights`` receives, before its engine sees them.

An inference engine (vLLM, SGLang) loads HF-named tensors through its own loader, which fuses and shards
them: a name it does not know may be ignored silently or fail half-way through a load. Rollouts therefore
check a whole bucket against the model's HF parameter shapes first (:func:`check_named_tensors`), so a bad
bucket changes nothing, and :func:`pack_bucket` / :func:`unpack_bucket` move a bucket as one flat byte
buffer where an engine boundary only carries plain bytes.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import lru_cache

import torch

#: Byte alignment of each tensor in a packed bucket (the largest element size torch has).
_ALIGN = 16
#: Offset between the seeds of consecutive requests of one batch (a prime, so groups do not collide).
SEED_STRIDE = 7919


def request_seed(seed: int | None, offset: int) -> int | None:
    """The seed of the ``offset``-th request of a batch: repeats of one prompt (GRPO's group, sent as
    separate requests) must not share a random stream, or they sample the same text."""
    return None if seed is None else seed + SEED_STRIDE * offset


@lru_cache(maxsize=8)
def hf_param_shapes(model_path: str) -> dict[str, tuple[int, ...]]:
    """Parameter name -> shape of the HF causal LM at ``model_path`` (built on the meta device: no memory), under
    both transformers' in-memory names and the checkpoint's (a mixture of experts' per-expert tensors, which
    transformers fuses in memory; see :mod:`polyrl.models.hf_names`); for a vision-language model, of its
    image-text-to-text class (the names an engine's ``weights_for_rollout`` uses)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    from polyrl.models.hf_names import checkpoint_shapes

    config = AutoConfig.from_pretrained(model_path)
    cls = AutoModelForImageTextToText if getattr(config, "vision_config", None) is not None else AutoModelForCausalLM
    with torch.device("meta"):
        model = cls.from_config(config)
    return {**{n: tuple(p.shape) for n, p in model.named_parameters()}, **checkpoint_shapes(model)}


def check_named_tensors(tensors: Sequence[tuple[str, torch.Tensor]], shapes: dict[str, tuple[int, ...]], *,
                        rollout: str, model_path: str, adapter_option: str | None = None) -> None:
    """Raise ``KeyError`` for a name the model lacks and ``ValueError`` for a wrong shape, naming the
    tensor, the rollout and the model. A LoRA adapter tensor gets a hint about ``model.lora.sync`` (and
    ``adapter_option``, the setting that makes the rollout serve adapters, where it has one)."""
    for name, tensor in tensors:
        if name not in shapes:
            hint = ""
            if ".lora_" in name:
                hint = " It is a LoRA adapter tensor: set model.lora.sync=merged"
                hint += f", or {adapter_option} to serve the adapter." if adapter_option else "."
            raise KeyError(f"{rollout} rollout: weight '{name}' matches no parameter of the model at "
                           f"{model_path}.{hint}")
        if tuple(tensor.shape) != shapes[name]:
            raise ValueError(f"{rollout} rollout: weight '{name}' has shape {tuple(tensor.shape)}, the model's is "
                             f"{shapes[name]}")


@dataclass(frozen=True)
class PackedEntry:
    """Where one tensor of a packed bucket lies in its byte buffer."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def pack_bucket(tensors: Sequence[tuple[str, torch.Tensor]]) -> tuple[torch.Tensor, list[PackedEntry]]:
    """One contiguous ``uint8`` buffer (on the tensors' device) holding every tensor of a bucket, and the
    entries to read them back: a single transfer (or broadcast) per bucket instead of one per tensor."""
    if not tensors:
        return torch.empty(0, dtype=torch.uint8), []
    entries, parts, offset = [], [], 0
    for name, tensor in tensors:
        flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        entries.append(PackedEntry(name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), offset,
                                   flat.numel()))
        pad = -flat.numel() % _ALIGN  # every tensor starts aligned, so it can be viewed as its dtype again
        parts.append(flat)
        if pad:
            parts.append(torch.zeros(pad, dtype=torch.uint8, device=flat.device))
        offset += flat.numel() + pad
    return torch.cat(parts), entries


def unpack_bucket(buffer: torch.Tensor, entries: Sequence[PackedEntry]) -> Iterator[tuple[str, torch.Tensor]]:
    """Inverse of :func:`pack_bucket`: views into ``buffer`` (no copies), in the packed order."""
    for e in entries:
        raw = buffer[e.offset : e.offset + e.nbytes]
        yield e.name, raw.view(getattr(torch, e.dtype)).reshape(e.shape)
