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
from polyrl.protocols import LossScale
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


def _check_role_config(config: Any, role: str, world_size: int) -> tuple[Any, MegatronConfig, int]:
    """Everything about a role's config that can be wrong, checked without a process group.

    Returns ``(hf_config, megatron block, data-parallel size)``; raises :class:`ConfigError` naming the key.
    """
    from polyrl_engine_megatron.cpu_emulation import check_megatron_core
    from polyrl_engine_megatron.model import validate_layout

    check_megatron_core()
    block = _megatron_block(config)
    if config.model.lora.rank > 0:
        raise ConfigError(f"{role}.model.lora.rank={config.model.lora.rank}: engine 'megatron' has no LoRA "
                          "(megatron-core has no adapter layers for the local model spec). Set "
                          f"{role}.model.lora.rank=0, or use {role}.engine=fsdp for LoRA")
    for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size"):
        if getattr(block, key) < 1:
            raise ConfigError(f"{role}.megatron.{key}={getattr(block, key)} must be at least 1")
    _dtype(config.model.dtype, f"{role}.model.dtype")
    if block.param_dtype is not None:
        _dtype(block.param_dtype, f"{role}.megatron.param_dtype")
    hf_config = _hf_config(config, role)
    dp = validate_layout(hf_config, tp=block.tensor_model_parallel_size, pp=block.pipeline_model_parallel_size,
                         world_size=world_size, key=f"{role}.megatron", sequence_parallel=block.sequence_parallel,
                         lora=False)
    return hf_config, block, dp


# ---------------------------------------------------------------------------- micro-batches


@dataclass
class _MicroBatch:
    """One micro-batch as the model sees it: rows packed to the left, and where each response token is."""

    td: TensorDict  # the rows, response-width fields trimmed to ``width`` (what the loss closure gets)
    input_ids: torch.Tensor  # [b, S] packed to the left, padded with 0 on the right
    position_ids: torch.Tensor  # [b, S]
    rows: torch.Tensor  # [N] row of each scored response token
    cols: torch.Tensor  # [N] its column in the response
    pred: torch.Tensor  # [N] the packed position whose output predicts it
    targets: torch.Tensor  # [N] the token id
    width: int  # response columns kept


def _pack(td: TensorDict, multiple: int) -> _MicroBatch:
    """Pack ``td``'s rows to the left and index the response tokens (see :class:`_MicroBatch`).

    Response token ``t`` of a row is scored when it and the token before it are real (attention 1); its
    prediction comes from the packed position of the token before it. ``multiple`` rounds the packed length
    up (sequence parallelism splits the sequence over the tensor-parallel ranks).
    """
    ids, attn = td["input_ids"], td["attention_mask"].bool()
    b, s = ids.shape
    r = td["responses"].shape[1]
    place = attn.long().cumsum(-1) - 1  # packed position of each real token
    length = max(1, int(attn.sum(-1).max()))
    length = -(-length // multiple) * multiple
    packed = torch.zeros(b, length, dtype=ids.dtype)
    real_rows, real_cols = attn.nonzero(as_tuple=True)
    packed[real_rows, place[real_rows, real_cols]] = ids[real_rows, real_cols]
    prev = torch.cat([torch.zeros(b, 1, dtype=torch.bool), attn[:, :-1]], dim=1)
    rows, cols = (attn[:, s - r :] & prev[:, s - r :]).nonzero(as_tuple=True)
    width = max(1, int(attn[:, s - r :].sum(-1).max()))
    out = td.clone(False)
    for key in list(td.keys()):
        value = td.get(key)
        if (isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] == r
                and key not in ("input_ids", "attention_mask", "position_ids")):
            out[key] = value[:, :width]
    return _MicroBatch(td=out, input_ids=packed, position_ids=torch.arange(length).expand(b, length).contiguous(),
                       rows=rows, cols=cols, pred=place[rows, s - r + cols] - 1, targets=td["responses"][rows, cols],
                       width=width)


def _split(batch: TensorDict, config: Any) -> list[torch.Tensor]:
    """Row indices of each micro-batch: ``micro_batch_size`` rows, or by token budget with ``use_dynamic_bsz``.

    Deterministic in the batch alone, so every rank of a data-parallel group (which got the same shard)
    runs the same micro-batches, as megatron's tensor- and pipeline-parallel exchanges need.
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
            if max(lengths[j] for j in g + [i]) * (len(g) + 1) <= config.max_token_len_per_gpu:
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
        if role != "ref":
            self._build_optimizer()

    # ------------------------------------------------------------------ layout
    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel index (batches are split by it)."""
        return self.parallel.dp_rank

    @property
    def dp_size(self) -> int:
        """Data-parallel size: world size / (TP x PP)."""
        return self.parallel.dp

    @property
    def collects_output(self) -> bool:
        """True on tensor-parallel rank 0 of the last pipeline stage: the one rank per DP group whose results count."""
        return self.parallel.collects_output

    # ------------------------------------------------------------------ construction
    def _build_model(self) -> None:
        from megatron.core import parallel_state as mpu
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        from polyrl_engine_megatron.convert import hf_to_megatron_state_dict, load_hf_weights
        from polyrl_engine_megatron.model import build_gpt_model, transformer_config_from_hf
        from polyrl_engine_megatron.parallel import init_parallel_state

        block, mcfg = self.megatron, self.config.model
        tp, pp = block.tensor_model_parallel_size, block.pipeline_model_parallel_size
        try:
            self.parallel = init_parallel_state(tp, pp, seed=self.config.seed,
                                                cpu=self.platform.device_type == "cpu", key=f"{self.role}.megatron")
        except RuntimeError as exc:  # another role of this process set up a different layout
            raise ConfigError(f"{self.role}.megatron: TP={tp}, PP={pp} differs from the layout another role in this "
                              f"worker already uses ({exc}); roles sharing workers must share "
                              "tensor_model_parallel_size and pipeline_model_parallel_size") from None
        dtype = _dtype(block.param_dtype or mcfg.dtype, f"{self.role}.megatron.param_dtype")
        self.dtype = dtype
        overrides: dict[str, Any] = {}
        if mcfg.gradient_checkpointing:
            overrides.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
        tcfg = transformer_config_from_hf(self.hf_config, tp=tp, pp=pp, sequence_parallel=block.sequence_parallel,
                                          dtype=dtype, **overrides)
        # micro-batches differ in length (padding is trimmed per micro-batch): stages exchange shapes first
        tcfg.variable_seq_lengths = True
        if tcfg.pipeline_dtype is None:
            tcfg.pipeline_dtype = dtype
        value = self.model_type == "value"
        model = build_gpt_model(self.hf_config, value_head=value, tp=tp, pp=pp,
                                sequence_parallel=block.sequence_parallel, dtype=dtype, config=tcfg)
        model = model.to(self.device)
        if mcfg.random_init:
            # the weights transformers initialises from this seed (what the fsdp engine starts from)
            model.load_state_dict(hf_to_megatron_state_dict(self._random_hf_state(), self.hf_config,
                                                            tp_rank=self.parallel.tp_rank, tp=tp,
                                                            pp_rank=self.parallel.pp_rank, pp=pp, value_head=value),
                                  strict=False)
        else:
            load_hf_weights(model, mcfg.path, self.hf_config, value_head=value)
        self.tcfg = tcfg
        self.tp_group = mpu.get_tensor_model_parallel_group()
        self.vocab_start = self.parallel.tp_rank * (self.hf_config.vocab_size // tp)
        if self.role == "ref":
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
        """Every rank of a model-parallel group must hold the same rows, or the TP/PP exchanges hang or mix rows."""
        from megatron.core import parallel_state as mpu

        if self.parallel.tp * self.parallel.pp == 1:
            return
        ids = batch["input_ids"].long()
        weights = torch.arange(1, ids.shape[1] + 1, dtype=torch.long)
        sig = torch.tensor([ids.shape[0], ids.shape[1], int((ids * weights).sum()), int(batch["attention_mask"].sum())],
                           dtype=torch.long)
        lo, hi = sig.clone().to(self.device), sig.clone().to(self.device)
        group = mpu.get_model_parallel_group()
        dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=group)
        dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=group)
        if not torch.equal(lo, hi):
            raise RuntimeError(
                f"{self.role} engine: the ranks of one data-parallel group got different batches; with "
                f"tensor/pipeline parallelism (TP={self.parallel.tp}, PP={self.parallel.pp}) every rank of a group "
                "must get the same shard (dispatch by Engine.dp_rank, keep the results where collects_output)")

    def _outputs(self, output: torch.Tensor, mb: _MicroBatch, temperature: float,
                 compute_entropy: bool) -> dict[str, torch.Tensor]:
        """``log_probs`` (and ``entropy``) or ``values``, ``[b, width]``, from the last stage's output."""
        selected = output[mb.rows, mb.pred]
        shape = (mb.input_ids.shape[0], mb.width)
        if self.model_type == "value":
            flat = {"values": selected[..., 0].float()}
        else:
            from polyrl_engine_megatron.vocab_parallel import vocab_parallel_log_probs

            lp, ent = vocab_parallel_log_probs(selected, mb.targets, vocab_start=self.vocab_start,
                                               group=self.tp_group, temperature=temperature,
                                               compute_entropy=compute_entropy)
            flat = {"log_probs": lp} if ent is None else {"log_probs": lp, "entropy": ent}
        return {k: torch.zeros(shape, dtype=v.dtype, device=v.device).index_put((mb.rows, mb.cols), v)
                for k, v in flat.items()}

    def _run(self, batch: TensorDict, on_output: Callable[[torch.Tensor, _MicroBatch], tuple[torch.Tensor, Any]],
             forward_only: bool) -> list[tuple[_MicroBatch, Any]]:
        """Run megatron's schedule over ``batch``'s micro-batches; ``on_output`` runs on the last stage."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        multiple = self.parallel.tp if self.megatron.sequence_parallel else 1
        device = self.device
        mbs = [_pack(batch[rows], multiple) for rows in _split(batch, self.config)]
        for mb in mbs:  # the token indices meet the last stage's output on the device
            mb.rows, mb.cols, mb.pred, mb.targets = (t.to(device) for t in (mb.rows, mb.cols, mb.pred, mb.targets))
        results: list[tuple[_MicroBatch, Any]] = []

        def forward_step(data_iterator: Iterator[_MicroBatch], model: Any):
            mb = next(data_iterator)
            output = model(mb.input_ids.to(device), mb.position_ids.to(device), None)

            def reduce(output_tensor: torch.Tensor):
                loss, extra = on_output(output_tensor, mb)
                results.append((mb, extra))
                return loss, {}

            return output, reduce

        get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(mbs), model=[self.model], num_microbatches=len(mbs),
            seq_length=max(mb.input_ids.shape[1] for mb in mbs), micro_batch_size=max(len(mb.td) for mb in mbs),
            forward_only=forward_only)
        return results

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
                    disable_adapter: bool = False) -> TensorDict:
        """Log-probs (and entropy) of the response tokens, or values for a value model; ``[B, R]``, zero where
        ``response_mask`` is 0. Every rank returns the same result (the last stage's, broadcast)."""
        require_fields(batch, _NEEDED, f"{self.role} engine infer_batch")
        self._check_same_shard(batch)
        self.model.eval()
        size, width = batch.batch_size[0], batch["responses"].shape[1]
        keys = ["values"] if self.model_type == "value" else ["log_probs"] + (["entropy"] if compute_entropy else [])
        result = {k: torch.zeros(size, width, dtype=torch.float32) for k in keys}
        splits = _split(batch, self.config)

        def on_output(output: torch.Tensor, mb: _MicroBatch):
            out = self._outputs(output, mb, temperature, compute_entropy)
            return torch.zeros((), device=output.device), {k: v.float().cpu() for k, v in out.items()}

        found = self._run(batch, on_output, forward_only=True)
        parts = self._from_last_stage([extra for _, extra in found] if self.parallel.is_last_stage else None)
        for rows, part in zip(splits, parts):
            for k in keys:
                result[k][rows, : part[k].shape[1]] = part[k]
        mask = batch["response_mask"].float()
        return TensorDict({k: v * mask for k, v in result.items()}, batch_size=batch.batch_size)

    def train_batch(self, batch: TensorDict, loss_fn: Any, *, temperature: float = 1.0) -> dict[str, float]:
        """One optimizer step on this data-parallel group's shard (see :meth:`polyrl.protocols.Engine.train_batch`).

        ``loss_fn`` runs on the last pipeline stage per micro-batch with global counts in :class:`LossScale`
        (summed over the data-parallel group only: tensor/pipeline ranks hold copies of the same rows).
        """
        from megatron.core import parallel_state as mpu
        from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

        require_fields(batch, _NEEDED, f"{self.role} engine train_batch")
        if self.optimizer is None:
            raise RuntimeError(f"the {self.role} engine has no optimizer (role 'ref' only infers)")
        self._check_same_shard(batch)
        self.model.train()
        totals = torch.tensor([float(batch["response_mask"].sum()), float(batch.batch_size[0])],
                              dtype=torch.float64, device=self.device)
        dist.all_reduce(totals, group=mpu.get_data_parallel_group())
        scale = LossScale(dp_size=self.dp_size, batch_num_tokens=int(totals[0]), global_batch_size=int(totals[1]))
        count = len(_split(batch, self.config))
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()

        def on_output(output: torch.Tensor, mb: _MicroBatch):
            out = self._outputs(output, mb, temperature, compute_entropy=self.model_type != "value")
            loss, metrics = loss_fn(out, mb.td.to(output.device), scale)
            # megatron divides each micro-batch's loss by their count; polyrl's losses are already normalised
            return loss * count, {k: float(v) for k, v in metrics.items()}

        found = self._run(batch, on_output, forward_only=False)
        per_mb = self._from_last_stage([extra for _, extra in found] if self.parallel.is_last_stage else None)
        metrics: dict[str, float] = {}
        for m in per_mb:
            for k, v in m.items():
                metrics[k] = metrics.get(k, 0.0) + v / max(1, len(per_mb))
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
