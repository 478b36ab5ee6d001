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
    """One megatron tensor (``mcore``, named as on its own pipeline stage) and the HF tensors it holds."""

    mcore: str
    stage: int
    kind: str  # _REPLICATED, _ROWS (split along dim 0), _COLS (dim 1), _QKV, _FC1
    hf: tuple[str, ...]


def _entries(spec: ModelSpec, pp: int, value_head: bool) -> list[_Entry]:
    """Every converted tensor, in HF order, with the pipeline stage that holds it."""
    per_stage = spec.num_layers // pp
    out = [_Entry("embedding.word_embeddings.weight", 0, _ROWS, ("model.embed_tokens.weight",))]
    for i in range(spec.num_layers):
        stage, j = divmod(i, per_stage)
        m, h = f"decoder.layers.{j}.", f"model.layers.{i}."
        att = f"{h}self_attn."
        out.append(_Entry(m + "input_layernorm.weight", stage, _REPLICATED, (h + "input_layernorm.weight",)))
        out.append(_Entry(m + "self_attention.linear_qkv.weight", stage, _QKV,
                          tuple(f"{att}{p}_proj.weight" for p in "qkv")))
        if spec.qkv_bias:
            out.append(_Entry(m + "self_attention.linear_qkv.bias", stage, _QKV,
                              tuple(f"{att}{p}_proj.bias" for p in "qkv")))
        if spec.qk_norm:
            out.append(_Entry(m + "self_attention.q_layernorm.weight", stage, _REPLICATED, (att + "q_norm.weight",)))
            out.append(_Entry(m + "self_attention.k_layernorm.weight", stage, _REPLICATED, (att + "k_norm.weight",)))
        out.append(_Entry(m + "self_attention.linear_proj.weight", stage, _COLS, (att + "o_proj.weight",)))
        out.append(_Entry(m + "pre_mlp_layernorm.weight", stage, _REPLICATED, (h + "post_attention_layernorm.weight",)))
        out.append(_Entry(m + "mlp.linear_fc1.weight", stage, _FC1, (h + "mlp.gate_proj.weight", h + "mlp.up_proj.weight")))
        out.append(_Entry(m + "mlp.linear_fc2.weight", stage, _COLS, (h + "mlp.down_proj.weight",)))
    last = pp - 1
    out.append(_Entry("decoder.final_layernorm.weight", last, _REPLICATED, ("model.norm.weight",)))
    if value_head:
        out.append(_Entry("output_layer.score.weight", last, _REPLICATED, ("score.weight",)))
        if spec.value_head_bias:
            out.append(_Entry("output_layer.score.bias", last, _REPLICATED, ("score.bias",)))
    elif not spec.tie_word_embeddings:
        out.append(_Entry("output_layer.weight", last, _ROWS, ("lm_head.weight",)))
    return out


def hf_param_shapes(hf_config: Any, *, value_head: bool = False) -> dict[str, tuple[int, ...]]:
    """HF tensor names -> shapes of everything the converter reads and writes, in HF order.

    A tied model (``tie_word_embeddings``) has no ``lm_head.weight`` (``save_pretrained`` writes none either);
    ``value_head`` adds ``score.weight`` (and ``score.bias``) of ``XForTokenClassification``.
    """
    s = model_spec(hf_config)
    q, kv = s.num_attention_heads * s.head_dim, s.num_kv_heads * s.head_dim
    shapes: dict[str, tuple[int, ...]] = {}
    for entry in _entries(s, 1, value_head):
        for name in entry.hf:
            leaf = name.rsplit(".", 2)[-2] + "." + name.rsplit(".", 1)[-1]
            shapes[name] = {
                "embed_tokens.weight": (s.vocab_size, s.hidden_size), "lm_head.weight": (s.vocab_size, s.hidden_size),
                "q_proj.weight": (q, s.hidden_size), "k_proj.weight": (kv, s.hidden_size),
                "v_proj.weight": (kv, s.hidden_size), "q_proj.bias": (q,), "k_proj.bias": (kv,), "v_proj.bias": (kv,),
                "o_proj.weight": (s.hidden_size, q), "q_norm.weight": (s.head_dim,), "k_norm.weight": (s.head_dim,),
                "gate_proj.weight": (s.ffn_hidden_size, s.hidden_size),
                "up_proj.weight": (s.ffn_hidden_size, s.hidden_size),
                "down_proj.weight": (s.hidden_size, s.ffn_hidden_size), "score.weight": (1, s.hidden_size),
                "score.bias": (1,),
            }.get(leaf, (s.hidden_size,))  # the RMSNorm weights
    return shapes


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
                              value_head: bool = False) -> dict[str, torch.Tensor]:
    """This rank's megatron-core state dict (names as ``GPTModel.state_dict()``, no ``_extra_state``).

    ``hf_source``: an HF state dict, or a checkpoint folder (safetensors, sharded with an index or not; only the
    tensors of stage ``pp_rank`` are read). Tied embeddings also fill the last stage's output layer when
    ``pp > 1`` (megatron keeps a copy there). A critic's head (``score.*``) is taken when the source has it and
    left out otherwise (the model keeps its zero head). A missing tensor is a ConfigError naming it.
    """
    spec = model_spec(hf_config)
    source = _source(hf_source)
    entries = [e for e in _entries(spec, pp, value_head) if e.stage == pp_rank]
    if spec.tie_word_embeddings and not value_head and pp > 1 and pp_rank == pp - 1:
        entries.append(_Entry("output_layer.weight", pp_rank, _ROWS, ("model.embed_tokens.weight",)))
    out: dict[str, torch.Tensor] = {}
    for entry in entries:
        missing = [name for name in entry.hf if name not in source]
        if missing and entry.mcore.startswith("output_layer.score."):
            continue
        if missing:
            raise ConfigError(f"HF checkpoint has no tensor {missing[0]!r}, which a {spec.model_type} model with "
                              f"this config needs (is it the checkpoint config.json describes?)")
        out[entry.mcore] = _shard(entry, [source[name] for name in entry.hf], spec, tp_rank, tp).contiguous()
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
        value_head=value_head,
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

    Collective over this rank's tensor- and pipeline-parallel groups: every rank of the model-parallel group
    must iterate it to the end, in step. Every one of those ranks receives every tensor (HF order, HF shapes,
    the model's dtype and device); data-parallel replicas do not communicate. A bucket is yielded once it holds
    ``bucket_bytes`` (so it exceeds that by at most the HF tensors of one megatron tensor, e.g. gate + up), and
    tensors are rebuilt only as the consumer asks for the next bucket: one bucket is held at a time. Tied embeddings yield
    ``model.embed_tokens.weight`` only, as ``save_pretrained`` writes them.
    """
    from megatron.core import parallel_state as ps

    model = unwrap_model(model)
    spec = model_spec(hf_config)
    tp, pp = ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()
    stage = ps.get_pipeline_model_parallel_rank()
    tp_group, pp_group = ps.get_tensor_model_parallel_group(), ps.get_pipeline_model_parallel_group()
    shapes = hf_param_shapes(hf_config, value_head=value_head)
    params = model.state_dict(keep_vars=False)
    first = next(iter(model.parameters()))
    dtype, device = first.dtype, first.device
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for entry in _entries(spec, pp, value_head):
        if entry.stage == stage:
            local = params[entry.mcore].detach()
            if entry.kind != _REPLICATED and tp > 1:
                shards = [torch.empty_like(local) for _ in range(tp)]
                dist.all_gather(shards, local.contiguous(), group=tp_group)
            else:
                shards = [local]
            tensors = [t.to(dtype).contiguous() for t in _unshard(entry, shards, spec)]
        else:
            tensors = [torch.empty(shapes[name], dtype=dtype, device=device) for name in entry.hf]
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
