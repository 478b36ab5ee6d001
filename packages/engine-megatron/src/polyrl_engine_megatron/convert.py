"""Hugging Face <-> megatron-core weight conversion, in any tensor/pipeline-parallel layout.

HF -> Megatron (:func:`hf_to_megatron_state_dict`, :func:`load_hf_weights`): each rank reads only the HF tensors
its pipeline stage holds and cuts its tensor-parallel shard. Megatron -> HF (:func:`iter_hf_weights`): a
collective over the tensor- and pipeline-parallel groups that rebuilds one full HF tensor at a time and yields
them in buckets, so the whole model is never materialised at once.

Layouts (megatron-core's "local" GPT layer, see :mod:`polyrl_engine_megatron.model`):

* ``self_attention.linear_qkv``: per KV group ``g``, the ``heads / kv_heads`` query heads of ``g``, then the key
  head and the value head of ``g``; tensor parallelism splits whole groups (so GQA needs ``tp | kv_heads``).
* ``mlp.linear_fc1``: each tensor-parallel rank holds ``[gate shard; up shard]`` (megatron's GLU chunks in two).
* ``linear_proj`` / ``linear_fc2`` are split along their input dimension; the embedding and the output layer
  along the vocabulary; norms and the critic's value head are replicated.
* mixtures of experts (Qwen3-MoE ``mlp.gate`` / ``mlp.experts.E.{gate,up,down}_proj``, Mixtral
  ``block_sparse_moe.gate`` / ``block_sparse_moe.experts.E.{w1,w3,w2}``, the names their checkpoints and vLLM use):
  ``mlp.router.weight`` is replicated; expert ``E`` lives on expert-parallel rank ``E // (experts / ep)`` as
  ``mlp.experts.local_experts.{E mod experts/ep}``, its ``linear_fc1`` / ``linear_fc2`` split over the expert
  tensor-parallel ranks as a dense MLP's are over TP.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from polyrl.errors import ConfigError
from polyrl_engine_megatron.model import ModelSpec, model_spec

logger = logging.getLogger(__name__)

# How a megatron tensor relates to its HF tensor(s).
_REPLICATED, _ROWS, _COLS, _QKV, _FC1 = "replicated", "rows", "cols", "qkv", "fc1"


@dataclass(frozen=True)
class _Entry:
    """One megatron tensor (``mcore``, named as on its own pipeline stage) and the HF tensors it holds.

    An expert's tensor has ``expert`` >= 0 (its global index) and ``{local}`` in ``mcore`` for its index among the
    experts of the expert-parallel rank that holds it.
    """

    mcore: str
    stage: int
    kind: str  # _REPLICATED, _ROWS (split along dim 0), _COLS (dim 1), _QKV, _FC1
    hf: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]  # full HF shape of each of ``hf``
    expert: int = -1

    def local_name(self, experts_per_rank: int) -> str:
        """``mcore`` with the expert's index on its expert-parallel rank filled in."""
        return self.mcore.format(local=self.expert % experts_per_rank) if self.expert >= 0 else self.mcore


def _moe_names(spec: ModelSpec, i: int) -> tuple[str, Any]:
    """HF name of layer ``i``'s router, and of expert ``e``'s (gate, up, down) weights."""
    if spec.model_type == "mixtral":
        base = f"model.layers.{i}.block_sparse_moe."
        return base + "gate.weight", lambda e: tuple(f"{base}experts.{e}.{w}.weight" for w in ("w1", "w3", "w2"))
    base = f"model.layers.{i}.mlp."
    return base + "gate.weight", lambda e: tuple(f"{base}experts.{e}.{w}_proj.weight" for w in ("gate", "up", "down"))


def _entries(spec: ModelSpec, pp: int, value_head: bool) -> list[_Entry]:
    """Every converted tensor, in HF order, with the pipeline stage that holds it."""
    per_stage = spec.num_layers // pp
    hidden, vocab, ffn, moe_ffn = spec.hidden_size, spec.vocab_size, spec.ffn_hidden_size, spec.moe_ffn_hidden_size
    q, kv, d = spec.num_attention_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim, spec.head_dim
    norm = ((hidden,),)
    out = [_Entry("embedding.word_embeddings.weight", 0, _ROWS, ("model.embed_tokens.weight",), ((vocab, hidden),))]
    for i in range(spec.num_layers):
        stage, j = divmod(i, per_stage)
        m, h = f"decoder.layers.{j}.", f"model.layers.{i}."
        att = f"{h}self_attn."
        out.append(_Entry(m + "input_layernorm.weight", stage, _REPLICATED, (h + "input_layernorm.weight",), norm))
        out.append(_Entry(m + "self_attention.linear_qkv.weight", stage, _QKV,
                          tuple(f"{att}{p}_proj.weight" for p in "qkv"), ((q, hidden), (kv, hidden), (kv, hidden))))
        if spec.qkv_bias:
            out.append(_Entry(m + "self_attention.linear_qkv.bias", stage, _QKV,
                              tuple(f"{att}{p}_proj.bias" for p in "qkv"), ((q,), (kv,), (kv,))))
        if spec.qk_norm:
            out.append(_Entry(m + "self_attention.q_layernorm.weight", stage, _REPLICATED, (att + "q_norm.weight",),
                              ((d,),)))
            out.append(_Entry(m + "self_attention.k_layernorm.weight", stage, _REPLICATED, (att + "k_norm.weight",),
                              ((d,),)))
        out.append(_Entry(m + "self_attention.linear_proj.weight", stage, _COLS, (att + "o_proj.weight",),
                          ((hidden, q),)))
        out.append(_Entry(m + "pre_mlp_layernorm.weight", stage, _REPLICATED, (h + "post_attention_layernorm.weight",),
                          norm))
        if spec.is_moe:
            router, expert_names = _moe_names(spec, i)
            out.append(_Entry(m + "mlp.router.weight", stage, _REPLICATED, (router,), ((spec.num_experts, hidden),)))
            for e in range(spec.num_experts):
                gate, up, down = expert_names(e)
                local = m + "mlp.experts.local_experts.{local}."
                out.append(_Entry(local + "linear_fc1.weight", stage, _FC1, (gate, up),
                                  ((moe_ffn, hidden), (moe_ffn, hidden)), expert=e))
                out.append(_Entry(local + "linear_fc2.weight", stage, _COLS, (down,), ((hidden, moe_ffn),), expert=e))
        else:
            out.append(_Entry(m + "mlp.linear_fc1.weight", stage, _FC1, (h + "mlp.gate_proj.weight",
                                                                         h + "mlp.up_proj.weight"),
                              ((ffn, hidden), (ffn, hidden))))
            out.append(_Entry(m + "mlp.linear_fc2.weight", stage, _COLS, (h + "mlp.down_proj.weight",), ((hidden, ffn),)))
    last = pp - 1
    out.append(_Entry("decoder.final_layernorm.weight", last, _REPLICATED, ("model.norm.weight",), norm))
    if value_head:
        out.append(_Entry("output_layer.score.weight", last, _REPLICATED, ("score.weight",), ((1, hidden),)))
        if spec.value_head_bias:
            out.append(_Entry("output_layer.score.bias", last, _REPLICATED, ("score.bias",), ((1,),)))
    elif not spec.tie_word_embeddings:
        out.append(_Entry("output_layer.weight", last, _ROWS, ("lm_head.weight",), ((vocab, hidden),)))
    return out


def hf_param_shapes(hf_config: Any, *, value_head: bool = False) -> dict[str, tuple[int, ...]]:
    """HF tensor names -> shapes of everything the converter reads and writes, in HF order.

    A tied model (``tie_word_embeddings``) has no ``lm_head.weight`` (``save_pretrained`` writes none either);
    ``value_head`` adds ``score.weight`` (and ``score.bias``) of ``XForTokenClassification``. Mixtures of experts
    are named per expert, as their checkpoints are (not transformers' fused in-memory ``experts.gate_up_proj``).
    """
    return {name: shape for entry in _entries(model_spec(hf_config), 1, value_head)
            for name, shape in zip(entry.hf, entry.shapes, strict=True)}


class _SafetensorsFolder(Mapping[str, torch.Tensor]):
    """The tensors of an HF checkpoint folder, read one at a time on access (nothing is loaded up front)."""

    def __init__(self, folder: Path) -> None:
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self._files = {name: folder / file for name, file in weight_map.items()}
        else:
            from safetensors import safe_open

            files = sorted(folder.glob("*.safetensors"))
            if not files:
                raise ConfigError(f"{folder}: no *.safetensors weights found (engine 'megatron' reads safetensors "
                                  "checkpoints; re-save the model with save_pretrained(safe_serialization=True))")
            self._files = {}
            for file in files:
                with safe_open(str(file), framework="pt") as f:
                    self._files.update(dict.fromkeys(f.keys(), file))

    def __getitem__(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(str(self._files[name]), framework="pt") as f:
            return f.get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._files)

    def __len__(self) -> int:
        return len(self._files)


def _source(hf_source: Mapping[str, torch.Tensor] | str | os.PathLike) -> Mapping[str, torch.Tensor]:
    if isinstance(hf_source, Mapping):
        return hf_source
    folder = Path(hf_source)
    if not folder.is_dir():
        raise ConfigError(f"{folder}: not an HF checkpoint folder (model.path must name a folder with config.json "
                          "and *.safetensors)")
    return _SafetensorsFolder(folder)


def _shard(entry: _Entry, tensors: list[torch.Tensor], spec: ModelSpec, tp_rank: int, tp: int) -> torch.Tensor:
    """This tensor-parallel rank's part of ``entry``, from its full HF tensors."""
    if entry.kind == _REPLICATED:
        return tensors[0]
    if entry.kind == _ROWS:
        return tensors[0].chunk(tp, dim=0)[tp_rank]
    if entry.kind == _COLS:
        return tensors[0].chunk(tp, dim=1)[tp_rank]
    if entry.kind == _FC1:
        return torch.cat([t.chunk(tp, dim=0)[tp_rank] for t in tensors], dim=0)
    # _QKV: [q; k; v] regrouped per KV group, then whole groups split over the tensor-parallel ranks
    q, k, v = tensors
    groups, rest = spec.num_kv_heads, q.shape[1:]
    fused = torch.cat([q.reshape(groups, -1, *rest), k.reshape(groups, -1, *rest), v.reshape(groups, -1, *rest)],
                      dim=1)
    return fused.chunk(tp, dim=0)[tp_rank].reshape(-1, *rest)


def _unshard(entry: _Entry, shards: list[torch.Tensor], spec: ModelSpec) -> list[torch.Tensor]:
    """The full HF tensors of ``entry`` from every tensor-parallel rank's shard (in rank order)."""
    if entry.kind == _REPLICATED:
        return [shards[0]]
    if entry.kind == _ROWS:
        return [torch.cat(shards, dim=0)]
    if entry.kind == _COLS:
        return [torch.cat(shards, dim=1)]
    if entry.kind == _FC1:
        halves = [s.chunk(2, dim=0) for s in shards]
        return [torch.cat([h[0] for h in halves], dim=0), torch.cat([h[1] for h in halves], dim=0)]
    rest = shards[0].shape[1:]
    per_group = spec.num_attention_heads // spec.num_kv_heads * spec.head_dim
    fused = torch.cat(shards, dim=0).reshape(spec.num_kv_heads, per_group + 2 * spec.head_dim, *rest)
    q, k, v = fused.split([per_group, spec.head_dim, spec.head_dim], dim=1)
    return [t.reshape(-1, *rest).contiguous() for t in (q, k, v)]


def hf_to_megatron_state_dict(hf_source: Mapping[str, torch.Tensor] | str | os.PathLike, hf_config: Any, *,
                              tp_rank: int = 0, tp: int = 1, pp_rank: int = 0, pp: int = 1,
                              value_head: bool = False, ep_rank: int = 0, ep: int = 1, etp_rank: int | None = None,
                              etp: int | None = None) -> dict[str, torch.Tensor]:
    """This rank's megatron-core state dict (names as ``GPTModel.state_dict()``, no ``_extra_state``).

    ``hf_source``: an HF state dict, or a checkpoint folder (safetensors, sharded with an index or not; only the
    tensors of stage ``pp_rank`` are read). Tied embeddings also fill the last stage's output layer when
    ``pp > 1`` (megatron keeps a copy there). A critic's head (``score.*``) is taken when the source has it and
    left out otherwise (the model keeps its zero head). A mixture of experts keeps the experts of expert-parallel
    rank ``ep_rank`` of ``ep``, split over ``etp`` expert tensor-parallel ranks (default: ``tp``). A missing tensor
    is a ConfigError naming it.
    """
    spec = model_spec(hf_config)
    source = _source(hf_source)
    etp, etp_rank = (tp, tp_rank) if etp is None else (etp, etp_rank or 0)
    per_rank = max(1, spec.num_experts // ep)
    entries = [e for e in _entries(spec, pp, value_head)
               if e.stage == pp_rank and (e.expert < 0 or e.expert // per_rank == ep_rank)]
    if spec.tie_word_embeddings and not value_head and pp > 1 and pp_rank == pp - 1:
        entries.append(_Entry("output_layer.weight", pp_rank, _ROWS, ("model.embed_tokens.weight",),
                              ((spec.vocab_size, spec.hidden_size),)))
    out: dict[str, torch.Tensor] = {}
    for entry in entries:
        missing = [name for name in entry.hf if name not in source]
        if missing and entry.mcore.startswith("output_layer.score."):
            continue
        if missing:
            raise ConfigError(f"HF checkpoint has no tensor {missing[0]!r}, which a {spec.model_type} model with "
                              f"this config needs (is it the checkpoint config.json describes?)")
        rank, size = (etp_rank, etp) if entry.expert >= 0 else (tp_rank, tp)
        out[entry.local_name(per_rank)] = _shard(entry, [source[name] for name in entry.hf], spec, rank,
                                                 size).contiguous()
    return out


def unwrap_model(model: Any) -> Any:
    """The ``GPTModel`` inside megatron's DDP / Float16Module wrappers (which keep it in ``.module``)."""
    while hasattr(model, "module"):
        model = model.module
    return model


def load_hf_weights(model: Any, hf_source: Mapping[str, torch.Tensor] | str | os.PathLike, hf_config: Any, *,
                    value_head: bool = False) -> None:
    """Load HF weights into this rank's (possibly wrapped) megatron model under the current parallel state.

    Every parameter must be covered, except a critic's value head when the source has none (it stays zero).
    """
    from megatron.core import parallel_state as ps

    model = unwrap_model(model)
    state = hf_to_megatron_state_dict(
        hf_source, hf_config, tp_rank=ps.get_tensor_model_parallel_rank(), tp=ps.get_tensor_model_parallel_world_size(),
        pp_rank=ps.get_pipeline_model_parallel_rank(), pp=ps.get_pipeline_model_parallel_world_size(),
        value_head=value_head, ep_rank=ps.get_expert_model_parallel_rank(),
        ep=ps.get_expert_model_parallel_world_size(), etp_rank=ps.get_expert_tensor_parallel_rank(),
        etp=ps.get_expert_tensor_parallel_world_size(),
    )
    own = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    for name, tensor in state.items():
        if name not in own:
            raise ConfigError(f"converted tensor {name!r} has no parameter in the megatron model (the model was built "
                              "for another config or layout)")
        if tuple(own[name].shape) != tuple(tensor.shape):
            raise ConfigError(f"converted tensor {name!r} has shape {tuple(tensor.shape)}, the megatron parameter "
                              f"{tuple(own[name].shape)}: the model was built for another config or layout")
    missing = [k for k in own if k not in state and not (value_head and k.startswith("output_layer.score."))]
    if missing:
        raise ConfigError(f"the HF weights left megatron parameters unset: {missing[:5]}")
    if value_head and "output_layer.score.weight" in own and "output_layer.score.weight" not in state:
        logger.info("HF checkpoint has no value head (score.*): the critic starts from a zero head")
    model.load_state_dict(state, strict=False)


def iter_hf_weights(model: Any, hf_config: Any, *, value_head: bool = False,
                    bucket_bytes: int = 512 << 20) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Full HF-named tensors of a (possibly wrapped) megatron model, in buckets of about ``bucket_bytes``.

    Collective over this rank's tensor-, pipeline- and (for a mixture of experts) expert-parallel groups: every
    rank of those groups must iterate it to the end, in step. Every one of those ranks receives every tensor (HF
    order, HF shapes, the model's dtype and device); data-parallel replicas do not communicate (with expert
    parallelism the ranks of an expert-parallel group are data-parallel ranks of the dense layers, and each expert
    is broadcast from the rank that holds it). A bucket is yielded once it holds ``bucket_bytes`` (so it exceeds
    that by at most the HF tensors of one megatron tensor, e.g. gate + up), and tensors are rebuilt only as the
    consumer asks for the next bucket: one bucket is held at a time. Tied embeddings yield
    ``model.embed_tokens.weight`` only, as ``save_pretrained`` writes them. Experts are named per expert, as the
    family's checkpoints (and vLLM's loaders) name them.
    """
    from megatron.core import parallel_state as ps

    model = unwrap_model(model)
    spec = model_spec(hf_config)
    tp, pp = ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()
    stage = ps.get_pipeline_model_parallel_rank()
    tp_group, pp_group = ps.get_tensor_model_parallel_group(), ps.get_pipeline_model_parallel_group()
    ep = ps.get_expert_model_parallel_world_size() if spec.is_moe else 1
    ep_rank = ps.get_expert_model_parallel_rank() if spec.is_moe else 0
    etp = ps.get_expert_tensor_parallel_world_size() if spec.is_moe else 1
    per_rank = max(1, spec.num_experts // ep)
    params = model.state_dict(keep_vars=False)
    first = next(iter(model.parameters()))
    dtype, device = first.dtype, first.device
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for entry in _entries(spec, pp, value_head):
        owner = entry.expert // per_rank if entry.expert >= 0 else ep_rank
        if entry.stage == stage and owner == ep_rank:
            local = params[entry.local_name(per_rank)].detach()
            split, group = (etp, ps.get_expert_tensor_parallel_group()) if entry.expert >= 0 else (tp, tp_group)
            if entry.kind != _REPLICATED and split > 1:
                shards = [torch.empty_like(local) for _ in range(split)]
                dist.all_gather(shards, local.contiguous(), group=group)
            else:
                shards = [local]
            tensors = [t.to(dtype).contiguous() for t in _unshard(entry, shards, spec)]
        else:
            tensors = [torch.empty(shape, dtype=dtype, device=device) for shape in entry.shapes]
        if entry.expert >= 0 and ep > 1 and entry.stage == stage:
            for t in tensors:
                dist.broadcast(t, group=ps.get_expert_model_parallel_group(), group_src=owner)
        if pp > 1:
            for t in tensors:
                dist.broadcast(t, group=pp_group, group_src=entry.stage)
        for name, t in zip(entry.hf, tensors, strict=True):
            bucket.append((name, t))
            size += t.numel() * t.element_size()
        if size >= bucket_bytes:
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket
