"""Helpers for the one batch container polyrl uses everywhere: a :class:`tensordict.TensorDict`.

Tensor fields have a leading batch dimension ``B``; non-tensor fields (strings,
dicts, ``None``) are stored per row as a :class:`tensordict.NonTensorStack`, so
indexing, ``torch.cat`` and ``chunk`` keep them aligned with the tensors.
See :mod:`polyrl.protocols` for the field names.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from tensordict import NonTensorStack, TensorDict


def make_batch(tensors: Mapping[str, torch.Tensor], non_tensors: Mapping[str, Sequence[Any]] | None = None) -> TensorDict:
    """A batch from tensors ``[B, ...]`` and per-row python values (lists of length ``B``)."""
    sizes = {k: v.shape[0] for k, v in tensors.items()} | {k: len(v) for k, v in (non_tensors or {}).items()}
    if not sizes:
        raise ValueError("make_batch needs at least one field")
    if len(set(sizes.values())) != 1:
        raise ValueError(f"batch fields have different lengths: {sizes}")
    td = TensorDict(dict(tensors), batch_size=[next(iter(sizes.values()))])
    for key, values in (non_tensors or {}).items():
        set_non_tensor(td, key, values)
    return td


def set_non_tensor(td: TensorDict, key: str, values: Sequence[Any]) -> None:
    """Store one python value per row under ``key``."""
    if len(values) != td.batch_size[0]:
        raise ValueError(f"non-tensor field '{key}' has {len(values)} values for a batch of {td.batch_size[0]}")
    td[key] = NonTensorStack.from_list(list(values))


def non_tensor(td: TensorDict, key: str, default: Any = ...) -> list[Any]:
    """The per-row python values of ``key`` as a list (``default`` per row when absent)."""
    if key not in td.keys():
        if default is ...:
            raise KeyError(f"batch has no field '{key}'; fields: {sorted(td.keys())}")
        return [default] * td.batch_size[0]
    value = td.get(key)
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if hasattr(value, "tolist"):
        return list(value.tolist())
    return [value.data] * td.batch_size[0] if hasattr(value, "data") else list(value)


def tensor_fields(td: TensorDict) -> TensorDict:
    """Only the tensor fields."""
    return td.select(*[k for k in td.keys() if isinstance(td.get(k), torch.Tensor)])


#: Non-tensor fields an engine's forward pass reads (per-row model inputs of different sizes: a vision-language
#: model's images, :data:`polyrl.data.multimodal.MULTI_MODAL_INPUTS`).
ENGINE_NON_TENSOR_FIELDS = ("multi_modal_inputs",)


def engine_fields(td: TensorDict) -> TensorDict:
    """What crosses to an engine: the tensor fields plus :data:`ENGINE_NON_TENSOR_FIELDS` where present."""
    keys = [k for k in td.keys() if isinstance(td.get(k), torch.Tensor) or k in ENGINE_NON_TENSOR_FIELDS]
    return td.select(*keys)


def concat(batches: Sequence[TensorDict]) -> TensorDict:
    """Concatenate batches along the batch dimension."""
    return torch.cat(list(batches), dim=0)


def split(td: TensorDict, parts: int) -> list[TensorDict]:
    """Split into ``parts`` contiguous shards of equal size (data-parallel dispatch).

    Raises ``ValueError`` when the batch does not divide evenly: pad or size the
    batch as a multiple of the data-parallel size.
    """
    size = td.batch_size[0]
    if size % parts:
        raise ValueError(f"a batch of {size} rows does not split evenly over {parts} data-parallel ranks")
    step = size // parts
    return [td[i * step : (i + 1) * step] for i in range(parts)]


def balanced_order(tokens: Sequence[int], groups: Sequence[Any], parts: int) -> tuple[list[int], float]:
    """A row order whose ``parts`` contiguous equal shards carry about the same number of tokens.

    Rows of one group (GRPO's samples of a prompt, by ``uid``) stay together, so each rank still sees whole
    groups; groups are placed largest first on the least-loaded shard that has room (every group must
    have the same number of rows, and the groups must divide evenly over ``parts``; otherwise the
    identity order is returned). Returns the order and the heaviest shard's tokens over the mean.
    """
    size = len(tokens)
    members: dict[Any, list[int]] = {}
    for row, group in enumerate(groups):
        members.setdefault(group, []).append(row)
    rows_per_group = {len(m) for m in members.values()}
    if parts <= 1 or size % parts or len(rows_per_group) != 1 or len(members) % parts:
        return list(range(size)), 1.0
    per_part = len(members) // parts
    load = [0] * parts
    placed: list[list[list[int]]] = [[] for _ in range(parts)]
    for rows in sorted(members.values(), key=lambda m: (-sum(tokens[i] for i in m), m[0])):
        part = min((p for p in range(parts) if len(placed[p]) < per_part), key=lambda p: (load[p], p))
        placed[part].append(rows)
        load[part] += sum(tokens[i] for i in rows)
    order = [row for part in placed for rows in sorted(part) for row in rows]
    mean = sum(load) / parts
    return order, (max(load) / mean if mean else 1.0)


def require_fields(td: TensorDict, fields: Sequence[str], who: str) -> None:
    """Raise ``KeyError`` naming every field in ``fields`` that ``td`` lacks."""
    missing = [f for f in fields if f not in td.keys()]
    if missing:
        raise KeyError(f"{who} needs batch fields {missing}, which the batch lacks (it has {sorted(td.keys())})")
