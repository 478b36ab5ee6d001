"""The FSDP2 engine: :class:`polyrl.protocols.Engine` over transformers models.

Each decoder layer and the whole model are ``fully_shard``-ed over a 1-D device
mesh (pure data parallelism), or a 2-D (replicate, shard) mesh for HSDP. When each
copy of the model lives on one rank (one rank, or ``fsdp.fsdp_size=1``), the model
stays a plain module and gradients are all-reduced (DDP-like). The model sits inside :class:`_Head`, a root module
whose forward runs the backbone and then the LM head on the response positions
only, in chunks, so ``[tokens x vocab]`` logits never exist whole.

A subclass that trains another kind of model (polyrl-diffusion's ``diffusers`` engine) reuses the sharding,
optimizer, micro-batching, checkpoints and weight buckets, and overrides the public extension points of
:class:`FSDPEngine`: :meth:`~FSDPEngine.check_options`, :meth:`~FSDPEngine.load_model`,
:meth:`~FSDPEngine.apply_lora`, :meth:`~FSDPEngine.wrap_model`, :meth:`~FSDPEngine.forward_micro_batch`
(and may call :meth:`~FSDPEngine.split_micro_batches`, :meth:`~FSDPEngine.padding_micro_batch`,
:meth:`~FSDPEngine.full_parameters`, :func:`full_tensor`); see docs/plugins/extension_points.md.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import random
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tensordict import TensorDict
from torch import nn

from polyrl.batch import require_fields
from polyrl.checkpoint_io import atomic_checkpoint_dir, load_dcp, load_json, load_tensors
from polyrl.distributed import ensure_process_group
from polyrl.errors import CheckpointError, ConfigError
from polyrl.lr_schedules import build_lr_scheduler
from polyrl.models.paths import check_model_path
from polyrl.platforms.precision import warn_if_slow_dtype
from polyrl.protocols import INFERENCE_ROLES, ForwardProducts, LossScale
from polyrl_engine_fsdp.activation_offload import offload_activations
from polyrl_engine_fsdp.config import FSDPConfig, check_choice, torch_dtype
from polyrl_engine_fsdp.grad_reduce import GradReducer
from polyrl_engine_fsdp.multimodal import embed_with_images
from polyrl_engine_fsdp.ulysses import SequenceParallel, check_sequence_parallel

logger = logging.getLogger(__name__)

_NEEDED = ("input_ids", "attention_mask", "position_ids", "responses", "response_mask")
#: transformers attention implementations that build per-sequence masks from restarting position_ids
_PACKED_ATTENTION = {"sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention"}
#: flash attention's varlen keyword arguments (transformers' ``FlashAttentionKwargs``), for sequence parallelism
_VARLEN_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


# ---------------------------------------------------------------------------- the root module


class _Head(nn.Module):
    """Backbone + chunked LM head (log-probs / entropy) or value head, on the predicting positions only.

    ``index`` picks, from the flattened ``[tokens, hidden]`` states, the position that predicts each
    response token (position ``P - 1 + t`` for response token ``t``); ``targets`` are those tokens.
    Outputs are flat ``[N]`` tensors, one entry per selected token.
    """

    def __init__(self, model: nn.Module, model_type: str, chunk: int) -> None:
        super().__init__()
        self.model = model
        self.model_type = model_type
        self.chunk = chunk

    def _parts(self) -> tuple[nn.Module, nn.Module]:
        inner = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        head = inner.score if self.model_type == "value" else inner.get_output_embeddings()
        return inner.base_model, head

    def forward(self, input_ids, attention_mask, position_ids, index, targets, temperature: float = 1.0,
                compute_entropy: bool = False, prompt_ids=None, prompt_mask=None, prompt_positions=None,
                prompt_of_row=None, products: ForwardProducts | None = None, gather=None, images=None,
                image_mask=None, sp_gather=None, **attention_kwargs) -> dict[str, torch.Tensor]:
        """Flat ``log_probs`` (and ``entropy``) or ``values`` of the tokens ``index`` selects, and the
        :class:`~polyrl.protocols.ForwardProducts` asked for (``gather``: ``[N, k]`` ids for ``gather_ids``).

        With ``prompt_ids`` (the shared-prompt form), the distinct prompts ``[U, P]`` run once, their KV cache
        is copied to the rows (``prompt_of_row``, ``[B]``) and ``input_ids`` ``[B, R]`` are the responses
        alone, attending to it; ``index`` then points into ``[B, R]``: the last prompt position followed by
        the first ``R - 1`` response positions, the states that predict response tokens ``0 .. R-1``.

        A vision-language model takes ``images`` (``pixel_values``, ``image_grid_thw``) and ``image_mask``, the
        image tokens of the ids they belong to (``prompt_ids`` in the shared-prompt form, else ``input_ids``):
        their embeddings are the vision tower's features (:func:`polyrl_engine_fsdp.multimodal.embed_with_images`);
        images without a mask are a blank run that adds nothing (a sharded rank without images keeps FSDP's
        gathers in step).

        With sequence parallelism the inputs are this rank's slice and ``sp_gather`` (a
        :class:`~polyrl_engine_fsdp.ulysses.GatherPlan`) assembles every rank's outputs; ``attention_kwargs``
        reach the attention (flash attention's varlen lengths).
        """
        backbone, head = self._parts()
        if prompt_ids is None:
            text = {"input_ids": input_ids} if images is None else {
                "inputs_embeds": embed_with_images(backbone, input_ids, images, image_mask)}
            hidden = backbone(attention_mask=attention_mask, position_ids=position_ids, use_cache=False,
                              **text, **attention_kwargs).last_hidden_state
        else:
            from polyrl.models.kv_cache import cache_kwargs, new_cache

            # our own cache, filled in place and passed under the name the model's forward takes (transformers
            # renamed past_key_values to cache); never read back from the output
            cache = new_cache(backbone)
            cached = cache_kwargs(backbone, cache)
            text = {"input_ids": prompt_ids} if images is None else {
                "inputs_embeds": embed_with_images(backbone, prompt_ids, images, image_mask)}
            prefix = backbone(attention_mask=prompt_mask, position_ids=prompt_positions, use_cache=True,
                              **cached, **text)
            # gradients of every row flow back to its prompt
            packed_rest = attention_mask is not None and attention_mask.dim() == 4
            if packed_rest:  # the responses end to end in one row (:func:`_packed_responses`)
                _prompts_end_to_end(cache)
            else:
                _rows_of_prompts(cache, prompt_of_row)
            rest = backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                            use_cache=True, **cached).last_hidden_state
            if packed_rest:  # [U + T, hidden]: each prompt's last state, then the packed response tokens'
                hidden = torch.cat([prefix.last_hidden_state[:, -1], rest[0]], dim=0)
            else:
                hidden = torch.cat([prefix.last_hidden_state[prompt_of_row, -1:], rest[:, :-1]], dim=1)
        h = hidden.reshape(-1, hidden.shape[-1])[index]
        if self.model_type == "value":
            values = head(h).squeeze(-1).float().clone()
            return {"values": values if sp_gather is None else sp_gather(values)}
        extra = products.output_keys() if products else ()
        top_k = products.top_k if products else 0
        if top_k > head.weight.shape[0]:
            raise ValueError(f"forward products: top_k={top_k} is larger than the vocabulary ({head.weight.shape[0]})")
        parts: dict[str, list[torch.Tensor]] = {k: [] for k in ("log_probs", "entropy", *extra)}
        for start in range(0, h.shape[0], self.chunk):
            hs, ys = h[start : start + self.chunk], targets[start : start + self.chunk]
            gs = gather[start : start + self.chunk] if gather is not None else None
            args = (hs, ys, head.weight, head.bias, temperature, compute_entropy, products, gs)
            if torch.is_grad_enabled():
                chunk = torch.utils.checkpoint.checkpoint(_chunk_logprob, *args, use_reentrant=False)
            else:
                chunk = _chunk_logprob(*args)
            for key, value in chunk.items():
                parts[key].append(value)
        if not parts["log_probs"]:  # no response token in this micro-batch (a rank-padding one): keep the graph connected
            zero = h.sum(-1) * 0.0 + head.weight.sum() * 0.0  # lm_head gets a zero gradient, as on other ranks
            parts["log_probs"], parts["entropy"] = [zero.float()], [zero.float()]
            k = top_k or (gather.shape[-1] if gather is not None else 0)
            for key in extra:  # empty outputs of the right trailing shape
                trailing = (k,) if key in ("top_k_log_probs", "top_k_ids", "gathered_log_probs") else ()
                dtype = torch.long if key == "top_k_ids" else torch.float32
                parts[key] = [torch.zeros((0, *trailing), dtype=dtype, device=h.device)]
        # clone: FSDP2 must not hand out views of its output (an in-place op would skip its backward hook)
        out = {"log_probs": torch.cat(parts["log_probs"]).clone()}
        if compute_entropy:
            out["entropy"] = torch.cat(parts["entropy"]).clone()
        for key in extra:
            out[key] = torch.cat(parts[key]).clone()
        return out if sp_gather is None else {k: sp_gather(v) for k, v in out.items()}


def _rows_of_prompts(cache: Any, prompt_of_row: torch.Tensor) -> None:
    """Turn ``cache``'s per-prompt keys and values (``[U, ...]``) into per-row ones (row ``i`` continues prompt
    ``prompt_of_row[i]``). Where the rows come in whole groups of ``n`` in prompt order (GRPO's samples, as
    :func:`_model_inputs` numbers the prompts) each prompt's tensors are broadcast to its rows: the backward sums
    each group, where the general ``index_select`` gathers and its backward scatters row by row (``scatter_add``,
    3% of a training step with 200-token prompts on a CPU)."""
    u, b = int(prompt_of_row.max()) + 1, prompt_of_row.numel()
    layers = getattr(cache, "layers", None)
    if b % u or not layers or not all(hasattr(layer, "keys") and hasattr(layer, "values") for layer in layers) \
            or not torch.equal(prompt_of_row, torch.arange(u, device=prompt_of_row.device).repeat_interleave(b // u)):
        cache.reorder_cache(prompt_of_row)
        return
    for layer in layers:
        for name in ("keys", "values"):
            t = getattr(layer, name)
            setattr(layer, name, t[:, None].expand(u, b // u, *t.shape[1:]).reshape(b, *t.shape[1:]))


def _prompts_end_to_end(cache: Any) -> None:
    """Lay ``cache``'s per-prompt keys and values (``[U, heads, P, d]``) end to end in one row
    (``[1, heads, U x P, d]``, prompt-major): the packed responses' block mask picks each one's own prompt."""
    layers = getattr(cache, "layers", None)
    if not layers or not all(hasattr(layer, "keys") and hasattr(layer, "values") for layer in layers):
        raise RuntimeError("the packed shared-prompt forward needs transformers' DynamicCache with per-layer keys and "
                           "values; set fsdp.shared_prompt_packed=false for this model")
    for layer in layers:
        for name in ("keys", "values"):
            t = getattr(layer, name)
            setattr(layer, name, t.transpose(0, 1).reshape(1, t.shape[1], t.shape[0] * t.shape[2], *t.shape[3:]))


def _chunk_logprob(h, y, weight, bias, temperature: float, compute_entropy: bool,
                   products: ForwardProducts | None = None, gather=None) -> dict[str, torch.Tensor]:
    """One chunk of positions: the target tokens' log-probs, the entropy, and the forward products asked for."""
    logits = F.linear(h, weight, bias).float()
    if temperature != 1.0:
        logits = logits / temperature
    logp = torch.log_softmax(logits, dim=-1)
    token_logp = logp.gather(-1, y.unsqueeze(-1)).squeeze(-1)
    out = {"log_probs": token_logp,
           "entropy": -(logp.exp() * logp).sum(-1) if compute_entropy else torch.zeros_like(token_logp)}
    if products:
        if products.sum_pi_squared:  # exp(logsumexp(2 log p)): sum_v p_v^2 without a second softmax
            out["sum_pi_squared"] = torch.logsumexp(2.0 * logp, dim=-1).exp()
        if products.top_k > 0:
            values, ids = torch.topk(logp, products.top_k, dim=-1)
            out["top_k_log_probs"], out["top_k_ids"] = values, ids
        if gather is not None:
            out["gathered_log_probs"] = logp.gather(-1, gather.long())
    return out


# ---------------------------------------------------------------------------- the engine


class FSDPEngine:
    """FSDP2 engine for the ``actor``, ``ref`` (no optimizer), ``critic`` (``model_type="value"``) and
    ``reward_model`` (a value head scored at the last token, no optimizer) roles.

    Subclasses change what is trained through the public methods under "extension points"
    (docs/plugins/extension_points.md); the rest (sharding, optimizer, steps, checkpoints, weights) is shared.
    """

    #: Batch fields ``train_batch`` needs (a subclass with another forward pass names its own).
    required_fields: tuple[str, ...] = _NEEDED
    #: The :class:`~polyrl.protocols.ForwardProducts` this engine computes (``infer_batch`` and ``train_batch``
    #: take ``products=``); a subclass whose forward pass computes none sets ``frozenset()``.
    forward_products: frozenset[str] = frozenset({"sum_pi_squared", "top_k", "gather_ids"})
    #: The section of the role config holding this engine's :class:`FSDPConfig`, as error messages name it
    #: (``actor.fsdp.param_dtype``); a subclass registered under another name names its own.
    config_section: str = "fsdp"

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # a subclass whose own forward pass takes no ``products`` computes none, unless it says otherwise
        if "forward_products" not in cls.__dict__ and "forward_micro_batch" in cls.__dict__:
            import inspect

            if "products" not in inspect.signature(cls.forward_micro_batch).parameters:
                cls.forward_products = frozenset()

    def __init__(self, config: Any, *, role: str, model_type: str = "causal_lm", platform: Any = None) -> None:
        from polyrl.platforms import detect_platform

        self.config = config
        self.role = role
        self.model_type = model_type
        self.fsdp: FSDPConfig = config.plugin_config if isinstance(config.plugin_config, FSDPConfig) else FSDPConfig()
        self.platform = platform or detect_platform()
        self.device = self.platform.current_device()
        ensure_process_group(self.platform.dist_backend)
        self._rank, self._world = dist.get_rank(), dist.get_world_size()
        self.step = 0
        self.lora = config.model.lora.rank > 0
        self.sp = self._sequence_parallel_group()
        # HF models drop the KV cache under gradient checkpointing, which the shared-prompt forward needs
        self._shared_prompt = (self.fsdp.shared_prompt and not config.use_remove_padding
                               and not config.model.gradient_checkpointing and self.sp is None)
        #: A vision-language model's ``vision_config`` (set by :meth:`load_model`; ``None``: text only).
        self.vision: Any = None
        self._vision_trained = False
        self._reducer: GradReducer | None = None
        self._build_model()
        self.optimizer = self.scheduler = None
        if role not in INFERENCE_ROLES:  # ref, reward_model, teacher only infer
            self._build_optimizer()

    # ------------------------------------------------------------------ construction
    @classmethod
    def data_parallel_size(cls, role_config: Any, world_size: int, *, role: str = "actor") -> int:
        """The data-parallel size of a role on ``world_size`` ranks: ``world_size / ulysses_sequence_parallel_size``,
        or a one-line :class:`ConfigError` naming the key. Called by the trainer before any worker starts: checks
        that the sequence-parallel size divides the ranks and the attention heads of the model's ``config.json``
        (a local folder's; a Hub id's heads are checked when the engine builds), and the attention."""
        fsdp = role_config.plugin_config if isinstance(role_config.plugin_config, FSDPConfig) else FSDPConfig()
        size = fsdp.ulysses_sequence_parallel_size
        key = f"{role}.{cls.config_section}.ulysses_sequence_parallel_size"
        cls._check_splits_sequences(size, key)
        return check_sequence_parallel(size, world_size, key=key, role=role,
                                       hf_config=_local_hf_config(role_config.model) if size > 1 else None,
                                       attn_implementation=role_config.model.attn_implementation,
                                       packed=role_config.use_remove_padding)

    @classmethod
    def _check_splits_sequences(cls, size: int, key: str) -> None:
        """Ulysses splits sequences inside this engine's own forward (:meth:`wrap_model`, :meth:`forward_micro_batch`);
        a subclass that replaces them (another kind of model) gets a ConfigError rather than a silent no-op."""
        own = cls.forward_micro_batch is FSDPEngine.forward_micro_batch and cls.wrap_model is FSDPEngine.wrap_model
        if size > 1 and not own:
            raise ConfigError(f"{key}={size}: engine {cls.__name__} runs a forward pass of its own, which Ulysses "
                              "sequence parallelism does not split; set it to 1")

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel group: the ranks of one sequence-parallel group share it."""
        return self._rank // self.sequence_parallel_size

    @property
    def dp_size(self) -> int:
        """Data-parallel groups: the role's ranks divided by ``fsdp.ulysses_sequence_parallel_size``."""
        return self._world // self.sequence_parallel_size

    @property
    def collects_output(self) -> bool:
        """Whether the driver keeps this rank's results: the first rank of each sequence-parallel group."""
        return self._rank % self.sequence_parallel_size == 0

    @property
    def sequence_parallel_size(self) -> int:
        """Ranks that split each sequence (``fsdp.ulysses_sequence_parallel_size``); 1 without Ulysses."""
        return self.sp.size if self.sp is not None else 1

    @property
    def rank(self) -> int:
        """This process's rank in the role's worker group (rank 0 writes what one rank writes)."""
        return self._rank

    @property
    def world_size(self) -> int:
        """The number of ranks in the role's worker group."""
        return self._world

    # ------------------------------------------------------------------ extension points (model building)
    def check_options(self) -> None:
        """Check this engine's options before the model loads; a ``ConfigError`` names the key
        (``<role>.<config_section>.param_dtype``...)."""
        section = f"{self.role}.{self.config_section}"
        for key, value in (("param_dtype", self.fsdp.param_dtype), ("reduce_dtype", self.fsdp.reduce_dtype)):
            torch_dtype(value, f"{section}.{key}")
        check_choice(self.fsdp.lora_export, ("merged", "adapter"), f"{section}.lora_export")
        check_choice(self.config.model.lora.sync, ("merged", "adapter"), f"{self.role}.model.lora.sync")

    def load_model(self, dtype: torch.dtype) -> nn.Module:
        """The model to train, in ``dtype`` on the CPU, with gradient checkpointing on when
        ``model.gradient_checkpointing`` is; sets ``self.hf_config`` (what :meth:`export_hf` writes).

        This engine: the transformers causal LM (or, for ``model_type="value"``, a token classifier with a
        scalar head: a sequence or token classifier's trained ``score`` head, a causal LM's saved TRL / OpenRLHF
        value head, or a new zero head) at ``model.path``. The global seed is set (``<role>.seed``) before it is called.
        """
        from transformers import AutoConfig

        mcfg = self.config.model
        check_model_path(mcfg.path, f"{self.role}.model.path")  # a folder, or a Hub id transformers resolves
        path = mcfg.path
        hf_config = AutoConfig.from_pretrained(path, trust_remote_code=mcfg.trust_remote_code, **mcfg.override_config)
        archs = getattr(hf_config, "architectures", None) or []
        heads = ("ForTokenClassification", "ForSequenceClassification")  # a critic's or a reward model's head
        suffixes = ("ForCausalLM", "LMHeadModel") + (heads if self.model_type == "value" else ())
        self.vision = self._check_vision_language(hf_config)
        if self.vision is not None:
            suffixes += ("ForConditionalGeneration",)
        if archs and not any(a.endswith(suffixes) for a in archs) and not self._value_head_checkpoint(path, hf_config):
            raise ConfigError(f"{self.role}.model.path={mcfg.path}: {archs} is not a causal LM; the fsdp engine "
                              "trains causal LMs and value models built from them")
        if self.config.use_remove_padding and mcfg.attn_implementation not in _PACKED_ATTENTION:
            raise ConfigError(f"{self.role}.use_remove_padding=true needs an attention that masks packed sequences "
                              f"({', '.join(sorted(_PACKED_ATTENTION))}); {self.role}.model.attn_implementation is "
                              f"{mcfg.attn_implementation!r}")
        self.hf_config = hf_config
        model = self._load_hf(path, hf_config, dtype, mcfg)
        hf_config.architectures = [type(model).__name__]  # what export_hf writes (a value model's own class)
        if self.vision is not None and mcfg.freeze_vision_tower:
            from polyrl_engine_fsdp.multimodal import freeze_vision_tower

            logger.info("%s: vision tower frozen (%d parameters)", self.role, freeze_vision_tower(model))
        if mcfg.gradient_checkpointing:
            if hasattr(model, "activation_checkpointing_enable"):  # the newer name (the old one warns)
                model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return model

    def _check_vision_language(self, hf_config: Any) -> Any:
        """A vision-language model's ``vision_config`` (``None`` for a text-only model); refuses what this engine
        does not train on images (a value model on one, a family outside Qwen2-VL / Qwen2.5-VL)."""
        from polyrl.data.multimodal import QWEN_VL_TYPES
        from polyrl_engine_fsdp.multimodal import is_vision_language

        if not is_vision_language(hf_config):
            return None
        if hf_config.model_type not in QWEN_VL_TYPES:
            raise ConfigError(f"{self.role}.model.path={self.config.model.path}: a {hf_config.model_type} "
                              f"vision-language model; the fsdp engine trains {', '.join(QWEN_VL_TYPES)}")
        if self.model_type == "value":
            raise ConfigError(f"{self.role}.model.path={self.config.model.path}: a value model (critic) on a "
                              "vision-language model is not supported; use a critic-free estimator (grpo, rloo...)")
        return hf_config.vision_config

    def wrap_model(self, model: nn.Module) -> nn.Module:
        """The root module the engine shards and :meth:`forward_micro_batch` calls, around ``model`` (kept as
        its ``model`` attribute, so parameter names map to the model's own). This engine: the backbone plus a
        chunked LM head (or value head) on the predicting positions only."""
        return _Head(model, self.model_type, max(1, self.config.logits_chunk_size))

    def _sequence_parallel_group(self) -> SequenceParallel | None:
        """This rank's Ulysses group (``fsdp.ulysses_sequence_parallel_size`` > 1), the layout checked first."""
        size = self.fsdp.ulysses_sequence_parallel_size
        self._check_splits_sequences(size, self._sp_key)
        check_sequence_parallel(size, self._world, key=self._sp_key, role=self.role,
                                attn_implementation=self.config.model.attn_implementation,
                                packed=self.config.use_remove_padding)
        return SequenceParallel.build(size) if size > 1 else None

    @property
    def _sp_key(self) -> str:
        return f"{self.role}.{self.config_section}.ulysses_sequence_parallel_size"

    def _build_model(self) -> None:
        self.check_options()
        dtype = torch_dtype(self.config.model.dtype, f"{self.role}.model.dtype")
        torch.manual_seed(self.config.seed)
        model = self.load_model(dtype)
        if self.sp is not None and self.vision is not None:
            raise ConfigError(f"{self._sp_key}={self.sp.size}: sequence parallelism does not take vision-language "
                              f"models yet ({self.config.model.path}); set it to 1 for this role")
        if self.sp is not None:  # the model's heads are known now; its attention becomes the Ulysses wrapper
            check_sequence_parallel(self.sp.size, self._world, key=self._sp_key, role=self.role,
                                    hf_config=model.config, attn_implementation=self.config.model.attn_implementation,
                                    packed=self.config.use_remove_padding)
            self.sp.install(model, self.config.model.attn_implementation)
        if self.lora:
            model = self.apply_lora(model, self.config.model.lora)
        if self.vision is not None:  # frozen (model.freeze_vision_tower, or LoRA): weight sync leaves it out
            from polyrl_engine_fsdp.multimodal import vision_tower_names

            self._vision_trained = any(p.requires_grad for name in vision_tower_names(model)
                                       for p in model.get_submodule(name).parameters())
        self._shard_root(self.wrap_model(model), model, dtype)
        #: a layer's costs for the packed shared-prompt form (``fsdp.shared_prompt_packed``; ``None``: padded only)
        self._pack_costs = _forward_costs(model) if (
            self._shared_prompt and self.fsdp.shared_prompt_packed and self.vision is None
            and getattr(getattr(model, "config", None), "_attn_implementation", None) in ("sdpa", FLOAT32_SDPA)) else None

    def _shard_root(self, root: nn.Module, model: nn.Module, dtype: torch.dtype) -> None:
        """``self.module``: ``root`` fully_shard-ed (each of ``model``'s ``_no_split_modules`` layers, then the root)
        on the device, or left whole on every rank when one rank holds a copy."""
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        warn_if_slow_dtype(torch_dtype(self.fsdp.param_dtype, ""), self.device,
                           f"{self.role}.{self.config_section}.param_dtype")
        shard_ranks = self._shard_ranks()
        # One rank per shard and nothing FSDP-specific asked for: a plain module on every rank (DDP-like).
        # fully_shard over one rank would only add a copy-in/copy-out of every layer per pass.
        self.replicated = shard_ranks == 1 and not self.fsdp.param_offload
        if self.replicated:
            self.module = root.to(self.device)
            compute = torch_dtype(self.fsdp.param_dtype, "")
            if compute != dtype:  # mixed precision without FSDP: autocast (fp32 master weights and gradients)
                self.module.forward = _autocast(self.module.forward, self.device.type, compute)
                if self.vision is None:
                    _low_precision_activations(model, compute)
                if self.device.type == "cpu" and self.sp is None and self.vision is None:
                    _float32_attention(model)
            return
        mesh = self._mesh(init_device_mesh, shard_ranks)
        mp = MixedPrecisionPolicy(param_dtype=torch_dtype(self.fsdp.param_dtype, ""),
                                  reduce_dtype=torch_dtype(self.fsdp.reduce_dtype, ""))
        kwargs: dict[str, Any] = {"mesh": mesh, "mp_policy": mp, "reshard_after_forward": self.fsdp.reshard_after_forward}
        if self.fsdp.param_offload:
            # pinned host memory needs an accelerator: on a CPU-only host (verl's ref.fsdp_config.param_offload=True
            # moved to a CPU) pin_memory() raises "Cannot access accelerator device when none is available"
            kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=self.device.type != "cpu")
        layer_names = set(getattr(model, "_no_split_modules", None) or getattr(
            getattr(model, "get_base_model", lambda: model)(), "_no_split_modules", None) or [])
        for module in root.modules():
            if type(module).__name__ in layer_names:
                fully_shard(module, **kwargs)
        fully_shard(root, **kwargs)
        if not self.fsdp.param_offload:
            root.to(self.device)
        self.module = root

    def _shard_ranks(self) -> int:
        """How many ranks share one copy of the model (``fsdp.fsdp_size``, checked against the world size)."""
        size = self.fsdp.fsdp_size
        if size == -1 or size >= self._world:
            return self._world
        if size < 1 or self._world % size:
            raise ConfigError(f"{self.role}.{self.config_section}.fsdp_size={size} must be -1 or divide the "
                              f"{self._world} ranks")
        return size

    def _mesh(self, init_device_mesh: Any, shard_ranks: int) -> Any:
        """1-D mesh for FSDP over all ranks, or a (replicate, shard) mesh for HSDP."""
        if shard_ranks == self._world:
            return init_device_mesh(self.platform.device_type, (self._world,))
        return init_device_mesh(self.platform.device_type, (self._world // shard_ranks, shard_ranks),
                                mesh_dim_names=("replicate", "shard"))

    def _grad_reducer(self) -> GradReducer | None:
        """The replicated layout's gradient averaging over the ranks (``None``: one rank, or FSDP reduces)."""
        if not self.replicated or self._world == 1:
            return None
        if self._reducer is None:
            params = [p for p in self.module.parameters() if p.requires_grad]
            self._reducer = GradReducer(params, self._world, torch_dtype(self.fsdp.reduce_dtype, ""))
        return self._reducer

    def _value_head_checkpoint(self, path: str, hf_config: Any) -> bool:
        """A value model from a decoder saved with a value head by another library (OpenRLHF names its own class,
        ``RewardModel``, in ``architectures``; the tensors are a decoder's)."""
        if self.model_type != "value":
            return False
        from polyrl.models.reward_heads import find_reward_head

        return find_reward_head(path, hf_config).kind in ("v_head", "value_head")

    def _load_hf(self, path: str, hf_config: Any, dtype: torch.dtype, mcfg: Any) -> nn.Module:
        from transformers import (
            AutoModelForCausalLM,
            AutoModelForSequenceClassification,
            AutoModelForTokenClassification,
        )

        archs = hf_config.architectures or []
        # a value model loaded from a token or sequence classifier (an exported critic, a reward model) keeps its
        # trained `score` head (the same layer in both: _Head applies it to the states it selects); one built from
        # a causal LM gets a new scalar head, zero so the first values are 0, unless the checkpoint saved one
        # with it (TRL's v_head, OpenRLHF's value_head)
        saved_head = any(a.endswith(("ForTokenClassification", "ForSequenceClassification")) for a in archs)
        cls = AutoModelForCausalLM
        if self.model_type == "value":
            sequence = any(a.endswith("ForSequenceClassification") for a in archs) and not mcfg.random_init
            cls = AutoModelForSequenceClassification if sequence else AutoModelForTokenClassification
        if self.vision is not None:
            from transformers import AutoModelForImageTextToText as cls  # type: ignore[no-redef]
        kwargs: dict[str, Any] = {"attn_implementation": mcfg.attn_implementation,
                                  "trust_remote_code": mcfg.trust_remote_code}
        new_head = self.model_type == "value" and (mcfg.random_init or not saved_head)
        if self.model_type == "value":
            hf_config.num_labels = 1
        if mcfg.random_init:
            model = cls.from_config(hf_config, dtype=dtype, **kwargs)
        else:
            model = cls.from_pretrained(path, config=hf_config, dtype=dtype, **kwargs)
        if new_head and not mcfg.random_init:
            from polyrl.models.reward_heads import value_head_tensors

            head = value_head_tensors(path, hf_config)  # TRL's v_head / OpenRLHF's head, its normalisation folded in
            if head:
                _copy_head(model.score, head, path)
                new_head = False
        if new_head:
            nn.init.zeros_(model.score.weight)
            if getattr(model.score, "bias", None) is not None:
                nn.init.zeros_(model.score.bias)
        return model

    def apply_lora(self, model: nn.Module, lora: Any) -> nn.Module:
        """``model`` with a peft LoRA adapter of ``lora`` (``model.lora``: rank, alpha, dropout, target modules);
        called when ``model.lora.rank > 0``. This engine: ``all-linear`` or the named modules; a critic's new
        scalar head trains in full."""
        from peft import LoraConfig, get_peft_model

        targets = list(lora.target_modules)
        target = "all-linear" if targets == ["all-linear"] else targets
        extra: dict[str, Any] = {}
        if self.vision is not None:  # LoRA on the language model; the vision tower stays frozen
            from polyrl_engine_fsdp.multimodal import lora_exclude_pattern

            extra["exclude_modules"] = lora_exclude_pattern()
        try:
            # a critic's new scalar head must train in full, not stay frozen at zero
            return get_peft_model(model, LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                                                    target_modules=target, bias="none",
                                                    modules_to_save=["score"] if self.model_type == "value" else None,
                                                    **extra))
        except ValueError as exc:
            names = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)})
            raise ConfigError(f"{self.role}.model.lora.target_modules={targets} matches no module of the model "
                              f"({exc}). Linear layers it has: {', '.join(names)}") from None

    def _build_optimizer(self) -> None:
        o = self.config.optim
        params = [p for p in self.module.parameters() if p.requires_grad]
        # torch picks the per-parameter loop on CPU unless told otherwise; the fused kernel is ~5x faster there
        fused = o.fused if o.fused is not None else self.device.type in _fused_adam_devices()
        impl = {"fused": True} if fused else {"foreach": True}
        self.optimizer = torch.optim.AdamW(params, lr=o.lr, betas=tuple(o.betas), eps=o.eps,
                                           weight_decay=o.weight_decay, **impl)
        self.scheduler = build_lr_scheduler(self.optimizer, o, f"{self.role}.optim")

    # ------------------------------------------------------------------ extension points (forward passes)
    def forward_micro_batch(self, mb: TensorDict, temperature: float, compute_entropy: bool,
                            products: ForwardProducts | None = None) -> tuple[dict[str, torch.Tensor], TensorDict]:
        """Run the root module on micro-batch ``mb``: ``(outputs, micro-batch as the loss sees it)``. The outputs
        are the ``model_output`` a loss gets in :meth:`train_batch` (and :meth:`infer_batch` collects).

        This engine: ``mb`` trimmed of all-padding columns; ``log_probs``/``entropy`` (or ``values``)
        ``[b, R']`` on the device, ``R'`` the trimmed response width, and the ``products`` asked for
        (``[b, R']`` or ``[b, R', k]``; :class:`~polyrl.protocols.ForwardProducts`). A vision-language model
        takes :meth:`_forward_multimodal`.
        """
        if self.vision is not None:
            return self._forward_multimodal(mb, temperature, compute_entropy, products)
        mb = _trim(mb)
        share = self._shares_prompts(mb)
        inputs: dict[str, Any] = _model_inputs(mb, packed=self.config.use_remove_padding, shared_prompt=share,
                                               uniform=share and not self.replicated, pack_costs=self._pack_costs)
        if products and products.gather_ids:
            require_fields(mb, [products.gather_ids], f"{self.role} engine forward products (gather_ids)")
            inputs["gather"] = mb[products.gather_ids][inputs["rows"], inputs["cols"]]
        extra: dict[str, Any] = {}
        if self.sp is not None:  # this rank's slice of the sequence; the outputs come back whole
            if products:
                raise ValueError(f"the {self.role} engine: forward products ({', '.join(products.requested())}) are "
                                 "not computed with sequence parallelism (fsdp.ulysses_sequence_parallel_size > 1)")
            inputs = self.sp.shard(inputs, flash=self.config.model.attn_implementation.startswith("flash"))
            extra["sp_gather"] = inputs.pop("gather").to(self.device)
            extra.update({k: inputs.pop(k) for k in _VARLEN_KEYS if k in inputs})
        dev = {k: v.to(self.device) for k, v in inputs.items() if isinstance(v, torch.Tensor)}
        extra = {k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in extra.items()}
        shared = {k: dev[k] for k in ("prompt_ids", "prompt_mask", "prompt_positions", "prompt_of_row") if k in dev}
        if products:
            shared.update(products=products, gather=dev.get("gather"))
        flat = self.module(dev["input_ids"], dev.get("attention_mask"), dev["position_ids"], dev["index"],
                           dev["targets"], temperature=temperature, compute_entropy=compute_entropy, **shared, **extra)
        shape = tuple(mb["responses"].shape)
        rows, cols = dev["rows"], dev["cols"]
        out = {k: torch.zeros(shape + tuple(v.shape[1:]), dtype=v.dtype, device=v.device).index_put((rows, cols), v)
               for k, v in flat.items()}
        return out, mb

    def _shares_prompts(self, mb: TensorDict) -> bool:
        """Whether micro-batch ``mb`` (trimmed) takes the shared-prompt form: ``fsdp.shared_prompt`` is on and it
        skips at least ``fsdp.shared_prompt_min_tokens`` prompt tokens. Sharded ranks agree (each pass all-gathers
        every layer, so all run the same passes): they share only if every rank's micro-batch does."""
        if not self._shared_prompt:
            return False
        share = _saved_prompt_tokens(mb) >= max(1, self.fsdp.shared_prompt_min_tokens)
        if not self.replicated and self._world > 1:
            share = bool(self._all_reduce(torch.tensor([int(share)]), dist.ReduceOp.MIN))
        return share

    def _forward_multimodal(self, mb: TensorDict, temperature: float, compute_entropy: bool,
                            products: ForwardProducts | None = None) -> tuple[dict[str, torch.Tensor], TensorDict]:
        """:meth:`forward_micro_batch` of a vision-language model: the rows' images and M-RoPE positions
        (:func:`polyrl_engine_fsdp.multimodal.multimodal_model_inputs`)."""
        from polyrl_engine_fsdp.multimodal import blank_image_inputs, multimodal_model_inputs

        mb = _trim(mb)
        inputs = multimodal_model_inputs(mb, image_token_id=int(self.hf_config.image_token_id),
                                         packed=self.config.use_remove_padding, shared_prompt=self._shared_prompt,
                                         uniform=not self.replicated)
        dev = {k: v.to(self.device) for k, v in inputs.items() if isinstance(v, torch.Tensor)}
        images: dict[str, torch.Tensor] | None = {k: v.to(self.device) for k, v in inputs["images"].items()}
        if not images:  # sharded: the vision tower runs anyway, on a blank patch (FSDP's gathers are collective)
            images = None if self.replicated else blank_image_inputs(self.vision, self.device)
            dev.pop("image_mask")
        shared = {k: dev[k] for k in ("prompt_ids", "prompt_mask", "prompt_positions", "prompt_of_row") if k in dev}
        if products:
            if products.gather_ids:
                require_fields(mb, [products.gather_ids], f"{self.role} engine forward products (gather_ids)")
                shared["gather"] = mb[products.gather_ids][inputs["rows"], inputs["cols"]].to(self.device)
            shared["products"] = products
        flat = self.module(dev["input_ids"], dev.get("attention_mask"), dev["position_ids"], dev["index"],
                           dev["targets"], temperature=temperature, compute_entropy=compute_entropy,
                           images=images, image_mask=dev.get("image_mask"), **shared)
        shape = tuple(mb["responses"].shape)
        rows, cols = dev["rows"], dev["cols"]
        out = {k: torch.zeros(shape + tuple(v.shape[1:]), dtype=v.dtype, device=v.device).index_put((rows, cols), v)
               for k, v in flat.items()}
        return out, mb

    def split_micro_batches(self, batch: TensorDict, dynamic: bool) -> list[torch.Tensor | None]:
        """Row indices of each micro-batch of ``batch``: ``micro_batch_size`` rows each, or with ``dynamic`` up
        to ``max_token_len_per_gpu`` tokens each (first-fit decreasing). ``None`` entries pad this rank to the
        largest count of any rank (every rank runs the same number of passes: they are collective); run
        :meth:`padding_micro_batch` for them. With sequence parallelism the token budget is the group's (its
        ``sp`` ranks each hold ``1/sp`` of the tokens), as in verl. Collective."""
        cfg = self.config
        size = batch.batch_size[0]
        if dynamic:
            r = batch["responses"].shape[1]
            attn = batch["attention_mask"]
            p_len, r_len = attn[:, :-r].sum(-1).tolist(), attn[:, -r:].sum(-1).tolist()
            lengths = [a + b for a, b in zip(p_len, r_len)]
            order = sorted(range(size), key=lambda i: -lengths[i])
            groups: list[list[int]] = []
            budget = cfg.max_token_len_per_gpu * self.sequence_parallel_size
            for i in order:  # first-fit decreasing by tokens
                for g in groups:
                    # packed: the tokens themselves; padded: the rectangle left after trimming padding columns
                    members = g + [i]
                    cost = (sum(lengths[j] for j in members) if cfg.use_remove_padding else
                            (max(p_len[j] for j in members) + max(r_len[j] for j in members)) * len(members))
                    if cost <= budget:
                        g.append(i)
                        break
                else:
                    groups.append([i])
            splits: list[torch.Tensor | None] = [torch.tensor(sorted(g)) for g in groups]
        else:
            step = max(1, cfg.micro_batch_size)
            splits = [torch.arange(i, min(i + step, size)) for i in range(0, size, step)]
        # every rank must run the same number of forward/backward passes (they are collective)
        count = self._all_reduce(torch.tensor([len(splits)]), dist.ReduceOp.MAX)
        return splits + [None] * (int(count) - len(splits))

    def _all_reduce(self, tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM) -> torch.Tensor:
        """All-reduce a small CPU tensor through the platform's backend (nccl needs it on the device)."""
        on_device = tensor.to(self.device)
        dist.all_reduce(on_device, op=op)
        return on_device.cpu()

    @staticmethod
    def padding_micro_batch(batch: TensorDict) -> TensorDict:
        """A one-row micro-batch that contributes nothing (zero response mask): keeps collectives in step."""
        dummy = batch[:1].clone()
        dummy["response_mask"] = torch.zeros_like(dummy["response_mask"])
        return dummy

    @torch.no_grad()
    def infer_batch(self, batch: TensorDict, *, temperature: float = 1.0, compute_entropy: bool = False,
                    disable_adapter: bool = False, products: ForwardProducts | None = None) -> TensorDict:
        """Log-probs (and entropy) of the response tokens, or values for a value model; ``[B, R]``, zero where
        ``response_mask`` is 0. Micro-batched like ``train_batch``. ``products``: the extra outputs
        (:class:`~polyrl.protocols.ForwardProducts`) to add, ``[B, R]`` or ``[B, R, k]``."""
        require_fields(batch, _NEEDED, f"{self.role} engine infer_batch")
        products = self._check_products(products)
        self.module.eval()
        size, width = batch.batch_size[0], batch["responses"].shape[1]
        keys = ["values"] if self.model_type == "value" else ["log_probs"] + (["entropy"] if compute_entropy else [])
        keys += list(products.output_keys()) if products else []
        result: dict[str, torch.Tensor] = {}
        kw = {"products": products} if products else {}
        ctx = self.module.model.disable_adapter() if disable_adapter and self.lora else contextlib.nullcontext()
        with ctx:
            for rows in self.split_micro_batches(batch, self.config.use_dynamic_bsz):
                if rows is None:
                    self.forward_micro_batch(self.padding_micro_batch(batch), temperature, False, **kw)
                    continue
                out, trimmed = self.forward_micro_batch(batch[rows], temperature, compute_entropy, **kw)
                for k in keys:
                    value = out[k].cpu() if k == "top_k_ids" else out[k].float().cpu()
                    if k not in result:
                        result[k] = torch.zeros((size, width, *value.shape[2:]), dtype=value.dtype)
                    result[k][rows, : value.shape[1]] = value
        for k in keys:  # a batch whose every micro-batch was rank padding
            result.setdefault(k, torch.zeros(size, width, dtype=torch.float32))
        mask = batch["response_mask"]
        return TensorDict({k: v * mask.view(*mask.shape, *([1] * (v.dim() - 2))).to(v.dtype) for k, v in result.items()},
                          batch_size=batch.batch_size)

    def _check_products(self, products: ForwardProducts | None) -> ForwardProducts | None:
        """``products`` if this engine computes them all (``None`` when none is asked for); raises otherwise."""
        if not products:
            return None
        missing = [p for p in products.requested() if p not in self.forward_products]
        if missing or self.model_type == "value":
            raise ValueError(f"the {self.role} engine ({type(self).__name__}, model type {self.model_type}) does not "
                             f"compute the forward products {missing or list(products.requested())}")
        return products

    def train_batch(self, batch: TensorDict, loss_fn: Any, *, temperature: float = 1.0,
                    products: ForwardProducts | None = None) -> dict[str, float]:
        """One optimizer step on this rank's shard at ``temperature`` (see
        :meth:`polyrl.protocols.Engine.train_batch`); ``products`` reach ``loss_fn`` in its ``model_output``."""
        require_fields(batch, self.required_fields, f"{self.role} engine train_batch")
        products = self._check_products(products)
        kw = {"products": products} if products else {}
        if self.optimizer is None:
            raise RuntimeError(f"the {self.role} engine has no optimizer (role 'ref' only infers)")
        self.module.train()
        # the ranks of a sequence-parallel group hold the same shard: count it once
        totals = self._all_reduce(torch.tensor([float(batch["response_mask"].sum()), float(batch.batch_size[0])],
                                               dtype=torch.float64)) / self.sequence_parallel_size
        scale = LossScale(dp_size=self.dp_size, batch_num_tokens=round(float(totals[0])),
                          global_batch_size=round(float(totals[1])))
        metrics: dict[str, float] = {}
        splits = self.split_micro_batches(batch, self.config.use_dynamic_bsz)
        real = max(1, sum(rows is not None for rows in splits))
        reducer = self._grad_reducer()
        for i, rows in enumerate(splits):
            mb = self.padding_micro_batch(batch) if rows is None else batch[rows]
            with offload_activations(self.device) if self.fsdp.activation_offload else contextlib.nullcontext():
                out, trimmed = self.forward_micro_batch(mb, temperature, compute_entropy=self.model_type != "value",
                                                        **kw)
            loss, m = loss_fn(out, trimmed.to(self.device), scale)
            # the last backward launches the gradient all-reduce bucket by bucket as the gradients are ready
            last = i == len(splits) - 1 and reducer is not None and self.fsdp.overlap_grad_reduce
            with reducer.overlapping() if last else contextlib.nullcontext():
                loss.backward()
            if rows is not None:  # a padding micro-batch's metrics would dilute the mean
                for k, v in m.items():
                    metrics[k] = metrics.get(k, 0.0) + float(v) / real
        if reducer is not None:
            reducer.finish()
        grad_norm = torch.nn.utils.clip_grad_norm_(
            [p for p in self.module.parameters() if p.requires_grad], self.config.optim.grad_clip or float("inf"))
        grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
        if math.isfinite(grad_norm):
            offloaded = self.fsdp.optimizer_offload and self.device.type != "cpu" and not self.fsdp.param_offload
            if offloaded:
                _move_optimizer(self.optimizer, self.device)
            self.optimizer.step()
            if offloaded:  # optimizer state lives on CPU between steps
                _move_optimizer(self.optimizer, "cpu")
        else:
            metrics["skipped_step"] = 1.0
        self.optimizer.zero_grad(set_to_none=True)
        lr = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        self.step += 1
        prefix = "critic" if self.model_type == "value" else "actor"
        metrics[f"{prefix}/grad_norm"] = grad_norm
        metrics[f"{prefix}/lr"] = lr
        return metrics

    # ------------------------------------------------------------------ weights
    def full_parameters(self, include: Callable[[str], bool] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, full tensor)`` one parameter at a time, gathered from its shards (collective: every rank
        iterates); LoRA merged per module. Names are the model's own (the root's ``model.`` and peft's prefixes
        removed): HF names for this engine. ``include(hf_name)`` picks which parameters come (default: all)."""
        lora_mods = {}
        if self.lora:
            from peft.tuners.lora import LoraLayer

            lora_mods = {n: m for n, m in self.module.named_modules() if isinstance(m, LoraLayer)}
        for name, param in self.module.named_parameters():
            if ".lora_" in name or ".original_module." in name:  # peft's frozen copy of a fully trained module
                continue
            hf = _hf_name(name)
            if include is not None and not include(hf):
                continue
            full = full_tensor(param)
            if self.lora and name.endswith(".base_layer.weight"):
                mod = lora_mods[name[: -len(".base_layer.weight")]]
                full = full.clone()
                for adapter in mod.active_adapters:
                    a = full_tensor(mod.lora_A[adapter].weight)
                    b = full_tensor(mod.lora_B[adapter].weight)
                    full += (b.float() @ a.float()).to(full.dtype) * mod.scaling[adapter]
            yield hf, full

    def _adapter_params(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The LoRA tensors alone, named as peft saves them (``base_model.model.<hf module>.lora_A.weight``)."""
        for name, param in self.module.named_parameters():
            if ".lora_" in name:
                yield _adapter_name(name), full_tensor(param)

    def weights_for_rollout(self, bucket_bytes: int = 512 << 20) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """``(hf_name, full tensor)`` lists of about ``bucket_bytes``, one parameter gathered at a time.

        Collective: every rank iterates. LoRA weights are merged (``W + B A * scaling``) unless
        ``model.lora.sync`` is ``adapter``; then only the adapter's tensors come, in peft's names.
        """
        if self.lora and self.config.model.lora.sync == "adapter":
            source = self._adapter_params()
        elif self.vision is not None and not self._vision_trained:
            from polyrl_engine_fsdp.multimodal import is_vision_parameter

            # a frozen vision tower never changes: the rollout keeps the weights it loaded
            source = self.full_parameters(include=lambda name: not is_vision_parameter(name))
        else:
            source = self.full_parameters()
        bucket: list[tuple[str, torch.Tensor]] = []
        size = 0
        for name, tensor in source:
            bucket.append((name, tensor.detach()))
            size += tensor.numel() * tensor.element_size()
            if size >= bucket_bytes:
                yield bucket
                bucket, size = [], 0
        if bucket:
            yield bucket

    # ------------------------------------------------------------------ checkpoints
    def _fingerprint(self) -> str:
        return ";".join(f"{n}:{tuple(p.shape)}" for n, p in self.module.named_parameters())

    def _dcp_state(self) -> dict[str, Any]:
        """Model (and optimizer) state dicts in the form torch.distributed.checkpoint saves and loads."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        if self.optimizer is None:
            return {"model": get_state_dict(self.module, [])[0]}
        model_sd, optim_sd = get_state_dict(self.module, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def save_checkpoint(self, path: str) -> None:
        """Model, optimizer, LR schedule, RNG and step into the directory ``path``, atomically.

        Every rank writes into a temporary folder (torch.distributed.checkpoint shards, per-rank extras,
        ``meta.json``) that :func:`polyrl.checkpoint_io.atomic_checkpoint_dir` renames into place once all
        ranks finished and the file manifest is written, so a crash or a full disk leaves the old checkpoint.
        """
        import torch.distributed.checkpoint as dcp

        with atomic_checkpoint_dir(path) as tmp:
            dcp.save(self._dcp_state(), checkpoint_id=str(tmp))
            # The device's generator through the platform (CUDA, NPU...; on CPU the same as "torch").
            rng = {"torch": torch.get_rng_state(), "python": random.getstate(),
                   "device": self.platform.rng_state(), "device_type": self.platform.device_type}
            torch.save({"rng": rng, "scheduler": self.scheduler.state_dict() if self.scheduler else None},
                       tmp / f"extra_rank{self._rank}.pt")
            if self._rank == 0:
                meta = {"world_size": self._world, "step": self.step, "role": self.role,
                        "model_type": self.model_type, "fingerprint": self._fingerprint(), "format": "polyrl-fsdp-1"}
                (tmp / "meta.json").write_text(json.dumps(meta))

    def load_checkpoint(self, path: str, *, model_only: bool = False) -> None:
        """Restore what :meth:`save_checkpoint` wrote; ``CheckpointError`` names a world-size or model mismatch.

        ``model_only``: the model's weights alone (``polyrl export``), from a checkpoint written by any number
        of ranks (torch.distributed.checkpoint reshards them onto this group); the optimizer, LR schedule, RNG
        and step keep their fresh values, so this is no resume.
        """
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        folder = Path(path)
        meta_file = folder / "meta.json"
        if not meta_file.exists():
            raise CheckpointError(f"{folder} is not an fsdp engine checkpoint (no meta.json)")
        meta = load_json(meta_file)
        if meta.get("format", "polyrl-fsdp-1") != "polyrl-fsdp-1":
            raise CheckpointError(f"{folder} was written by another engine (format {meta.get('format')!r}, expected "
                                  f"'polyrl-fsdp-1'); load it with the engine that wrote it, or export it to HF and "
                                  f"set {self.role}.model.path to the export")
        if meta["world_size"] != self._world and not model_only:
            raise CheckpointError(f"checkpoint {folder} was written by {meta['world_size']} ranks; this {self.role} "
                                  f"group has {self._world}. Resume with the same trainer.n_workers.")
        if meta["fingerprint"] != self._fingerprint():
            raise CheckpointError(f"checkpoint {folder} holds a different model (parameter names/shapes differ from "
                                  f"{self.role}.model.path={self.config.model.path})")
        if model_only:
            weights = {"model": get_state_dict(self.module, [])[0]}
            load_dcp(weights, folder)  # only the model's entries are read
            set_state_dict(self.module, [], model_state_dict=weights["model"], optim_state_dict={})
            return
        state = self._dcp_state()
        load_dcp(state, folder)  # refuses pickled code in the metadata and non-tensor items
        if self.optimizer is not None:
            set_state_dict(self.module, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        else:
            set_state_dict(self.module, [], model_state_dict=state["model"], optim_state_dict={})
        extra = load_tensors(folder / f"extra_rank{self._rank}.pt")
        if self.scheduler is not None and extra["scheduler"] is not None:
            self.scheduler.load_state_dict(extra["scheduler"])
            self._apply_optim_config()
        torch.set_rng_state(extra["rng"]["torch"])
        if extra["rng"].get("device_type") == self.platform.device_type:
            self.platform.set_rng_state(extra["rng"]["device"])
        else:  # resumed on another kind of device: its generator starts from the seed instead
            logger.warning("checkpoint %s holds %s RNG state; this run is on %s: device RNG not restored", folder,
                           extra["rng"].get("device_type", "no device"), self.platform.device_type)
        random.setstate(extra["rng"]["python"])
        self.step = meta["step"]

    def _apply_optim_config(self) -> None:
        """Make the current config's LR and weight decay rule over the restored optimizer and schedule (they
        equal the checkpoint's unless ``trainer.resume_override`` allowed them to change)."""
        o = self.config.optim
        for i, group in enumerate(self.optimizer.param_groups):
            old_base = group.get("initial_lr") or self.scheduler.base_lrs[i]
            if old_base:  # keep the schedule's position: scale the current LR by new base / old base
                group["lr"] = group["lr"] * o.lr / old_base
            group["initial_lr"] = o.lr
            group["weight_decay"] = o.weight_decay
        self.scheduler.base_lrs = [o.lr for _ in self.scheduler.base_lrs]
        self.scheduler._last_lr = [g["lr"] for g in self.optimizer.param_groups]

    def export_hf(self, path: str) -> None:
        """The folder ``save_pretrained`` writes, at ``path``: config, generation config, safetensors (sharded with
        ``model.safetensors.index.json`` above ``fsdp.export_max_shard_size``), tokenizer.

        LoRA is merged into the weights, or with ``fsdp.lora_export: adapter`` written as a peft adapter folder
        (``adapter_config.json`` + ``adapter_model.safetensors``, loaded by ``PeftModel.from_pretrained``).
        Collective: every rank gathers the parameters, rank 0 writes.
        """
        out = Path(path)
        adapter = self.lora and self.fsdp.lora_export == "adapter"
        if adapter:  # what peft's own state dict holds: the LoRA tensors and any fully trained module (a critic's head)
            source = ((n[len("model."):], full_tensor(p)) for n, p in self.module.named_parameters() if p.requires_grad)
        else:
            source = self.full_parameters()
        tensors = {}
        for name, tensor in source:  # collective: every rank gathers, rank 0 keeps
            if self._rank == 0:
                tensors[name] = tensor.detach().cpu().contiguous()
        if self._rank == 0:
            out.mkdir(parents=True, exist_ok=True)
            if adapter:
                # peft's save_embedding_layers="auto" may look the base model up on the hub; the vocabulary never changes here
                self.module.model.save_pretrained(str(out), state_dict=tensors, save_embedding_layers=False)
            else:
                self._meta_model().save_pretrained(out, state_dict=tensors, max_shard_size=self.fsdp.export_max_shard_size)
            self._save_tokenizer(out)
        dist.barrier()

    def _meta_model(self) -> nn.Module:
        """The HF model class of this role on the meta device (no memory), with the source's generation config."""
        from polyrl.models.export import meta_hf_model

        return meta_hf_model(self.hf_config, self.config.model, value=self.model_type == "value")

    def _save_tokenizer(self, out: Path) -> None:
        from polyrl.models.export import save_tokenizer

        save_tokenizer(self.config.model, self.role, out)

    # ------------------------------------------------------------------ memory
    def offload(self) -> None:
        """Parameters and optimizer state to CPU, to free the accelerator for a colocated rollout (no-op on CPU
        and with ``fsdp.param_offload``, where they already live on CPU)."""
        if self.device.type == "cpu" or self.fsdp.param_offload:
            return
        self.module.to("cpu")
        _move_optimizer(self.optimizer, "cpu")
        self.platform.empty_cache()

    def onload(self) -> None:
        """Parameters (and optimizer state unless ``fsdp.optimizer_offload``) back onto the device."""
        if self.device.type == "cpu" or self.fsdp.param_offload:
            return
        self.module.to(self.device)
        if not self.fsdp.optimizer_offload:
            _move_optimizer(self.optimizer, self.device)


# ---------------------------------------------------------------------------- helpers


def _local_hf_config(model: Any) -> Any:
    """The attention-head count of ``model.path``'s ``config.json`` (with ``model.override_config``) when it is a
    local folder, else ``None``; read as JSON, so no model code runs."""
    from types import SimpleNamespace

    path = Path(str(model.path)) / "config.json"
    if not path.is_file():
        return None
    try:
        conf = json.loads(path.read_text())
    except (OSError, ValueError):
        return None  # reported, naming the file, when the engine loads the model
    if "num_attention_heads" not in conf:  # a multimodal config keeps its language model's in text_config
        conf = {**conf, **(conf.get("text_config") or {})}
    conf.update(model.override_config or {})
    return SimpleNamespace(num_attention_heads=conf.get("num_attention_heads"))


def _fused_adam_devices() -> set[str]:
    """Device types with a fused AdamW kernel in this torch build."""
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

        return set(_get_fused_kernels_supported_devices())
    except ImportError:  # a torch without the helper: only what every build since 2.4 has
        return {"cuda", "cpu"}


def _autocast(forward: Callable[..., Any], device_type: str, dtype: torch.dtype) -> Callable[..., Any]:
    """``forward`` under ``torch.autocast(device_type, dtype)``: the replicated layout's mixed precision (matrix
    products in ``dtype``; the weights, gradients and optimizer in the storage dtype)."""

    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        with torch.autocast(device_type, dtype=dtype):
            return forward(*args, **kwargs)

    return run


#: Model types whose decoder layers' ``input_layernorm`` and ``post_attention_layernorm`` feed matrix products
#: only (attention's q/k/v, the MLP's or experts' gate/up, a router): :func:`_low_precision_activations` hands
#: their outputs on in the compute dtype.
_NORMS_FEED_PRODUCTS = frozenset({"llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe"})


def _low_precision_activations(model: nn.Module, dtype: torch.dtype) -> None:
    """Under autocast, hand on activations in ``dtype`` where autocast leaves them in float32:

    - the input embedding's output (an embedding is not a matrix product), so the residual stream between the
      layers is ``dtype``, as when the weights themselves are ``dtype`` (FSDP2's ``param_dtype``, verl's bf16);
      with a float32 stream every residual add and norm ran on float32 activations;
    - the norms before attention and the MLP (:data:`_NORMS_FEED_PRODUCTS`): a float32 weight times the normalised
      ``dtype`` activation is float32, which autocast then cast to ``dtype`` once per product that reads it (q, k
      and v: three times; gate and up: twice). The products see the same values; their input gradients are summed
      in ``dtype`` before the one cast back, as with ``dtype`` weights.

    A GRPO update of the small model on a CPU (two cores, 32 rows): 4.5% faster from the first and 4% more from
    the second, with 200-token prompts; 3% and 4% with 9-token ones. Does nothing outside autocast."""

    def cast(module: nn.Module, args: Any, output: Any) -> Any:
        if isinstance(output, torch.Tensor) and output.is_floating_point() \
                and torch.is_autocast_enabled(output.device.type):
            return output.to(dtype)
        return output

    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    targets = [] if embed is None else [embed]
    if getattr(getattr(model, "config", None), "model_type", None) in _NORMS_FEED_PRODUCTS:
        targets += [m for name, m in model.named_modules()
                    if name.rsplit(".", 1)[-1] in ("input_layernorm", "post_attention_layernorm")]
    for module in targets:
        module.register_forward_hook(cast)


#: The attention :func:`_float32_attention` registers: transformers' ``sdpa`` on float32 queries, keys and values.
FLOAT32_SDPA = "polyrl_sdpa_float32"


def _float32_attention(model: nn.Module) -> bool:
    """Switch ``model`` (attention ``sdpa``) to :data:`FLOAT32_SDPA`, registered in transformers' attention and
    mask registries (the documented way to bring an attention of one's own): under autocast the attention's
    queries, keys and values go up to float32 and its output comes back in theirs. On a CPU the bf16 SDPA kernels'
    backward costs more than the float32 one plus the casts: a GRPO training step of the small model took 0.74 s
    against 0.77 s (9-token prompts) and 1.88-1.93 s against 2.17 s (200-token prompts), one core, 32 rows.
    ``False`` where the model does not take an attention from the registry (it keeps its own)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        return False
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]

    def attention(module, query, key, value, attention_mask, **kwargs):
        with torch.autocast(query.device.type, enabled=False):
            q, k, v = query.float(), key.float(), value.float()
            out = _grouped_query_attention(module, q, k, v, attention_mask, **kwargs)
            if out is None:
                out, _ = sdpa(module, q, k, v, attention_mask, **kwargs)
        return out.to(query.dtype), None

    AttentionInterface.register(FLOAT32_SDPA, attention)
    AttentionMaskInterface.register(FLOAT32_SDPA, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    try:
        model.set_attn_implementation(FLOAT32_SDPA)
    except (ValueError, AttributeError):
        return False
    return getattr(model.config, "_attn_implementation", None) == FLOAT32_SDPA


#: Keyword arguments a model's attention passes that :func:`_grouped_query_attention` can ignore.
_HARMLESS_ATTENTION_KWARGS = frozenset({"position_ids", "use_cache", "cache_position"})


def _grouped_query_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                             is_causal: bool | None = None, **kwargs: Any) -> torch.Tensor | None:
    """Attention of several query heads per key/value head (GQA) without repeating the keys and values: the
    ``g`` query heads of a key/value head are laid end to end as one head of ``g x s`` queries (their mask
    repeated), which gives what transformers' ``sdpa`` computes on the repeated keys. Saves the repeated copy and
    its backward's sum (on a CPU, 7% of a training step with 200-token shared prompts). ``[b, s, heads, d]`` like
    transformers' attentions; ``None`` where it does not apply (no GQA, one query, dropout, a per-head mask, no mask
    over cached keys, or any other extra), and the caller runs transformers' own."""
    groups = int(getattr(module, "num_key_value_groups", 1))
    b, heads, s, d = query.shape
    t = key.shape[2]
    extra = [k for k, v in kwargs.items() if v is not None and v is not False and k not in _HARMLESS_ATTENTION_KWARGS]
    if groups <= 1 or s == 1 or (dropout and module.training) or extra \
            or (attention_mask is not None and (attention_mask.dim() != 4 or attention_mask.shape[1] != 1)):
        return None
    mask = attention_mask
    if mask is None and (is_causal if is_causal is not None else getattr(module, "is_causal", True)):
        if s != t:  # transformers leaves the mask out only when queries and keys are the same positions
            return None
        mask = torch.ones(s, s, dtype=torch.bool, device=query.device).tril()[None, None]
    if mask is not None:
        mask = mask[:, :, :, :t]
        mask = mask[:, :, None].expand(mask.shape[0], 1, groups, s, t).reshape(mask.shape[0], 1, groups * s, t)
    out = F.scaled_dot_product_attention(query.reshape(b, heads // groups, groups * s, d), key, value,
                                         attn_mask=mask, scale=scaling)
    return out.reshape(b, heads, s, d).transpose(1, 2).contiguous()


def full_tensor(param: torch.Tensor) -> torch.Tensor:
    """A parameter's whole tensor: gathered from its FSDP shards (collective) or, unsharded, its data."""
    return param.full_tensor() if hasattr(param, "full_tensor") else param.data


def _hf_name(name: str) -> str:
    """Parameter name inside the engine -> HF checkpoint name."""
    name = name[len("model."):] if name.startswith("model.") else name  # the _Head wrapper
    if name.startswith("base_model.model."):
        name = name[len("base_model.model."):]
    return re.sub(r"\.modules_to_save\.[^.]+\.", ".", name.replace(".base_layer.", "."))


def _adapter_name(name: str) -> str:
    """A LoRA parameter inside the engine -> its name in a peft ``adapter_model.safetensors``."""
    name = name[len("model."):] if name.startswith("model.") else name
    # peft drops the adapter name on save: ...q_proj.lora_A.default.weight -> ...q_proj.lora_A.weight
    for part in ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B"):
        name = re.sub(rf"\.{part}\.[^.]+\.", f".{part}.", name)
    return name


def _model_inputs(mb: TensorDict, packed: bool, shared_prompt: bool = False, uniform: bool = False,
                  pack_costs: tuple[float, float] | None = None) -> dict[str, torch.Tensor | None]:
    """The model's inputs for ``mb`` and where each response token's prediction is.

    Response token ``t`` of row ``i`` (column ``S - R + t``) is predicted from column ``S - R - 1 + t``;
    tokens whose own or predicting column is padding are skipped (their outputs stay 0). ``index`` points
    into the flattened ``[tokens, hidden]`` states, ``rows``/``cols`` place each result in ``[b, R]``.
    With ``packed``, the real tokens of all rows are concatenated into one ``[1, T]`` row without
    padding; transformers then masks attention per sequence from the restarting ``position_ids``.
    With ``shared_prompt`` and rows that repeat a prompt (GRPO's ``n`` samples), each distinct prompt
    runs once and the responses attend to its copied KV cache (see :meth:`_Head.forward`). ``uniform``
    takes that two-pass form even when no prompt repeats: sharded ranks must all run the same passes
    (each pass all-gathers every layer), whatever their rows. With ``pack_costs`` (a layer's FLOPs per token and
    per attended pair, :func:`_forward_costs`) the shared-prompt form's responses are packed where that costs less
    (:func:`_packed_responses`).
    """
    ids, attn, pos = mb["input_ids"], mb["attention_mask"], mb["position_ids"]
    b, s = ids.shape
    r = mb["responses"].shape[1]
    valid = attn.bool()
    prev = torch.cat([torch.zeros(b, 1, dtype=torch.bool), valid[:, :-1]], dim=1)
    rows, cols = (valid[:, s - r :] & prev[:, s - r :]).nonzero(as_tuple=True)
    pred_col = s - r - 1 + cols
    targets = mb["responses"][rows, cols]
    if shared_prompt and not packed and s > r:
        # distinct (ids, mask) prompt rows; left padding makes column s - r - 1 every prompt's last token
        key = torch.cat([ids[:, : s - r], attn[:, : s - r]], dim=1)
        first, prompt_of_row = _distinct_rows(key)
        if (first.shape[0] < b or uniform) and bool(valid[:, s - r - 1].all()):
            shared = {"prompt_ids": ids[first, : s - r], "prompt_mask": attn[first, : s - r],
                      "prompt_positions": pos[first, : s - r], "prompt_of_row": prompt_of_row,
                      "targets": targets, "rows": rows, "cols": cols}
            rest = _packed_responses(ids[:, s - r :], valid[:, s - r :], pos[:, s - r :], attn[first, : s - r],
                                     prompt_of_row, rows, cols, pack_costs) if pack_costs is not None else None
            if rest is None:  # the padded form: [b, R] responses, each row attending to its copy of its prompt
                rest = {"input_ids": ids[:, s - r :], "attention_mask": attn, "position_ids": pos[:, s - r :],
                        "index": rows * r + cols}
            return {**rest, **shared}
    if packed and _packs_cleanly(pos, valid):
        place = (valid.flatten().cumsum(0) - 1).view(b, s)
        return {"input_ids": ids[valid][None], "attention_mask": None, "position_ids": pos[valid][None],
                "index": place[rows, pred_col], "targets": targets, "rows": rows, "cols": cols}
    return {"input_ids": ids, "attention_mask": attn, "position_ids": pos, "index": rows * s + pred_col,
            "targets": targets, "rows": rows, "cols": cols}


#: The largest block mask (attending tokens x attended positions) the packed shared-prompt form builds.
_PACKED_MASK_LIMIT = 1 << 22


def _packed_responses(ids: torch.Tensor, valid: torch.Tensor, pos: torch.Tensor, prompt_mask: torch.Tensor,
                      prompt_of_row: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor,
                      costs: tuple[float, float]) -> dict[str, torch.Tensor] | None:
    """The shared-prompt form's second pass with the responses (``ids``, ``valid``, ``pos``: ``[b, R]``) laid end
    to end in one ``[1, T]`` row, or ``None`` where the padded ``[b, R]`` form costs less.

    Each row's last response token is left out (it predicts nothing, and no other token attends to it), so ``T`` is
    the rows' lengths less one, summed. A ``[1, 1, T, U x P + T]`` boolean mask lets each token attend to its own
    prompt's real tokens in the prompts' cache laid end to end (:func:`_prompts_end_to_end`) and to its own row's
    tokens up to itself, so every log-prob is the padded form's. ``index`` points into the ``[U + T, hidden]``
    states the forward concatenates: prompt ``u``'s last state predicts its rows' first response token.

    ``costs`` are a layer's FLOPs per token (its matrix products) and per attended (query, key) pair: the packed
    form computes ``T`` tokens over ``T x (U x P + T)`` pairs, the padded one ``b x R`` tokens over
    ``b x R x (P + R)`` pairs; the cheaper is taken (packing pays where responses differ a lot in length and the
    batch is not so large that the dense mask's pairs cost more than the padding). Responses with a gap in their
    mask, or a mask over :data:`_PACKED_MASK_LIMIT` entries, stay padded."""
    b, r = ids.shape
    u, p = prompt_mask.shape
    lengths = valid.sum(1)
    steps = torch.arange(r)
    if not torch.equal(valid, steps[None] < lengths[:, None]):
        return None
    keep = steps[None] < (lengths - 1)[:, None]
    t = int(keep.sum())
    per_token, per_pair = costs
    if t == 0 or t * (u * p + t) > _PACKED_MASK_LIMIT or \
            t * per_token + t * (u * p + t) * per_pair >= b * r * per_token + b * r * (p + r) * per_pair:
        return None
    tok_row, tok_col = keep.nonzero(as_tuple=True)
    place = torch.zeros(b, r, dtype=torch.long)
    place[tok_row, tok_col] = torch.arange(t)
    own_prompt = prompt_of_row[tok_row][:, None] == torch.arange(u).repeat_interleave(p)[None]
    sees_prompt = own_prompt & prompt_mask.bool().flatten()[None]
    sees_own = (tok_row[:, None] == tok_row[None]) & (tok_col[None] <= tok_col[:, None])
    index = torch.where(cols == 0, prompt_of_row[rows], u + place[rows, (cols - 1).clamp(min=0)])
    return {"input_ids": ids[tok_row, tok_col][None], "position_ids": pos[tok_row, tok_col][None],
            "attention_mask": torch.cat([sees_prompt, sees_own], dim=1)[None, None], "index": index}


def _forward_costs(model: nn.Module) -> tuple[float, float] | None:
    """A decoder layer's FLOPs per token (twice its parameters) and per attended pair (``4 x heads x head_dim``:
    scores and the weighted sum) for :func:`_packed_responses`; ``None`` where the model's layers are not found
    or it has layers that attend to a sliding window (a custom mask would replace theirs)."""
    cfg = getattr(model, "config", None)
    n = getattr(cfg, "num_hidden_layers", None)
    heads = getattr(cfg, "num_attention_heads", None)
    if cfg is None or not n or not heads:
        return None
    if any(kind != "full_attention" for kind in (getattr(cfg, "layer_types", None) or ())) or (
            getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True)):
        return None
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    layers = next((m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) == n), None)
    if layers is None:
        return None
    return 2.0 * sum(p.numel() for p in layers[0].parameters()), 4.0 * heads * head_dim


def _saved_prompt_tokens(mb: TensorDict) -> int:
    """Prompt tokens the shared-prompt form skips in ``mb`` (left-padded, trimmed): ``(rows - distinct prompts) x
    prompt width``; 0 when a row has an empty prompt (that form needs every prompt's last token)."""
    ids, attn = mb["input_ids"], mb["attention_mask"]
    b, s = ids.shape
    p = s - mb["responses"].shape[1]
    if p <= 0 or not bool(attn[:, p - 1].bool().all()):
        return 0
    distinct = torch.unique(torch.cat([ids[:, :p], attn[:, :p]], dim=1), dim=0).shape[0]
    return (b - distinct) * p


def _distinct_rows(key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The distinct rows of ``key`` ``[b, w]``, numbered in the order they first come (a batch of whole groups:
    ``0 0 0 0 1 1 1 1 ...``): ``first`` ``[U]``, each one's first row, and ``of_row`` ``[b]``, each row's number."""
    b = key.shape[0]
    unique, of_row = torch.unique(key, dim=0, return_inverse=True)
    first = torch.full((unique.shape[0],), b, dtype=torch.long).scatter_reduce(0, of_row, torch.arange(b),
                                                                               reduce="amin")
    order = torch.argsort(first)
    return first[order], torch.argsort(order)[of_row]


def _packs_cleanly(pos: torch.Tensor, valid: torch.Tensor) -> bool:
    """Whether each row's real tokens have positions ``0, 1, 2, ...`` (what packed attention relies on)."""
    expected = (valid.long().cumsum(-1) - 1).clamp(min=0)
    return bool(torch.equal(pos[valid], expected[valid]))


def _trim(mb: TensorDict) -> TensorDict:
    """Drop all-padding columns: left of the longest prompt, right of the longest response."""
    attn = mb["attention_mask"]
    r = mb["responses"].shape[1]
    prompt_attn, resp_attn = attn[:, :-r], attn[:, -r:]
    keep_p = int(prompt_attn.sum(-1).max()) if prompt_attn.numel() else 0
    keep_r = max(1, int(resp_attn.sum(-1).max()))
    p = prompt_attn.shape[1]
    cols = torch.cat([torch.arange(p - keep_p, p), torch.arange(p, p + keep_r)])
    out = mb.clone(False)
    for key in ("input_ids", "attention_mask", "position_ids"):
        out[key] = mb[key][:, cols]
    if "mrope_position_ids" in mb.keys():  # a vision-language batch's [b, 3, S] positions
        out["mrope_position_ids"] = mb["mrope_position_ids"][..., cols]
    for key in mb.keys():
        value = mb.get(key)
        # per-response-token fields: [b, R] and [b, R, k] (a teacher's top-k); prompts are [b, P] whatever P is
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] == r and key not in (
                "input_ids", "attention_mask", "position_ids", "prompts"):
            out[key] = value[:, :keep_r]
    return out


def _move_optimizer(optimizer: Any, device: Any) -> None:
    if optimizer is None:
        return
    for state in optimizer.state.values():
        for k, v in state.items():
            if isinstance(v, torch.Tensor):
                state[k] = v.to(device)


def _copy_head(score: nn.Module, head: dict[str, torch.Tensor], path: str) -> None:
    """Put a saved value head (``polyrl.models.reward_heads.value_head_tensors``) into the ``score`` layer."""
    bias = getattr(score, "bias", None)
    if bias is None and bool(head["bias"].abs().max() > 0):
        raise ConfigError(f"model.path={path}: the saved value head has a bias (or a reward normalisation) and this "
                          "model's score layer has none")
    with torch.no_grad():
        score.weight.copy_(head["weight"].to(score.weight.dtype))
        if bias is not None:
            bias.copy_(head["bias"].to(bias.dtype))

