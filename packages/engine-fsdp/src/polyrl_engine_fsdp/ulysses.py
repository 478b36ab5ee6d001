"""Ulysses sequence parallelism for the FSDP engine (``<role>.fsdp.ulysses_sequence_parallel_size``, verl's name).

DeepSpeed-Ulysses (https://arxiv.org/abs/2309.14509): the ``sp`` ranks of a sequence-parallel group hold the same
micro-batch and each runs the model on ``1/sp`` of its sequence. Everything but attention is per token, so it runs
on the local slice as it is; attention needs every position, so around it an all-to-all turns ``[b, heads, S/sp, d]``
(all heads, a slice of the sequence) into ``[b, heads/sp, S, d]`` (a slice of the heads, the whole sequence), the
model's own attention runs on that, and a second all-to-all turns the result back. Activation memory per rank is
``1/sp`` of the sequence; the parameters stay FSDP-sharded over the whole group of ranks, as without SP.

How it plugs into transformers: a function registered in transformers' attention registry
(``transformers.AttentionInterface``, the documented way to bring an attention of one's own) wraps the inner
attention (``sdpa``, or ``flash_attention_2/3`` with packed sequences), and the model is switched to it with
``set_attn_implementation``. transformers builds no mask for a registered attention it has no mask function
for, so the engine passes the mask of the *whole* sequence as a ready 4-D ``attention_mask`` (used as given),
or, for flash attention, the packed sequences' ``cu_seq_lens_*`` / ``max_length_*`` keyword arguments.

The LM head (or value head) runs on the local slice too: each rank computes the log-probs of the response tokens
whose predicting position it holds, and :class:`_GatherOutputs` assembles the micro-batch's whole ``[N]`` vector on
every rank of the group. Its backward keeps this rank's part, times ``sp``: the ``sp`` ranks of a group compute
the same loss, FSDP averages gradients over all ``dp * sp`` ranks, and the loss is normalised by the
data-parallel size, so ``sp`` copies of each partial gradient average to the right one (verl does the same).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from polyrl.errors import ConfigError

#: The inner attentions sequence parallelism wraps; flash attention only over packed sequences.
SUPPORTED_ATTENTION = ("sdpa", "flash_attention_2", "flash_attention_3")
_FLASH = ("flash_attention_2", "flash_attention_3")

#: One process group per (sequence-parallel size, default group), shared by the roles of a process.
_GROUPS: dict[tuple[int, int], tuple[Any, int]] = {}


def check_sequence_parallel(size: int, world_size: int, *, key: str, hf_config: Any = None,
                            attn_implementation: str = "sdpa", packed: bool = False, role: str = "actor") -> int:
    """The data-parallel size ``world_size / size``, or a one-line :class:`ConfigError` naming ``key``.

    Checked before any process group starts (the trainer calls it through ``FSDPEngine.data_parallel_size``)
    and again when the engine is built: ``size`` divides the role's ranks and (when ``hf_config`` is given) the
    model's attention heads, and the attention implementation is one that sequence parallelism wraps.
    """
    if size < 1:
        raise ConfigError(f"{key}={size} must be 1 (off) or a divisor of the {world_size} ranks of the {role} group")
    if size == 1:
        return world_size
    if world_size % size:
        raise ConfigError(f"{key}={size} must divide the {world_size} ranks of the {role} group (trainer.n_workers); "
                          f"choose a divisor of {world_size}")
    if hf_config is not None:
        heads = getattr(hf_config, "num_attention_heads", None)
        if heads is not None and heads % size:
            raise ConfigError(f"{key}={size} must divide the model's {heads} attention heads ({role}.model.path); "
                              f"choose a divisor of {heads}")
    if attn_implementation not in SUPPORTED_ATTENTION:
        raise ConfigError(f"{key}={size} needs {role}.model.attn_implementation sdpa or flash_attention_2/3, not "
                          f"{attn_implementation!r}")
    if attn_implementation in _FLASH and not packed:
        raise ConfigError(f"{key}={size} with {role}.model.attn_implementation={attn_implementation} needs "
                          f"{role}.use_remove_padding=true (flash attention takes the packed sequences' lengths)")
    return world_size // size


@dataclass
class SequenceParallel:
    """This rank's sequence-parallel group: ``size`` consecutive ranks that share one data-parallel shard."""

    size: int
    #: This rank's index inside its group (which slice of each sequence it holds).
    rank: int
    group: Any
    #: The name the wrapped attention is registered under in transformers' attention registry.
    attention: str = ""

    @classmethod
    def build(cls, size: int) -> SequenceParallel:
        """The group of this rank (collective: every rank of the default group calls it, with the same ``size``)."""
        world, rank = dist.get_world_size(), dist.get_rank()
        key = (size, id(dist.group.WORLD))
        if key not in _GROUPS:
            mine = None
            for start in range(0, world, size):  # every rank creates every group, in the same order
                group = dist.new_group(list(range(start, start + size)))
                if start <= rank < start + size:
                    mine = group
            _GROUPS[key] = (mine, rank % size)
        group, sp_rank = _GROUPS[key]
        return cls(size=size, rank=sp_rank, group=group)

    def install(self, model: Any, inner: str) -> None:
        """Switch ``model``'s attention to the sequence-parallel wrapper around ``inner`` (``sdpa``...)."""
        from transformers import AttentionInterface

        name = f"polyrl_ulysses_sp{self.size}_{inner}"

        def attention(module, query, key, value, attention_mask, **kwargs):
            return ulysses_attention(module, query, key, value, attention_mask, sp=self, inner=inner, **kwargs)

        AttentionInterface.register(name, attention)
        model.set_attn_implementation(name)
        if getattr(model.config, "_attn_implementation", None) != name:
            raise ConfigError(f"{type(model).__name__} does not take an attention from transformers' registry, so "
                              "Ulysses sequence parallelism cannot wrap it; set ulysses_sequence_parallel_size=1")
        self.attention = name

    def shard(self, inputs: dict[str, Any], *, flash: bool = False) -> dict[str, Any]:
        """This rank's part of a micro-batch's model inputs (:func:`shard_inputs`), with the group attached."""
        out = shard_inputs(inputs, self.rank, self.size, flash=flash)
        out["gather"] = GatherPlan(positions=out.pop("owned_positions"), rank=self.rank, size=self.size,
                                   group=self.group)
        return out


# ---------------------------------------------------------------------------- splitting a micro-batch


def shard_inputs(inputs: dict[str, Any], rank: int, size: int, *, flash: bool = False) -> dict[str, Any]:
    """Rank ``rank``'s slice of ``inputs`` (what the engine's ``_model_inputs`` returns) for ``size`` SP ranks.

    The sequence (``[b, s]``, or one packed row ``[1, T]``) is padded on the right to a multiple of ``size`` and
    cut into ``size`` consecutive slices. ``attention_mask`` becomes the 4-D boolean mask of the *whole* padded
    sequence (``None`` where plain causal attention is exact), or, with ``flash``, ``None`` plus the packed
    sequences' ``cu_seq_lens_*`` / ``max_length_*``. ``index`` / ``targets`` keep the response tokens whose
    predicting position lies in this slice (``index`` into the local ``[b * S/size]`` states);
    ``owned_positions[k]`` lists which entries of the full ``[N]`` output rank ``k`` computes. Pure: no
    communication, so every rank of the group computes every rank's share.
    """
    ids, pos, attn = inputs["input_ids"], inputs["position_ids"], inputs["attention_mask"]
    b, s = ids.shape
    total = -(-s // size) * size
    pad, local = total - s, total // size
    packed = attn is None
    if packed:
        mask, extra = _packed_mask(pos, pad, flash)
    else:
        mask, extra = _padded_mask(attn, pad), {}
    if pad:
        ids = F.pad(ids, (0, pad))
        # trailing padding: any position works (nothing real attends to it); packed rows continue the last sequence
        tail = pos[:, -1:] + torch.arange(1, pad + 1, device=pos.device) if packed else torch.zeros(
            b, pad, dtype=pos.dtype, device=pos.device)
        pos = torch.cat([pos, tail.to(pos.dtype)], dim=1)
    index = inputs["index"]
    row, col = index // s, index % s
    owner = col // local
    mine = owner == rank
    start = rank * local
    out = {k: v for k, v in inputs.items() if k not in ("input_ids", "position_ids", "attention_mask", "index",
                                                         "targets")}
    out.update(input_ids=ids[:, start : start + local], position_ids=pos[:, start : start + local],
               attention_mask=mask, index=row[mine] * local + (col[mine] - start), targets=inputs["targets"][mine],
               owned_positions=[(owner == k).nonzero().squeeze(1) for k in range(size)], **extra)
    return out


def _padded_mask(attn: torch.Tensor, pad: int) -> torch.Tensor | None:
    """``[b, 1, S, S]``: causal, keys that are real tokens; each position may always see itself (a padding query
    with no real key would otherwise give NaN, which would reach the gradients through 0 * NaN)."""
    valid = attn.bool()
    if bool(valid.all()):  # no padding: what sdpa's is_causal computes (trailing alignment padding is harmless)
        return None
    valid = F.pad(valid, (0, pad))
    total = valid.shape[1]
    causal = torch.ones(total, total, dtype=torch.bool, device=attn.device).tril()
    allowed = causal[None] & valid[:, None, :]
    allowed |= torch.eye(total, dtype=torch.bool, device=attn.device)[None]
    return allowed[:, None]


def _packed_mask(pos: torch.Tensor, pad: int, flash: bool) -> tuple[torch.Tensor | None, dict[str, Any]]:
    """The packed row's sequences (a new one wherever ``position_ids`` do not go up by one, transformers' rule):
    a block-causal ``[1, 1, S, S]`` mask, ``None`` for a single sequence, or flash attention's varlen arguments.
    The alignment padding joins the last sequence (it comes after every real token, so nothing real sees it)."""
    p = pos[0]
    starts = torch.ones_like(p, dtype=torch.bool)
    starts[1:] = p[1:] != p[:-1] + 1
    seq = starts.long().cumsum(0) - 1
    seq = torch.cat([seq, seq[-1:].expand(pad)])
    count = int(seq[-1]) + 1
    if flash:
        lengths = torch.bincount(seq, minlength=count)
        cu = F.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
        longest = int(lengths.max())
        return None, {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}
    if count == 1:
        return None, {}
    total = seq.shape[0]
    causal = torch.ones(total, total, dtype=torch.bool, device=pos.device).tril()
    return (causal & (seq[:, None] == seq[None, :]))[None, None], {}


# ---------------------------------------------------------------------------- the attention wrapper


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` over dim 0 (chunk ``k`` goes to rank ``k``); its own adjoint, so backward is the same."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return _all_to_all(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_to_all(grad, ctx.group), None


def _all_to_all(x: torch.Tensor, group: Any) -> torch.Tensor:
    x = x.contiguous()  # chunks along dim 0 must be contiguous blocks (and so must the output: not empty_like(x))
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    dist.all_to_all_single(out, x, group=group)
    return out


def seq_to_heads(x: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:
    """``[b, h, S/sp, d]`` (this rank's slice of the sequence) -> ``[b, h/sp, S, d]`` (its share of the heads)."""
    b, h, s, d = x.shape
    chunks = x.reshape(b, sp.size, h // sp.size, s, d).transpose(0, 1)  # chunk k: the heads rank k gets
    got = _AllToAll.apply(chunks, sp.group)  # got[k]: rank k's slice of the sequence, for my heads
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // sp.size, sp.size * s, d)


def heads_to_seq(x: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:
    """``[b, S, h/sp, d]`` (an attention's output layout) -> ``[b, S/sp, h, d]``: the inverse of :func:`seq_to_heads`."""
    b, s, h, d = x.shape
    chunks = x.reshape(b, sp.size, s // sp.size, h, d).transpose(0, 1)  # chunk k: rank k's slice of the sequence
    got = _AllToAll.apply(chunks, sp.group)  # got[k]: rank k's heads, for my slice
    return got.permute(1, 2, 0, 3, 4).reshape(b, s // sp.size, sp.size * h, d)


class _KVGroupsView:
    """An attention module seen with another ``num_key_value_groups`` (after the KV heads were repeated)."""

    def __init__(self, module: Any, groups: int) -> None:
        self._module = module
        self.num_key_value_groups = groups

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


def ulysses_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, *, sp: SequenceParallel, inner: str,
                      **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Attention over the whole sequence from this rank's slice: ``[b, h, S/sp, d]`` inputs (transformers' layout),
    ``[b, S/sp, h, d]`` output. KV heads that ``sp`` does not divide are repeated until it does (GQA kept: each
    query head still meets its own KV head)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    kv_heads = key.shape[1]
    repeat = sp.size // math.gcd(kv_heads, sp.size)
    if repeat > 1:
        key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
    query, key, value = seq_to_heads(query, sp), seq_to_heads(key, sp), seq_to_heads(value, sp)
    groups = query.shape[1] // key.shape[1]
    view = module if getattr(module, "num_key_value_groups", groups) == groups else _KVGroupsView(module, groups)
    window = kwargs.get("sliding_window")
    if inner in _FLASH:
        kwargs.pop("position_ids", None)  # the local slice's; the varlen arguments describe the whole sequence
    elif window is not None:
        attention_mask = _band(attention_mask, query.shape[2], window, query.device)
    out, _ = ALL_ATTENTION_FUNCTIONS[inner](view, query, key, value, attention_mask, **kwargs)
    return heads_to_seq(out, sp), None


def _band(mask: torch.Tensor | None, total: int, window: int, device: Any) -> torch.Tensor:
    """``mask`` (or plain causal) restricted to the last ``window`` keys, as transformers' sliding window does."""
    i = torch.arange(total, device=device)
    band = (i[:, None] - i[None, :] < window) & (i[None, :] <= i[:, None])
    band |= torch.eye(total, dtype=torch.bool, device=device)
    return band[None, None] if mask is None else mask & band


# ---------------------------------------------------------------------------- assembling the outputs


@dataclass
class GatherPlan:
    """Which entries of a micro-batch's flat ``[N]`` outputs each rank of an SP group computed."""

    positions: list[torch.Tensor]
    rank: int
    size: int
    group: Any

    def to(self, device: Any) -> GatherPlan:
        """The plan with its index tensors on ``device``."""
        return GatherPlan([p.to(device) for p in self.positions], self.rank, self.size, self.group)

    def __call__(self, local: torch.Tensor) -> torch.Tensor:
        """The whole ``[N]`` vector from this rank's entries (collective over the group)."""
        return _GatherOutputs.apply(local, self)


class _GatherOutputs(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, plan: GatherPlan) -> torch.Tensor:
        ctx.plan = plan
        counts = [int(p.numel()) for p in plan.positions]
        total, longest = sum(counts), max(counts)
        full = local.new_zeros(total)
        if longest == 0:
            return full
        padded = local.new_zeros(longest)
        padded[: local.numel()] = local
        parts = [torch.empty_like(padded) for _ in range(plan.size)]
        dist.all_gather(parts, padded, group=plan.group)
        for part, where, n in zip(parts, plan.positions, counts):
            full[where] = part[:n]
        return full

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        plan = ctx.plan
        # the group's ranks all compute the same loss from this vector: each keeps the gradient of its own entries,
        # scaled by sp so that FSDP's average over dp * sp ranks equals the gradient averaged over dp
        return grad[plan.positions[plan.rank]] * plan.size, None
