"""The megatron-core engine: :class:`polyrl.protocols.Engine` over a megatron ``GPTModel``.

One engine per role (actor, ref, critic) in each worker process. The role's ``world_size`` ranks form a
``tp x pp x dp`` grid (megatron's ``parallel_state``); each data-parallel group of ``tp * pp`` ranks holds one
copy of the model and gets the same shard of every batch (the worker group dispatches by :attr:`dp_rank`
and keeps the result of the rank whose :attr:`collects_output` is true: tensor-parallel rank 0 of the last
pipeline stage).

A step runs through megatron's own schedule (``get_forward_backward_func``: no pipelining, or 1F1B over the
pipeline stages) with polyrl's loss closures. Sequences are packed to the left (prompt and response tokens
of a row without the padding between them), so the causal mask alone keeps rows apart from their padding and
the rotary positions are ``0 .. len - 1``, as in the HF model. The last stage computes the response tokens'
log-probs and entropy from its vocabulary-parallel logits (:mod:`polyrl_engine_megatron.vocab_parallel`):
no rank ever holds logits over the whole vocabulary.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tensordict import TensorDict

from polyrl.batch import require_fields
from polyrl.checkpoint_io import atomic_checkpoint_dir, load_json, load_tensors
from polyrl.distributed import ensure_process_group
from polyrl.errors import CheckpointError, ConfigError
from polyrl.lr_schedules import build_lr_scheduler
from polyrl.protocols import INFERENCE_ROLES, ForwardProducts, LossScale
from polyrl_engine_megatron.config import MegatronConfig

logger = logging.getLogger(__name__)

_NEEDED = ("input_ids", "attention_mask", "position_ids", "responses", "response_mask")
#: what :meth:`MegatronEngine.save_checkpoint` writes into ``meta.json``; a loader refuses other formats
CHECKPOINT_FORMAT = "polyrl-megatron-1"


# ---------------------------------------------------------------------------- configuration checks


def _megatron_block(config: Any) -> MegatronConfig:
    block = getattr(config, "plugin_config", None)
    return block if isinstance(block, MegatronConfig) else MegatronConfig()


def _hf_config(config: Any, role: str) -> Any:
    from transformers import AutoConfig

    from polyrl.models.paths import check_model_path

    mcfg = config.model
    check_model_path(mcfg.path, f"{role}.model.path")
    return AutoConfig.from_pretrained(mcfg.path, trust_remote_code=mcfg.trust_remote_code, **mcfg.override_config)


def _dtype(name: str, key: str) -> torch.dtype:
    value = getattr(torch, str(name), None)
    if value not in (torch.float32, torch.bfloat16, torch.float16):
        raise ConfigError(f"{key}={name!r}: the megatron engine computes in float32, bfloat16 or float16")
    return value


_DISPATCHERS = ("alltoall", "allgather")
_BALANCING = ("aux_loss", "seq_aux_loss", "global_aux_loss", "none")
_RECOMPUTE = {"recompute_granularity": ("full", "selective"), "recompute_method": ("uniform", "block")}


def _check_role_config(config: Any, role: str, world_size: int) -> tuple[Any, MegatronConfig, int]:
    """Everything about a role's config that can be wrong, checked without a process group.

    Returns ``(hf_config, megatron block, data-parallel size)``; raises :class:`ConfigError` naming the key.
    """
    from polyrl_engine_megatron.cpu_emulation import check_megatron_core
    from polyrl_engine_megatron.model import model_spec, validate_layout

    check_megatron_core()
    block = _megatron_block(config)
    key = f"{role}.megatron"
    if config.model.lora.rank > 0:
        raise ConfigError(f"{role}.model.lora.rank={config.model.lora.rank}: engine 'megatron' has no LoRA "
                          "(megatron-core has no adapter layers for the local model spec). Set "
                          f"{role}.model.lora.rank=0, or use {role}.engine=fsdp for LoRA")
    for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                 "expert_model_parallel_size"):
        if getattr(block, name) < 1:
            raise ConfigError(f"{key}.{name}={getattr(block, name)} must be at least 1")
    _dtype(config.model.dtype, f"{role}.model.dtype")
    if block.param_dtype is not None:
        _dtype(block.param_dtype, f"{role}.megatron.param_dtype")
    _check_choices(block, key)
    hf_config = _hf_config(config, role)
    if getattr(hf_config, "vision_config", None) is not None:
        raise ConfigError(f"{role}.model.path={config.model.path} is a vision-language model ({hf_config.model_type}): "
                          f"engine 'megatron' trains text models only. Set {role}.engine=fsdp (docs/vlm.md)")
    dp = validate_layout(hf_config, tp=block.tensor_model_parallel_size, pp=block.pipeline_model_parallel_size,
                         world_size=world_size, key=key, sequence_parallel=block.sequence_parallel,
                         lora=False, cp=block.context_parallel_size, ep=block.expert_model_parallel_size,
                         etp=block.expert_tensor_parallel_size, source=f"{role}.model.path={config.model.path}")
    if not model_spec(hf_config).is_moe:
        defaults = MegatronConfig()
        for name in ("moe_aux_loss_coeff", "moe_router_load_balancing_type", "moe_z_loss_coeff",
                     "moe_token_dispatcher_type"):
            if getattr(block, name) != getattr(defaults, name):
                raise ConfigError(f"{key}.{name}={getattr(block, name)!r} is set, but {role}.model.path is not a "
                                  "mixture of experts (it has no router); remove it")
    return hf_config, block, dp


def _check_choices(block: MegatronConfig, key: str) -> None:
    """The megatron block's enumerated and free-form keys (no model needed)."""
    from dataclasses import fields

    from megatron.core.transformer.transformer_config import TransformerConfig

    if block.moe_token_dispatcher_type not in _DISPATCHERS:
        raise ConfigError(f"{key}.moe_token_dispatcher_type={block.moe_token_dispatcher_type!r}: choose one of "
                          f"{', '.join(_DISPATCHERS)}")
    if block.moe_router_load_balancing_type not in _BALANCING:
        raise ConfigError(f"{key}.moe_router_load_balancing_type={block.moe_router_load_balancing_type!r}: choose "
                          f"one of {', '.join(_BALANCING)}")
    if block.moe_aux_loss_coeff < 0:
        raise ConfigError(f"{key}.moe_aux_loss_coeff={block.moe_aux_loss_coeff} must be >= 0")
    for name, choices in _RECOMPUTE.items():
        value = getattr(block, name)
        if value is not None and value not in choices:
            raise ConfigError(f"{key}.{name}={value!r}: choose one of {', '.join(choices)} (or null)")
    if block.recompute_granularity == "full" and block.recompute_method is None:
        raise ConfigError(f"{key}.recompute_granularity=full needs {key}.recompute_method (uniform or block) and "
                          f"{key}.recompute_num_layers")
    if block.recompute_method is not None and not (block.recompute_num_layers or 0) >= 1:
        raise ConfigError(f"{key}.recompute_method={block.recompute_method!r} needs {key}.recompute_num_layers >= 1")
    known = {f.name for f in fields(TransformerConfig)}
    for name in block.override_transformer_config:
        if name not in known:
            raise ConfigError(f"{key}.override_transformer_config.{name}: megatron-core's TransformerConfig has no "
                              "such field")


def _transformer_overrides(block: MegatronConfig, config: Any, *, moe: bool) -> dict[str, Any]:
    """The TransformerConfig fields the role's config sets: recomputation, MoE routing, verl-style overrides."""
    out: dict[str, Any] = {}
    if block.recompute_granularity is not None:
        out["recompute_granularity"] = block.recompute_granularity
        if block.recompute_granularity == "full":
            out.update(recompute_method=block.recompute_method, recompute_num_layers=block.recompute_num_layers)
        if block.recompute_modules is not None:
            out["recompute_modules"] = list(block.recompute_modules)
    elif config.model.gradient_checkpointing:
        out.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    if moe:
        out.update(moe_aux_loss_coeff=block.moe_aux_loss_coeff, moe_z_loss_coeff=block.moe_z_loss_coeff,
                   moe_router_load_balancing_type=block.moe_router_load_balancing_type,
                   moe_token_dispatcher_type=block.moe_token_dispatcher_type)
    out.update(block.override_transformer_config)
    return out


# ---------------------------------------------------------------------------- micro-batches


@dataclass
class _MicroBatch:
    """One micro-batch as this rank's model sees it, and where each scored response token is.

    Rows are packed to the left (a row's real tokens without the padding between prompt and response). Padded
    layout: ``input_ids [b, S]``, each row padded on the right to the micro-batch's longest. Packed layout
    (``use_remove_padding``): every row one after the other in ``input_ids [1, T]``, each padded to a multiple of
    the split unit, with ``cu_seqlens``. With context parallelism this rank holds chunks ``r`` and ``2 CP - 1 - r`` of
    every sequence (of every row in the padded layout); ``mine`` says which scored tokens it predicts.
    """

    td: TensorDict  # the rows, response-width fields trimmed to ``width`` (what the loss closure gets)
    input_ids: torch.Tensor  # [b, S / cp] or [1, T / cp]: this rank's tokens
    position_ids: torch.Tensor  # same shape: each token's position in its sequence
    padding: torch.Tensor  # same shape, True at padding (MoE routing leaves it out of the load-balancing loss)
    rows: torch.Tensor  # [N] row of each scored response token (every rank: the whole micro-batch)
    cols: torch.Tensor  # [N] its column in the response
    mine: torch.Tensor  # [M] which of the N this rank predicts (all N without context parallelism)
    pred_row: torch.Tensor  # [M] batch index of the predicting position in this rank's output
    pred_pos: torch.Tensor  # [M] its sequence index in this rank's output
    targets: torch.Tensor  # [M] the token ids
    width: int  # response columns kept
    cu_seqlens: torch.Tensor | None = None  # packed layout: [rows + 1] padded sequence boundaries (int32)
    max_seqlen: int = 0


def _pack(td: TensorDict, multiple: int = 1, *, cp: int = 1, cp_rank: int = 0, packed: bool = False) -> _MicroBatch:
    """Pack ``td``'s rows (see :class:`_MicroBatch`) and index the response tokens.

    Response token ``t`` of a row is scored when it and the token before it are real (attention 1); its prediction
    comes from the packed position of the token before it. A sequence (the padded micro-batch, or each packed row)
    is padded to a multiple of ``multiple`` (sequence parallelism splits it over the tensor-parallel ranks), times
    ``2 * cp`` with context parallelism (megatron's load-balanced chunks).
    """
    from polyrl_engine_megatron.attention import cp_chunk_positions

    ids, attn = td["input_ids"], td["attention_mask"].bool()
    b, s = ids.shape
    r = td["responses"].shape[1]
    unit = multiple * (2 * cp if cp > 1 else 1)
    place = attn.long().cumsum(-1) - 1  # packed position of each real token
    lengths = attn.sum(-1)
    real_rows, real_cols = attn.nonzero(as_tuple=True)
    prev = torch.cat([torch.zeros(b, 1, dtype=torch.bool), attn[:, :-1]], dim=1)
    rows, cols = (attn[:, s - r :] & prev[:, s - r :]).nonzero(as_tuple=True)
    pred = place[rows, s - r + cols] - 1
    width = max(1, int(attn[:, s - r :].sum(-1).max()))
    out = td.clone(False)
    for key in list(td.keys()):
        value = td.get(key)
        if (isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] == r
                and key not in ("input_ids", "attention_mask", "position_ids")):
            out[key] = value[:, :width]
    targets = td["responses"][rows, cols]
    if packed:
        padded = (lengths.clamp(min=1) + unit - 1) // unit * unit
        starts = torch.cat([torch.zeros(1, dtype=torch.long), padded.cumsum(0)])
        flat = torch.zeros(int(starts[-1]), dtype=ids.dtype)
        flat[starts[real_rows] + place[real_rows, real_cols]] = ids[real_rows, real_cols]
        chunks = [cp_chunk_positions(int(n), cp, cp_rank) for n in padded]
        order = torch.cat([int(starts[i]) + c for i, c in enumerate(chunks)])  # this rank's tokens, global index
        positions = torch.cat(chunks)
        seq_of = torch.cat([torch.full((len(c),), i) for i, c in enumerate(chunks)])
        local = torch.full((int(starts[-1]),), -1, dtype=torch.long)
        local[order] = torch.arange(len(order))
        where = local[starts[rows] + pred]
        mine = (where >= 0).nonzero(as_tuple=True)[0]
        return _MicroBatch(td=out, input_ids=flat[order][None], position_ids=positions[None],
                           padding=(positions >= lengths[seq_of])[None], rows=rows, cols=cols, mine=mine,
                           pred_row=torch.zeros_like(mine), pred_pos=where[mine], targets=targets[mine], width=width,
                           cu_seqlens=starts.to(torch.int32), max_seqlen=int(padded.max()))
    length = -(-max(1, int(lengths.max())) // unit) * unit
    full = torch.zeros(b, length, dtype=ids.dtype)
    full[real_rows, place[real_rows, real_cols]] = ids[real_rows, real_cols]
    order = cp_chunk_positions(length, cp, cp_rank)
    local = torch.full((length,), -1, dtype=torch.long)
    local[order] = torch.arange(len(order))
    where = local[pred]
    mine = (where >= 0).nonzero(as_tuple=True)[0]
    positions = order.expand(b, -1).contiguous()
    return _MicroBatch(td=out, input_ids=full[:, order], position_ids=positions,
                       padding=positions >= lengths[:, None], rows=rows, cols=cols, mine=mine, pred_row=rows[mine],
                       pred_pos=where[mine], targets=targets[mine], width=width)


def _split(batch: TensorDict, config: Any, cp: int = 1) -> list[torch.Tensor]:
    """Row indices of each micro-batch: ``micro_batch_size`` rows, or by token budget with ``use_dynamic_bsz``.

    Deterministic in the batch alone, so every rank of a data-parallel group (which got the same shard)
    runs the same micro-batches, as megatron's tensor-, context- and pipeline-parallel exchanges need. The token
    budget ``max_token_len_per_gpu`` is per rank: ``cp`` context-parallel ranks share a micro-batch of ``cp`` times
    as many tokens (verl's rule).
    """
    size = batch.batch_size[0]
    if not config.use_dynamic_bsz:
        step = max(1, config.micro_batch_size)
        return [torch.arange(i, min(i + step, size)) for i in range(size)[::step]]
    lengths = batch["attention_mask"].sum(-1).tolist()
    order = sorted(range(size), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    for i in order:  # first-fit decreasing; a packed micro-batch costs rows x its longest row
        for g in groups:
            if max(lengths[j] for j in g + [i]) * (len(g) + 1) <= config.max_token_len_per_gpu * cp:
                g.append(i)
                break
        else:
            groups.append([i])
    return [torch.tensor(sorted(g)) for g in groups]


# ---------------------------------------------------------------------------- the engine


class MegatronEngine:
    """megatron-core engine for the ``actor``, ``ref`` (no optimizer) and ``critic`` (``model_type="value"``) roles.

    Built as ``MegatronEngine(config, role=..., model_type=..., platform=...)`` with ``config`` an
    :class:`~polyrl.config.roles.EngineRoleConfig` whose ``plugin_config`` is a :class:`MegatronConfig`.
    Roles in one process share megatron's (global) parallel state, so they must use the same TP/PP layout.
    """

    #: The :class:`~polyrl.protocols.ForwardProducts` this engine computes (from its vocabulary-parallel logits).
    forward_products: frozenset[str] = frozenset({"sum_pi_squared", "top_k", "gather_ids"})

    @staticmethod
    def data_parallel_size(role_config: Any, world_size: int, *, role: str = "actor") -> int:
        """The data-parallel size of a role on ``world_size`` ranks, or a :class:`ConfigError` naming the key.

        Called by the trainer before any worker starts: checks megatron-core, LoRA, and that TP x PP divides
        the world size, the attention heads, the vocabulary and the layers. ``role`` (``actor``, ``critic``,
        ``ref``) is the config section the errors name (``critic.megatron.tensor_model_parallel_size``).
        """
        return _check_role_config(role_config, role, world_size)[2]

    def __init__(self, config: Any, *, role: str, model_type: str = "causal_lm", platform: Any = None) -> None:
        from polyrl.platforms import detect_platform

        if model_type not in ("causal_lm", "value"):
            raise ConfigError(f"{role}: engine 'megatron' builds causal LMs and value models, not {model_type!r}")
        self.config = config
        self.role = role
        self.model_type = model_type
        self.platform = platform or detect_platform()
        self.device = self.platform.current_device()
        self.step = 0
        ensure_process_group(self.platform.dist_backend)
        self.hf_config, self.megatron, _ = _check_role_config(config, role, dist.get_world_size())
        self._build_model()
        self.optimizer = None
        self.schedulers: list[Any] = []
        if role not in INFERENCE_ROLES:  # ref, reward_model, teacher only infer
            self._build_optimizer()

    # ------------------------------------------------------------------ layout
    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel index (batches are split by it)."""
        return self.parallel.dp_rank

    @property
    def dp_size(self) -> int:
        """Data-parallel size: world size / (TP x CP x PP)."""
        return self.parallel.dp

    @property
    def collects_output(self) -> bool:
        """True on tensor- and context-parallel rank 0 of the last pipeline stage: the one rank per DP group whose
        results count."""
        return self.parallel.collects_output

    # ------------------------------------------------------------------ construction
    def _build_model(self) -> None:
        from megatron.core import parallel_state as mpu
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        from polyrl_engine_megatron.convert import load_hf_weights
        from polyrl_engine_megatron.model import build_gpt_model, model_spec, transformer_config_from_hf
        from polyrl_engine_megatron.parallel import init_parallel_state

        block, mcfg = self.megatron, self.config.model
        tp, pp = block.tensor_model_parallel_size, block.pipeline_model_parallel_size
        cp, ep, etp = block.context_parallel_size, block.expert_model_parallel_size, block.expert_tensor_parallel_size
        try:
            self.parallel = init_parallel_state(tp, pp, cp=cp, ep=ep, etp=etp, seed=self.config.seed,
                                                cpu=self.platform.device_type == "cpu", key=f"{self.role}.megatron")
        except RuntimeError as exc:  # another role of this process set up a different layout
            raise ConfigError(f"{self.role}.megatron: TP={tp}, PP={pp}, CP={cp}, EP={ep} differs from the layout "
                              f"another role in this worker already uses ({exc}); roles sharing workers must share "
                              "the parallel sizes") from None
        dtype = _dtype(block.param_dtype or mcfg.dtype, f"{self.role}.megatron.param_dtype")
        self.dtype = dtype
        self.spec = model_spec(self.hf_config)
        overrides = _transformer_overrides(block, self.config, moe=self.spec.is_moe)
        tcfg = transformer_config_from_hf(self.hf_config, tp=tp, pp=pp, sequence_parallel=block.sequence_parallel,
                                          dtype=dtype, cp=cp, ep=ep, etp=etp, **overrides)
        # micro-batches differ in length (padding is trimmed per micro-batch): stages exchange shapes first
        tcfg.variable_seq_lengths = True
        if tcfg.pipeline_dtype is None:
            tcfg.pipeline_dtype = dtype
        value = self.model_type == "value"
        self.packed = bool(self.config.use_remove_padding)
        model = build_gpt_model(self.hf_config, value_head=value, tp=tp, pp=pp,
                                sequence_parallel=block.sequence_parallel, dtype=dtype, config=tcfg,
                                packed=self.packed)
        model = model.to(self.device)
        # the weights transformers initialises from this seed (what the fsdp engine starts from), or model.path's
        load_hf_weights(model, self._random_hf_state() if mcfg.random_init else mcfg.path, self.hf_config,
                        value_head=value)
        if value and not mcfg.random_init:
            self._load_saved_value_head(model, mcfg.path)
        self.tcfg = tcfg
        self.tp_group = mpu.get_tensor_model_parallel_group()
        self.cp_group = mpu.get_context_parallel_group()
        self.vocab_start = self.parallel.tp_rank * (self.hf_config.vocab_size // tp)
        if self.role in INFERENCE_ROLES:
            model.eval()
            for p in model.parameters():
                p.requires_grad_(False)
            self.model, self.inner = model, model
            return
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=block.grad_reduce_in_fp32 or dtype == torch.float32,
            use_distributed_optimizer=block.use_distributed_optimizer, overlap_grad_reduce=False)
        self.model = DistributedDataParallel(config=tcfg, ddp_config=ddp_config, module=model)
        self.inner = model

    def _load_saved_value_head(self, model: Any, path: str) -> None:
        """A value model from a decoder saved with another library's value head (TRL's ``v_head.summary``,
        OpenRLHF's ``<value_head_prefix>`` with its reward normalisation folded in): that head, not the ``score``
        layer the converter reads, on the last pipeline stage (``polyrl.models.reward_heads``)."""
        from polyrl.models.reward_heads import value_head_tensors

        head = value_head_tensors(path, self.hf_config)
        score = getattr(getattr(model, "output_layer", None), "score", None)
        if not head or score is None:  # no such head, or not the last stage
            return
        if score.bias is None and bool(head["bias"].abs().max() > 0):
            raise ConfigError(f"{self.role}.model.path={path}: the saved value head has a bias (or a reward "
                              "normalisation) and this model's value head has none (token_classification_bias=false)")
        with torch.no_grad():
            score.weight.copy_(head["weight"].to(score.weight.dtype))
            if score.bias is not None:
                score.bias.copy_(head["bias"].to(score.bias.dtype))

    def _random_hf_state(self) -> dict[str, torch.Tensor]:
        """The state dict of the HF model that ``from_config`` builds with the role's seed (value head zeroed)."""
        from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

        torch.manual_seed(self.config.seed)
        if self.model_type == "value":
            self.hf_config.num_labels = 1
            model = AutoModelForTokenClassification.from_config(self.hf_config, dtype=torch.float32)
            torch.nn.init.zeros_(model.score.weight)
            if getattr(model.score, "bias", None) is not None:
                torch.nn.init.zeros_(model.score.bias)
        else:
            model = AutoModelForCausalLM.from_config(self.hf_config, dtype=torch.float32)
        if self.spec.is_moe:  # transformers fuses experts in memory; the converter reads checkpoint names
            from transformers.core_model_loading import revert_weight_conversion

            return revert_weight_conversion(model, model.state_dict())
        return model.state_dict()

    def _build_optimizer(self) -> None:
        from megatron.core.distributed import finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        o = self.config.optim
        betas = tuple(o.betas)
        ocfg = OptimizerConfig(
            optimizer="adam", lr=o.lr, min_lr=0.0, weight_decay=o.weight_decay, adam_beta1=betas[0],
            adam_beta2=betas[1], adam_eps=o.eps, clip_grad=float(o.grad_clip or 0.0),
            bf16=self.dtype == torch.bfloat16, fp16=self.dtype == torch.float16, params_dtype=self.dtype,
            use_distributed_optimizer=self.megatron.use_distributed_optimizer,
        )
        # megatron's default parameter groups: biases and 1-D parameters (norm weights) get ``wd_mult=0``, as in
        # megatron-lm and verl's megatron workers. megatron's own scheduler turns wd_mult into each group's
        # weight decay; polyrl's LR schedule does not, so _set_weight_decay does (again after a resume).
        self.optimizer = get_megatron_optimizer(ocfg, [self.model])
        self.tcfg.no_sync_func = self.model.no_sync
        self.tcfg.finalize_model_grads_func = finalize_model_grads
        self.schedulers = [build_lr_scheduler(opt.optimizer, o, f"{self.role}.optim")
                           for opt in self._chained() if opt.optimizer is not None]
        self._set_weight_decay()

    def _chained(self) -> list[Any]:
        return list(getattr(self.optimizer, "chained_optimizers", None) or [self.optimizer])

    # ------------------------------------------------------------------ forward passes
    def _check_same_shard(self, batch: TensorDict) -> None:
        """Every rank of a model-parallel group (and of a context-parallel group) must hold the same rows, or the
        TP/CP/PP exchanges hang or mix rows."""
        from megatron.core import parallel_state as mpu

        p = self.parallel
        if p.tp * p.pp * p.cp == 1:
            return
        ids = batch["input_ids"].long()
        weights = torch.arange(1, ids.shape[1] + 1, dtype=torch.long)
        sig = torch.tensor([ids.shape[0], ids.shape[1], int((ids * weights).sum()), int(batch["attention_mask"].sum())],
                           dtype=torch.long)
        groups = [g for g, n in ((mpu.get_model_parallel_group(), p.tp * p.pp), (self.cp_group, p.cp)) if n > 1]
        for group in groups:
            lo, hi = sig.clone().to(self.device), sig.clone().to(self.device)
            dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=group)
            dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=group)
            if not torch.equal(lo, hi):
                raise RuntimeError(
                    f"{self.role} engine: the ranks of one data-parallel group got different batches; with "
                    f"tensor/context/pipeline parallelism (TP={p.tp}, CP={p.cp}, PP={p.pp}) every rank of a group "
                    "must get the same shard (dispatch by Engine.dp_rank, keep the results where collects_output)")

    @property
    def _chunked(self) -> bool:
        """The causal LM computes log-probs from the final hidden states in chunks (``logits_chunk_size`` > 0),
        except in a pass that asks for forward products: those read the full logits."""
        return (self.model_type != "value" and int(self.config.logits_chunk_size) > 0
                and not getattr(self, "_full_logits", False))

    def _outputs(self, output: torch.Tensor, mb: _MicroBatch, temperature: float,
                 compute_entropy: bool, products: ForwardProducts | None = None) -> dict[str, torch.Tensor]:
        """``log_probs`` (and ``entropy``) or ``values``, ``[b, width]``, from the last stage's output, and the
        forward ``products`` asked for (``[b, width]`` or ``[b, width, k]``).

        ``output``: the final hidden states ``[s, b, h]`` (chunked log-probs), logits ``[b, s, V / tp]``, or values
        ``[b, s, 1]``, for this rank's part of the sequence. With context parallelism each rank computes the tokens
        it predicts and a sum over the context-parallel group gives every rank all of them; its backward is the
        identity (every rank computes the same loss from the sum), so each rank's gradient flows through its own
        tokens and megatron's all-reduce over DP x CP adds the parts up.
        """
        if self.model_type == "value":
            flat = {"values": output[mb.pred_row, mb.pred_pos][..., 0].float()}
        elif self._chunked:
            flat = self._chunked_log_probs(output, mb, temperature, compute_entropy)
        else:
            from polyrl_engine_megatron.vocab_parallel import vocab_parallel_log_probs

            lp, ent = vocab_parallel_log_probs(output[mb.pred_row, mb.pred_pos], mb.targets,
                                               vocab_start=self.vocab_start, group=self.tp_group,
                                               temperature=temperature, compute_entropy=compute_entropy)
            flat = {"log_probs": lp} if ent is None else {"log_probs": lp, "entropy": ent}
        if products:  # a pass with products is never chunked (see _chunked)
            from polyrl_engine_megatron.vocab_parallel import vocab_parallel_products

            selected = output[mb.pred_row, mb.pred_pos]
            mine_rows, mine_cols = mb.rows[mb.mine].cpu(), mb.cols[mb.mine].cpu()
            gather = (mb.td[products.gather_ids][mine_rows, mine_cols].to(selected.device)
                      if products.gather_ids else None)
            flat.update(vocab_parallel_products(
                selected, vocab_start=self.vocab_start, group=self.tp_group, temperature=temperature,
                sum_pi_squared=products.sum_pi_squared, top_k=products.top_k, gather_ids=gather))
        if self.parallel.cp > 1:
            from polyrl_engine_megatron.vocab_parallel import sum_over_group

            # a rank may predict no token of a micro-batch: the anchor keeps its graph (and the backward) connected
            anchor = output.sum() * 0.0 if torch.is_grad_enabled() else 0.0
            flat = {k: sum_over_group(torch.zeros((len(mb.rows),) + tuple(v.shape[1:]), dtype=v.dtype,
                                                  device=v.device).index_put((mb.mine,), v)
                                      + (anchor if v.is_floating_point() else 0), self.cp_group)
                    for k, v in flat.items()}
        shape = (len(mb.td), mb.width)
        return {k: torch.zeros(shape + tuple(v.shape[1:]), dtype=v.dtype, device=v.device).index_put(
            (mb.rows, mb.cols), v) for k, v in flat.items()}

    def _check_products(self, products: ForwardProducts | None, batch: TensorDict) -> ForwardProducts | None:
        """``products`` if this engine computes them all (``None`` when none is asked for); raises otherwise."""
        if not products:
            return None
        if self.model_type == "value":
            raise ValueError(f"the {self.role} engine (a value model) computes no forward products")
        if products.gather_ids:
            require_fields(batch, [products.gather_ids], f"{self.role} engine forward products (gather_ids)")
        return products

    def _chunked_log_probs(self, hidden: torch.Tensor, mb: _MicroBatch, temperature: float,
                           compute_entropy: bool) -> dict[str, torch.Tensor]:
        """Log-probs (and entropy) of this rank's scored tokens from the final hidden states ``[s, b, h]``, through
        the vocabulary-parallel output layer ``logits_chunk_size`` tokens at a time. Each chunk's logits
        ``[chunk, V / tp]`` are recomputed in the backward pass (activation checkpointing), so no more than one
        chunk's exist at once; nothing is computed for positions that predict no response token."""
        from megatron.core.tensor_parallel import (
            copy_to_tensor_model_parallel_region,
            gather_from_sequence_parallel_region,
        )

        from polyrl_engine_megatron.vocab_parallel import vocab_parallel_log_probs

        if self.tcfg.sequence_parallel:  # each TP rank holds s / tp positions; the output layer needs all of them
            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=True)
        selected = hidden[mb.pred_pos, mb.pred_row]
        if not self.tcfg.sequence_parallel and self.parallel.tp > 1:
            # every TP rank uses the same states for its vocabulary slice: their gradients add up (megatron's
            # column-parallel output layer does the same)
            selected = copy_to_tensor_model_parallel_region(selected)
        weight = (self.inner.shared_embedding_or_output_weight() if self.inner.share_embeddings_and_output_weights
                  else self.inner.output_layer.weight)

        def chunk_fn(h: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            lp, ent = vocab_parallel_log_probs(torch.nn.functional.linear(h, w), y, vocab_start=self.vocab_start,
                                               group=self.tp_group, temperature=temperature,
                                               compute_entropy=compute_entropy)
            return lp, (ent if ent is not None else torch.zeros_like(lp))

        size = int(self.config.logits_chunk_size)
        parts = []
        for start in range(0, selected.shape[0], size):
            h, y = selected[start : start + size], mb.targets[start : start + size]
            if torch.is_grad_enabled():
                parts.append(torch.utils.checkpoint.checkpoint(chunk_fn, h, y, weight, use_reentrant=False))
            else:
                parts.append(chunk_fn(h, y, weight))
        if not parts:  # no scored token here: keep the graph connected (the output layer gets a zero gradient)
            zero = selected.sum(-1) * 0.0 + weight.sum() * 0.0
            parts.append((zero.float(), zero.float()))
        out = {"log_probs": torch.cat([p[0] for p in parts])}
        if compute_entropy:
            out["entropy"] = torch.cat([p[1] for p in parts])
        return out

    def _run(self, batch: TensorDict, on_output: Callable[[torch.Tensor, _MicroBatch], tuple[torch.Tensor, Any]],
             forward_only: bool) -> list[tuple[_MicroBatch, Any]]:
        """Run megatron's schedule over ``batch``'s micro-batches; ``on_output`` runs on the last stage."""
        from megatron.core.packed_seq_params import PackedSeqParams
        from megatron.core.pipeline_parallel import get_forward_backward_func

        p = self.parallel
        multiple = p.tp if self.megatron.sequence_parallel else 1
        device = self.device
        mbs = [_pack(batch[rows], multiple, cp=p.cp, cp_rank=p.cp_rank, packed=self.packed)
               for rows in _split(batch, self.config, p.cp)]
        for mb in mbs:  # the token indices meet the last stage's output on the device
            mb.rows, mb.cols, mb.mine, mb.pred_row, mb.pred_pos, mb.targets = (
                t.to(device) for t in (mb.rows, mb.cols, mb.mine, mb.pred_row, mb.pred_pos, mb.targets))
        results: list[tuple[_MicroBatch, Any]] = []
        hidden_only = self._chunked and p.is_last_stage
        offload = self.megatron.activation_offload and not forward_only

        def forward_step(data_iterator: Iterator[_MicroBatch], model: Any):
            mb = next(data_iterator)
            kwargs: dict[str, Any] = {}
            if mb.cu_seqlens is not None:
                cu = mb.cu_seqlens.to(device)
                kwargs["packed_seq_params"] = PackedSeqParams(
                    qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu,
                    cu_seqlens_kv_padded=cu, max_seqlen_q=mb.max_seqlen, max_seqlen_kv=mb.max_seqlen)
            if self.spec.is_moe:
                kwargs["padding_mask"] = self._padding_mask(mb.padding).to(device)
            # the last stage returns the final hidden states instead of logits over every position (GPTModel
            # skips its output layer when post_process is off); _chunked_log_probs applies it where it is needed
            if hidden_only:
                self.inner.post_process = False
            try:
                with torch.autograd.graph.save_on_cpu(pin_memory=device.type != "cpu") if offload else \
                        contextlib.nullcontext():
                    output = model(mb.input_ids.to(device), mb.position_ids.to(device), None, **kwargs)
            finally:
                self.inner.post_process = p.is_last_stage

            def reduce(output_tensor: torch.Tensor):
                loss, extra = on_output(output_tensor, mb)
                results.append((mb, extra))
                return loss, {}

            return output, reduce

        get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(mbs), model=[self.model], num_microbatches=len(mbs),
            seq_length=max(mb.input_ids.shape[1] for mb in mbs), micro_batch_size=max(mb.input_ids.shape[0] for mb in mbs),
            forward_only=forward_only)
        return results

    def _padding_mask(self, padding: torch.Tensor) -> torch.Tensor:
        """The MoE router's padding mask for this stage: GPTModel splits it for sequence parallelism on the first
        stage only, so later stages take their tensor-parallel slice of the sequence themselves."""
        if self.parallel.is_first_stage or not self.tcfg.sequence_parallel:
            return padding
        return padding.chunk(self.parallel.tp, dim=1)[self.parallel.tp_rank]

    def _from_last_stage(self, obj: Any) -> Any:
        """``obj`` as the last pipeline stage has it, on every stage (a small object: results or metrics)."""
        from megatron.core import parallel_state as mpu

        if self.parallel.pp == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=mpu.get_pipeline_model_parallel_last_rank(),
                                   group=mpu.get_pipeline_model_parallel_group())
        return box[0]

    @torch.no_grad()
    def infer_batch(self, batch: TensorDict, *, temperature: float = 1.0, compute_entropy: bool = False,
                    disable_adapter: bool = False, products: ForwardProducts | None = None) -> TensorDict:
        """Log-probs (and entropy) of the response tokens, or values for a value model; ``[B, R]``, zero where
        ``response_mask`` is 0, and the forward ``products`` asked for (:class:`~polyrl.protocols.ForwardProducts`,
        ``[B, R]`` or ``[B, R, k]``). Every rank returns the same result (the last stage's, broadcast)."""
        require_fields(batch, _NEEDED, f"{self.role} engine infer_batch")
        products = self._check_products(products, batch)
        self._full_logits = products is not None
        self._check_same_shard(batch)
        self.model.eval()
        size, width = batch.batch_size[0], batch["responses"].shape[1]
        keys = ["values"] if self.model_type == "value" else ["log_probs"] + (["entropy"] if compute_entropy else [])
        keys += list(products.output_keys()) if products else []
        splits = _split(batch, self.config, self.parallel.cp)

        def on_output(output: torch.Tensor, mb: _MicroBatch):
            out = self._outputs(output, mb, temperature, compute_entropy, products)
            return torch.zeros((), device=output.device), {
                k: v.cpu() if k == "top_k_ids" else v.float().cpu() for k, v in out.items()}

        found = self._run(batch, on_output, forward_only=True)
        parts = self._from_last_stage([extra for _, extra in found] if self.parallel.is_last_stage else None)
        result: dict[str, torch.Tensor] = {}
        for rows, part in zip(splits, parts):
            for k in keys:
                if k not in result:
                    result[k] = torch.zeros((size, width, *part[k].shape[2:]), dtype=part[k].dtype)
                result[k][rows, : part[k].shape[1]] = part[k]
        mask = batch["response_mask"]
        return TensorDict({k: v * mask.view(*mask.shape, *([1] * (v.dim() - 2))).to(v.dtype) for k, v in result.items()},
                          batch_size=batch.batch_size)

    def train_batch(self, batch: TensorDict, loss_fn: Any, *, temperature: float = 1.0,
                    products: ForwardProducts | None = None) -> dict[str, float]:
        """One optimizer step on this data-parallel group's shard (see :meth:`polyrl.protocols.Engine.train_batch`).

        ``loss_fn`` runs on the last pipeline stage per micro-batch with global counts in :class:`LossScale`
        (summed over the data-parallel group only: tensor/pipeline ranks hold copies of the same rows); the
        forward ``products`` asked for reach it in its ``model_output``.
        """
        from megatron.core import parallel_state as mpu
        from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

        require_fields(batch, _NEEDED, f"{self.role} engine train_batch")
        products = self._check_products(products, batch)
        self._full_logits = products is not None
        if self.optimizer is None:
            raise RuntimeError(f"the {self.role} engine has no optimizer (role 'ref' only infers)")
        self._check_same_shard(batch)
        self.model.train()
        totals = torch.tensor([float(batch["response_mask"].sum()), float(batch.batch_size[0])],
                              dtype=torch.float64, device=self.device)
        dist.all_reduce(totals, group=mpu.get_data_parallel_group())
        scale = LossScale(dp_size=self.dp_size, batch_num_tokens=int(totals[0]), global_batch_size=int(totals[1]))
        count = len(_split(batch, self.config, self.parallel.cp))
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()

        def on_output(output: torch.Tensor, mb: _MicroBatch):
            out = self._outputs(output, mb, temperature, compute_entropy=self.model_type != "value", products=products)
            loss, metrics = loss_fn(out, mb.td.to(output.device), scale)
            # megatron divides each micro-batch's loss by their count; polyrl's losses are already normalised
            return loss * count, {k: float(v) for k, v in metrics.items()}

        found = self._run(batch, on_output, forward_only=False)
        per_mb = self._from_last_stage([extra for _, extra in found] if self.parallel.is_last_stage else None)
        metrics: dict[str, float] = {}
        for m in per_mb:
            for k, v in m.items():
                metrics[k] = metrics.get(k, 0.0) + v / max(1, len(per_mb))
        if self.spec.is_moe:
            metrics.update(self._router_metrics(len(per_mb)))
        found_inf = self.optimizer.prepare_grads()
        grad_norm = self.optimizer.get_grad_norm()
        grad_norm = float(grad_norm) if grad_norm is not None else float("nan")
        if math.isfinite(grad_norm) and not found_inf:
            clip = float(self.config.optim.grad_clip or 0.0)
            if clip > 0:
                for opt in self._chained():
                    params = opt.get_parameters()
                    if params:
                        clip_grad_by_total_norm_fp32(params, clip, grad_norm)
            self.optimizer.step_with_ready_grads()
        else:
            metrics["skipped_step"] = 1.0
        lr = self.schedulers[0].get_last_lr()[0] if self.schedulers else self.config.optim.lr
        for scheduler in self.schedulers:
            scheduler.step()
        self.step += 1
        prefix = "critic" if self.model_type == "value" else "actor"
        metrics[f"{prefix}/grad_norm"] = grad_norm
        metrics[f"{prefix}/lr"] = float(lr)
        return metrics

    def _router_metrics(self, num_microbatches: int) -> dict[str, float]:
        """The routers' load-balancing (and z-) losses of this step, mean over layers and micro-batches, the same
        on every rank (megatron records them per layer as it runs; collective over the role's ranks)."""
        from megatron.core import parallel_state as mpu
        from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

        prefix = "critic" if self.model_type == "value" else "actor"
        out: dict[str, float] = {}
        tracker = get_moe_layer_wise_logging_tracker()
        for name in sorted(tracker):
            values = tracker[name]["values"]
            dist.all_reduce(values, group=mpu.get_pipeline_model_parallel_group())  # layers of every stage
            if tracker[name].get("reduce_group") is not None:  # partial sums over TP x CP
                dist.all_reduce(values, group=tracker[name]["reduce_group"])
            dist.all_reduce(values, group=mpu.get_data_parallel_group())
            out[f"{prefix}/moe_{name}"] = float(values.sum()) / (self.spec.num_layers * num_microbatches * self.dp_size)
        tracker.clear()  # megatron re-creates an entry when a router records a loss again
        return out

    # ------------------------------------------------------------------ weights
    def weights_for_rollout(self, bucket_bytes: int = 512 << 20) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """``(hf_name, full tensor)`` lists of about ``bucket_bytes``, gathered over TP and PP one tensor at a time.

        Collective over the model-parallel group: every rank iterates and gets every tensor.
        """
        from polyrl_engine_megatron.convert import iter_hf_weights

        yield from iter_hf_weights(self.inner, self.hf_config, value_head=self.model_type == "value",
                                   bucket_bytes=bucket_bytes)

    def export_hf(self, path: str) -> None:
        """The folder ``save_pretrained`` writes, at ``path``: config, generation config, safetensors (sharded with an
        index above ``megatron.export_max_shard_size``) and the tokenizer of ``model.tokenizer_path`` / ``model.path``.

        Collective: every rank gathers the weights, global rank 0 writes.
        """
        out = Path(path)
        rank = dist.get_rank()
        tensors: dict[str, torch.Tensor] = {}
        for bucket in self.weights_for_rollout():
            if rank == 0:
                tensors.update({n: t.detach().cpu().contiguous() for n, t in bucket})
        if rank == 0:
            out.mkdir(parents=True, exist_ok=True)
            self._meta_model().save_pretrained(out, state_dict=tensors, max_shard_size=self.megatron.export_max_shard_size)
            self._save_tokenizer(out)
        dist.barrier()

    def _meta_model(self) -> Any:
        from polyrl.models.export import meta_hf_model

        value = self.model_type == "value"
        if value:
            self.hf_config.num_labels = 1
        model = meta_hf_model(self.hf_config, self.config.model, value=value)
        self.hf_config.architectures = [type(model).__name__]
        return model

    def _save_tokenizer(self, out: Path) -> None:
        from polyrl.models.export import save_tokenizer

        save_tokenizer(self.config.model, self.role, out)

    # ------------------------------------------------------------------ checkpoints
    def _fingerprint(self) -> str:
        """The model, independent of the layout: HF names and full shapes."""
        from polyrl_engine_megatron.convert import hf_param_shapes

        shapes = hf_param_shapes(self.hf_config, value_head=self.model_type == "value")
        return ";".join(f"{n}:{tuple(s)}" for n, s in shapes.items())

    def _sharded_state(self, is_loading: bool) -> dict[str, Any]:
        state: dict[str, Any] = {"model": self.inner.sharded_state_dict()}
        if self.optimizer is not None:
            state["optimizer"] = self.optimizer.sharded_state_dict(
                state, is_loading=is_loading, metadata={"distrib_optim_sharding_type": "fully_sharded_model_space"})
        return state

    def save_checkpoint(self, path: str) -> None:
        """Model and optimizer (megatron ``dist_checkpointing``, one global tensor per parameter), LR schedule, RNG
        and step into the directory ``path``, atomically.

        Every rank writes into a temporary folder that :func:`polyrl.checkpoint_io.atomic_checkpoint_dir` renames
        into place once all ranks finished and the file manifest is written, so a crash or a full disk mid-save
        leaves the previous checkpoint whole. The tensors are stored by their global shape, so the checkpoint
        loads into another TP/PP/DP layout of the same model.
        """
        from megatron.core import dist_checkpointing, tensor_parallel

        from polyrl_engine_megatron.checkpoint_strategies import sync_save_strategy

        rank = dist.get_rank()
        with atomic_checkpoint_dir(path) as tmp:
            dist_checkpointing.save(self._sharded_state(is_loading=False), str(tmp), sharded_strategy=sync_save_strategy())
            extras = {"rng": {"torch": torch.get_rng_state(), "python": random.getstate(),
                              "device": self.platform.rng_state(), "device_type": self.platform.device_type,
                              "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()},
                      "schedulers": [s.state_dict() for s in self.schedulers]}
            torch.save(extras, tmp / f"extra_rank{rank}.pt")
            if rank == 0:
                p = self.parallel
                meta = {"format": CHECKPOINT_FORMAT, "step": self.step, "role": self.role,
                        "model_type": self.model_type, "world_size": dist.get_world_size(),
                        "tensor_model_parallel_size": p.tp, "pipeline_model_parallel_size": p.pp,
                        "data_parallel_size": p.dp, "use_distributed_optimizer": self.megatron.use_distributed_optimizer,
                        "has_optimizer": self.optimizer is not None, "fingerprint": self._fingerprint()}
                (tmp / "meta.json").write_text(json.dumps(meta, indent=1))

    def load_checkpoint(self, path: str) -> None:
        """Restore what :meth:`save_checkpoint` wrote, into this engine's layout (which may differ from the saved one).

        Raises :class:`CheckpointError` (a ``ValueError``) for a folder that is not such a checkpoint, a checkpoint
        of another model, or one without optimizer state for a training role. RNG state is restored when the world
        size is the one that saved it.
        """
        from megatron.core import dist_checkpointing, tensor_parallel

        from polyrl_engine_megatron.checkpoint_strategies import safe_load_strategies

        folder = Path(path)
        meta_file = folder / "meta.json"
        if not meta_file.exists():
            raise CheckpointError(f"{folder} is not a megatron engine checkpoint (no meta.json)")
        meta = load_json(meta_file)
        if meta.get("format") != CHECKPOINT_FORMAT:
            raise CheckpointError(f"{folder} was written by another engine (format {meta.get('format')!r}, expected "
                                  f"{CHECKPOINT_FORMAT!r}); load it with the engine that wrote it, or export it to HF "
                                  f"and set {self.role}.model.path to the export")
        if meta["fingerprint"] != self._fingerprint():
            raise CheckpointError(f"checkpoint {folder} holds a different model (parameter names/shapes differ from "
                                  f"{self.role}.model.path={self.config.model.path})")
        if self.optimizer is not None and not meta.get("has_optimizer", True):
            raise CheckpointError(f"checkpoint {folder} has no optimizer state (written by a {meta['role']!r} role); "
                                  f"the {self.role} role needs one")
        if self.optimizer is not None and meta.get("use_distributed_optimizer") != self.megatron.use_distributed_optimizer:
            raise CheckpointError(f"checkpoint {folder} was written with megatron.use_distributed_optimizer="
                                  f"{meta.get('use_distributed_optimizer')}; {self.role}.megatron.use_distributed_optimizer"
                                  f" is {self.megatron.use_distributed_optimizer}. Resume with the same setting")
        sharded = _without_extra_state(self._sharded_state(is_loading=True))
        # megatron-core's default strategies unpickle the metadata, common.pt and sharded objects unrestricted
        sharded_strategy, common_strategy = safe_load_strategies()
        state = dist_checkpointing.load(sharded, str(folder), sharded_strategy=sharded_strategy,
                                        common_strategy=common_strategy)
        self.inner.load_state_dict(state["model"], strict=False)
        if self.optimizer is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        extra_file = folder / f"extra_rank{dist.get_rank()}.pt"
        extras = load_tensors(extra_file) if extra_file.exists() else None
        if extras is not None:
            for scheduler, saved in zip(self.schedulers, extras["schedulers"]):
                scheduler.load_state_dict(saved)
            self._apply_optim_config()
        if extras is not None and meta["world_size"] == dist.get_world_size():
            rng = extras["rng"]
            torch.set_rng_state(rng["torch"])
            random.setstate(rng["python"])
            if rng.get("device_type") == self.platform.device_type:
                self.platform.set_rng_state(rng["device"])
            tensor_parallel.get_cuda_rng_tracker().set_states(rng["tracker"])
        else:
            logger.warning("checkpoint %s was written by %s ranks, this %s group has %s: RNG state starts from the "
                           "seed", folder, meta["world_size"], self.role, dist.get_world_size())
        self.step = meta["step"]

    def _apply_optim_config(self) -> None:
        """Make the configured LR and weight decay rule over the restored optimizer and schedule."""
        o = self.config.optim
        for opt, scheduler in zip((c.optimizer for c in self._chained() if c.optimizer is not None), self.schedulers):
            for i, group in enumerate(opt.param_groups):
                old_base = group.get("initial_lr") or scheduler.base_lrs[i]
                if old_base:
                    group["lr"] = group["lr"] * o.lr / old_base
                group["initial_lr"] = o.lr
            scheduler.base_lrs = [o.lr for _ in scheduler.base_lrs]
            scheduler._last_lr = [g["lr"] for g in opt.param_groups]
        self._set_weight_decay()

    def _set_weight_decay(self) -> None:
        """``optim.weight_decay`` times each parameter group's ``wd_mult`` (0 for biases and norm weights)."""
        wd = float(self.config.optim.weight_decay)
        for chained in self._chained():
            for group in (chained.optimizer.param_groups if chained.optimizer is not None else []):
                group["weight_decay"] = wd * float(group.get("wd_mult", 1.0))

    # ------------------------------------------------------------------ memory
    def offload(self) -> None:
        """Parameters, gradient buffers and optimizer state to CPU, to make room for a colocated rollout.

        A no-op on the ``cpu`` platform.
        """
        if self.device.type == "cpu":
            return
        self._move("cpu")
        self.platform.empty_cache()

    def onload(self) -> None:
        """Undo :meth:`offload`."""
        if self.device.type == "cpu":
            return
        self._move(self.device)

    def _move(self, device: Any) -> None:
        # megatron's DDP keeps gradients (and, with the distributed optimizer, parameters) as views into flat
        # buffers: move each buffer's storage and re-point every view, instead of module.to()
        buffers = [b for b in getattr(self.model, "buffers", []) or []] + list(
            getattr(self.model, "expert_parallel_buffers", []) or [])
        moved: dict[int, torch.Tensor] = {}
        for buf in buffers:
            for attr in ("param_data", "grad_data"):
                data = getattr(buf, attr, None)
                if data is not None:
                    new = data.to(device, non_blocking=True)
                    moved[id(data)] = new
                    setattr(buf, attr, new)
            for param in buf.params:
                start, end, _ = buf.param_index_map[param]
                if getattr(buf, "param_data", None) is not None:
                    param.data = buf.param_data[start:end].view(param.shape)
                else:
                    param.data = param.data.to(device, non_blocking=True)
                if getattr(buf, "grad_data", None) is not None:
                    param.main_grad = buf.grad_data[start:end].view(param.shape)
        for param in self.inner.parameters():
            if param.device != torch.device(device) and param.device.type != torch.device(device).type:
                param.data = param.data.to(device, non_blocking=True)
        for opt in self._chained() if self.optimizer is not None else []:
            inner = getattr(opt, "optimizer", None)
            for state in (inner.state.values() if inner is not None else []):
                for k, v in state.items():
                    if isinstance(v, torch.Tensor):
                        state[k] = v.to(device, non_blocking=True)
        self.platform.synchronize()


def _without_extra_state(sharded: dict[str, Any]) -> dict[str, Any]:
    """The model's sharded state without ``_extra_state`` entries (Transformer Engine's FP8 metadata, which TE
    unpickles in ``set_extra_state``): polyrl trains without FP8 state, so nothing of it is read back."""
    model = sharded.get("model")
    if isinstance(model, dict):
        sharded["model"] = {k: v for k, v in model.items() if not k.endswith("_extra_state")}
    return sharded
