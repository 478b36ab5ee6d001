"""megatron-core ``GPTModel`` from a Hugging Face config (Llama, Qwen2, Qwen3, Mistral; Qwen3-MoE and Mixtral
mixtures of experts), and layout checks.

:func:`validate_layout` and :func:`model_spec` need no process group: the trainer calls them before any worker
starts, so a bad layout or an unsupported model is a ConfigError instead of a hung collective.
:func:`build_gpt_model` needs megatron's parallel state (:func:`polyrl_engine_megatron.parallel.init_parallel_state`).

Choices (see docs/engines/megatron.md):
* megatron-core's own ("local") layer implementation, no Transformer Engine: one code path on CPU and GPU;
* no vocabulary padding: the tensor-parallel size must divide the HF ``vocab_size``, so logits are exactly the
  HF model's (no padded columns to mask in log-probs and entropy);
* a critic is the same decoder with :class:`ValueHead` (one scalar per token) in place of the output layer, named
  like the ``score`` head of transformers' ``XForTokenClassification``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from polyrl.errors import ConfigError

logger = logging.getLogger(__name__)

#: HF ``model_type`` values with a converter: dense families (one weight layout) and mixtures of experts.
DENSE_MODEL_TYPES: tuple[str, ...] = ("llama", "qwen2", "qwen3", "mistral")
MOE_MODEL_TYPES: tuple[str, ...] = ("qwen3_moe", "mixtral")
SUPPORTED_MODEL_TYPES: tuple[str, ...] = DENSE_MODEL_TYPES + MOE_MODEL_TYPES
#: Mixture-of-experts families without a converter, and what their layers need that the converter lacks.
_UNCONVERTED_MOE: dict[str, str] = {
    "deepseek_v3": "multi-latent attention, shared experts, sigmoid routing with expert bias and dense first layers",
    "deepseek_v2": "multi-latent attention, shared experts and dense first layers",
    "qwen2_moe": "a gated shared expert",
    "olmoe": "query/key norms over the whole projection",
    "granitemoe": "scaled embeddings, residuals and logits",
    "phimoe": "LayerNorm with biases and sparse-mixer routing",
    "jetmoe": "mixture-of-attention heads",
    "dbrx": "fused query/key/value with clipping",
}


@dataclass(frozen=True)
class ModelSpec:
    """What the converter and the builder read from an HF config, checked."""

    model_type: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    norm_eps: float
    max_position_embeddings: int
    rope_theta: float
    rope_scaling_factor: float | None  # llama3-style scaling (megatron's ``rope_scaling``), else None
    qkv_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool
    attention_dropout: float
    value_head_bias: bool
    #: mixture of experts: routed experts per layer (0: a dense model), their FFN size, experts per token,
    #: softmax over all experts before the top-k (no renormalisation of the k weights) or after it
    num_experts: int = 0
    moe_ffn_hidden_size: int = 0
    moe_router_topk: int = 0
    moe_router_pre_softmax: bool = False
    moe_router_aux_loss_coef: float = 0.0  # the HF config's router_aux_loss_coef (used when it outputs router logits)
    moe_input_jitter: float = 0.0

    @property
    def is_moe(self) -> bool:
        """Every decoder layer's MLP is a mixture of experts."""
        return self.num_experts > 0


def _rope(hf_config: Any) -> tuple[float, dict | None]:
    params = getattr(hf_config, "rope_parameters", None)
    if isinstance(params, dict) and params:  # transformers >= 5
        scaling = None if params.get("rope_type", "default") == "default" else params
        return float(params.get("rope_theta", getattr(hf_config, "rope_theta", None) or 10000.0)), scaling
    return float(getattr(hf_config, "rope_theta", None) or 10000.0), getattr(hf_config, "rope_scaling", None)


def model_spec(hf_config: Any, *, source: str = "model.path") -> ModelSpec:
    """Check that ``hf_config`` is a family and feature set the megatron engine converts, and summarise it.

    ``source`` names where the config came from in errors (the config key or folder). Raises ConfigError naming
    the HF config key that is unsupported and what to do.
    """
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        why = (f" (a mixture of experts with {_UNCONVERTED_MOE[model_type]})" if model_type in _UNCONVERTED_MOE
               else "")
        raise ConfigError(f"{source}: model_type {model_type!r} has no HF <-> Megatron converter in engine "
                          f"'megatron'{why} (supported: {', '.join(SUPPORTED_MODEL_TYPES)}); use engine 'fsdp' "
                          "for it")

    def unsupported(key: str, value: Any, why: str) -> ConfigError:
        return ConfigError(f"{source}: config.json key {key!r} = {value!r} is not supported by engine 'megatron' "
                           f"({why}); use engine 'fsdp' for this model")

    act = getattr(hf_config, "hidden_act", "silu")
    if act != "silu":
        raise unsupported("hidden_act", act, "the converter covers SwiGLU MLPs")
    partial = getattr(hf_config, "partial_rotary_factor", 1.0)
    if partial not in (None, 1.0):
        raise unsupported("partial_rotary_factor", partial, "rotary embeddings over the whole head only")
    theta, scaling = _rope(hf_config)
    factor = None
    if scaling:
        kind = scaling.get("rope_type", scaling.get("type"))
        llama3 = dict(low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)
        if kind != "llama3" or any(float(scaling.get(k, -1)) != v for k, v in llama3.items()):
            raise unsupported("rope_scaling", scaling, "only llama3 scaling with megatron's fixed "
                              "low/high frequency factors 1/4 and 8192 original positions")
        factor = float(scaling["factor"])
    max_pos = int(getattr(hf_config, "max_position_embeddings", 2048))
    window = getattr(hf_config, "sliding_window", None)
    uses_window = getattr(hf_config, "use_sliding_window", None)
    if window is not None and uses_window is not False and int(window) < max_pos:
        raise unsupported("sliding_window", window, "sliding-window attention is not implemented")
    heads = int(hf_config.num_attention_heads)
    hidden = int(hf_config.hidden_size)
    attention_bias = getattr(hf_config, "attention_bias", None)
    if model_type == "qwen2":
        qkv_bias = True  # Qwen2 always has q/k/v biases and no o_proj bias
    else:
        if attention_bias:
            raise unsupported("attention_bias", attention_bias, "o_proj biases are not converted")
        qkv_bias = False
    if getattr(hf_config, "mlp_bias", None):
        raise unsupported("mlp_bias", hf_config.mlp_bias, "MLP biases are not converted")
    moe: dict[str, Any] = {}
    if model_type in MOE_MODEL_TYPES:
        moe = _moe_fields(hf_config, model_type, unsupported)
    return ModelSpec(
        model_type=model_type, num_layers=int(hf_config.num_hidden_layers), hidden_size=hidden,
        ffn_hidden_size=int(hf_config.intermediate_size), num_attention_heads=heads,
        num_kv_heads=int(getattr(hf_config, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(hf_config, "head_dim", None) or hidden // heads), vocab_size=int(hf_config.vocab_size),
        norm_eps=float(getattr(hf_config, "rms_norm_eps", 1e-6)), max_position_embeddings=max_pos,
        rope_theta=theta, rope_scaling_factor=factor, qkv_bias=qkv_bias, qk_norm=model_type in ("qwen3", "qwen3_moe"),
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        attention_dropout=float(getattr(hf_config, "attention_dropout", 0.0) or 0.0),
        value_head_bias=bool(getattr(hf_config, "token_classification_bias", True)), **moe,
    )


def _moe_fields(hf_config: Any, model_type: str, unsupported: Any) -> dict[str, Any]:
    """The mixture-of-experts part of :class:`ModelSpec` for Qwen3-MoE and Mixtral (every layer sparse)."""
    if model_type == "qwen3_moe":
        only_dense = list(getattr(hf_config, "mlp_only_layers", None) or [])
        if only_dense:
            raise unsupported("mlp_only_layers", only_dense, "dense layers between sparse ones are not converted")
        step = int(getattr(hf_config, "decoder_sparse_step", 1) or 1)
        if step != 1:
            raise unsupported("decoder_sparse_step", step, "dense layers between sparse ones are not converted")
        experts, ffn = int(hf_config.num_experts), int(hf_config.moe_intermediate_size)
        # HF: softmax over all experts, top-k, renormalised when norm_topk_prob; megatron's "pre-softmax" routing
        # is the unnormalised one, and its default (top-k logits, then softmax) equals the renormalised one
        pre_softmax = not bool(getattr(hf_config, "norm_topk_prob", False))
    else:  # mixtral: softmax, top-k, renormalised
        experts, ffn = int(hf_config.num_local_experts), int(hf_config.intermediate_size)
        pre_softmax = False
    if experts < 1:
        raise unsupported("num_experts", experts, "a mixture of experts needs at least one expert")
    return dict(num_experts=experts, moe_ffn_hidden_size=ffn, moe_router_topk=int(hf_config.num_experts_per_tok),
                moe_router_pre_softmax=pre_softmax,
                moe_router_aux_loss_coef=float(getattr(hf_config, "router_aux_loss_coef", 0.0) or 0.0),
                moe_input_jitter=float(getattr(hf_config, "router_jitter_noise", 0.0) or 0.0))


def validate_layout(hf_config: Any, *, tp: int, pp: int, world_size: int, key: str = "actor.megatron",
                    sequence_parallel: bool = False, lora: bool = False, source: str = "model.path",
                    cp: int = 1, ep: int = 1, etp: int | None = None) -> int:
    """Check a tensor/context/pipeline/expert layout against a model and a world size; return the data-parallel
    size ``world_size / (tp * cp * pp)``.

    Pure (no process group). ConfigError names ``{key}.tensor_model_parallel_size`` when ``tp`` does not divide
    the attention heads, KV heads, vocabulary, hidden or FFN size; ``{key}.pipeline_model_parallel_size`` when
    ``pp`` does not divide the layers; the sizes when ``tp * cp * pp`` does not divide ``world_size``;
    ``{key}.expert_model_parallel_size`` when ``ep`` does not divide the experts, ``etp * ep * pp`` does not divide
    the world, or the model has no experts; ``{key}.expert_tensor_parallel_size`` when it does not divide the
    experts' FFN size; ``{key}.sequence_parallel`` without tensor parallelism, or off for a mixture of experts
    with tensor parallelism; and LoRA (``lora=True``), which
    megatron-core 0.16 has no adapter layers for. Model families and features are checked by :func:`model_spec`.
    A sequence length context parallelism cannot split does not occur: the engine pads each packed sequence (or
    micro-batch) to a multiple of ``2 * cp`` (times ``tp`` with sequence parallelism).
    """
    tp_key, pp_key = f"{key}.tensor_model_parallel_size", f"{key}.pipeline_model_parallel_size"
    cp_key, ep_key, etp_key = (f"{key}.context_parallel_size", f"{key}.expert_model_parallel_size",
                               f"{key}.expert_tensor_parallel_size")
    for name, value in ((tp_key, tp), (pp_key, pp), (cp_key, cp), (ep_key, ep), (etp_key, 1 if etp is None else etp)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    if lora:
        raise ConfigError(f"{key.rsplit('.', 1)[0]}.model.lora: engine 'megatron' has no LoRA (megatron-core has "
                          "no adapter layers polyrl can use); drop the lora block or use engine 'fsdp'")
    spec = model_spec(hf_config, source=source)
    if world_size % (tp * cp * pp):
        what = f"{tp_key} ({tp}) x {pp_key} ({pp})" if cp == 1 else (
            f"{tp_key} ({tp}) x {cp_key} ({cp}) x {pp_key} ({pp})")
        raise ConfigError(f"{what} = {tp * cp * pp} must divide the role's world size "
                          f"({world_size} workers); change the layout or the number of workers")
    checks = (("num_attention_heads", spec.num_attention_heads), ("num_key_value_heads", spec.num_kv_heads),
              ("vocab_size", spec.vocab_size), ("hidden_size", spec.hidden_size),
              ("intermediate_size", spec.ffn_hidden_size))
    for name, value in checks:
        if value % tp:
            what = " (the vocabulary is not padded; pick a size that divides it)" if name == "vocab_size" else ""
            raise ConfigError(f"{tp_key} ({tp}) must divide the model's {name} ({value}){what}")
    if spec.num_layers % pp:
        raise ConfigError(f"{pp_key} ({pp}) must divide the model's num_hidden_layers ({spec.num_layers})")
    if sequence_parallel and tp == 1:
        raise ConfigError(f"{key}.sequence_parallel needs {tp_key} > 1 (it shards activations across the "
                          "tensor-parallel ranks); set it to false")
    if not spec.is_moe:
        if ep > 1 or etp is not None:
            used = ep_key if ep > 1 else etp_key
            raise ConfigError(f"{used} is set, but {spec.model_type} is not a mixture of experts (no experts to "
                              f"split); remove it")
        return world_size // (tp * cp * pp)
    if tp > 1 and not sequence_parallel:
        raise ConfigError(f"{key}.sequence_parallel must be true for a mixture of experts with {tp_key} ({tp}) > 1 "
                          "(megatron-core's MoE layer does not train tensor-parallel without it)")
    experts_key = "num_experts" if spec.model_type == "qwen3_moe" else "num_local_experts"
    if spec.num_experts % ep:
        raise ConfigError(f"{ep_key} ({ep}) must divide the model's {experts_key} ({spec.num_experts})")
    etp_value = tp if etp is None else etp
    if world_size % (etp_value * ep * pp):
        raise ConfigError(f"{ep_key} ({ep}) x expert tensor parallel ({etp_value}) x {pp_key} ({pp}) = "
                          f"{etp_value * ep * pp} must divide the role's world size ({world_size} workers)")
    ffn_key = "moe_intermediate_size" if spec.model_type == "qwen3_moe" else "intermediate_size"
    if spec.moe_ffn_hidden_size % etp_value:
        name = etp_key if etp is not None else f"{tp_key} (the expert tensor-parallel size by default)"
        raise ConfigError(f"{name} ({etp_value}) must divide the model's {ffn_key} ({spec.moe_ffn_hidden_size})")
    return world_size // (tp * cp * pp)


def transformer_config_from_hf(hf_config: Any, *, tp: int = 1, pp: int = 1, sequence_parallel: bool = False,
                               dtype: torch.dtype = torch.float32, cpu_init: bool | None = None, cp: int = 1,
                               ep: int = 1, etp: int | None = None, **overrides: Any) -> Any:
    """megatron-core ``TransformerConfig`` for ``hf_config``: dropout as in HF (0 for these families), fusions
    off (the local implementation), parameters in ``dtype``; ``overrides`` are further TransformerConfig fields
    (``variable_seq_lengths``, ``recompute_granularity``, ``moe_aux_loss_coeff``, ...). ``cpu_init`` (default: the
    CPU emulation is active) initialises full weights on the CPU and splits them, so a random init is the same in
    every layout. A mixture of experts gets megatron's MoE layer: ``num_moe_experts`` sequential experts, top-k
    routing as the HF family routes, the all-to-all token dispatcher, no load-balancing loss unless
    ``moe_aux_loss_coeff`` says so (HF trains without one unless ``output_router_logits``).
    """
    from megatron.core.transformer.transformer_config import TransformerConfig

    from polyrl_engine_megatron.cpu_emulation import cpu_emulation_active

    spec = model_spec(hf_config)
    kwargs: dict[str, Any] = dict(
        num_layers=spec.num_layers, hidden_size=spec.hidden_size, ffn_hidden_size=spec.ffn_hidden_size,
        num_attention_heads=spec.num_attention_heads, num_query_groups=spec.num_kv_heads, kv_channels=spec.head_dim,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, sequence_parallel=sequence_parallel,
        context_parallel_size=cp, normalization="RMSNorm", layernorm_epsilon=spec.norm_eps, gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False, add_qkv_bias=spec.qkv_bias,
        qk_layernorm=spec.qk_norm, hidden_dropout=0.0, attention_dropout=spec.attention_dropout,
        params_dtype=dtype, pipeline_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
        attention_softmax_in_fp32=True, use_cpu_initialization=cpu_emulation_active() if cpu_init is None else cpu_init,
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        apply_rope_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False,
    )
    if spec.is_moe:
        kwargs.update(
            num_moe_experts=spec.num_experts, moe_ffn_hidden_size=spec.moe_ffn_hidden_size,
            moe_router_topk=spec.moe_router_topk, moe_router_pre_softmax=spec.moe_router_pre_softmax,
            moe_input_jitter_eps=spec.moe_input_jitter or None, moe_grouped_gemm=False,
            moe_token_dispatcher_type="alltoall", moe_aux_loss_coeff=0.0, moe_router_load_balancing_type="aux_loss",
            expert_model_parallel_size=ep, expert_tensor_parallel_size=tp if etp is None else etp,
            moe_permute_fusion=False, moe_router_fusion=False,
        )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


class ValueHead(nn.Module):
    """The critic's output layer: one scalar per token, replicated on every tensor-parallel rank.

    Called like megatron's output layer (``head(hidden [s, b, h]) -> (values [s, b, 1], None)``); with sequence
    parallelism it first gathers the sequence, so every rank returns all positions.
    """

    def __init__(self, hidden_size: int, *, bias: bool = True, sequence_parallel: bool = False,
                 dtype: torch.dtype = torch.float32, device: Any = None) -> None:
        super().__init__()
        self.score = nn.Linear(hidden_size, 1, bias=bias, dtype=dtype, device=device)
        nn.init.zeros_(self.score.weight)  # a new head predicts 0 everywhere (as engine-fsdp's critic)
        if bias:
            nn.init.zeros_(self.score.bias)
        self.sequence_parallel = sequence_parallel
        for p in self.score.parameters():  # replicated, not split: megatron's grad/ckpt code reads these
            p.tensor_model_parallel = False
            p.sequence_parallel = False

    def forward(self, hidden_states: torch.Tensor, weight: torch.Tensor | None = None,
                runtime_gather_output: bool | None = None) -> tuple[torch.Tensor, None]:
        if self.sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            hidden_states = gather_from_sequence_parallel_region(hidden_states, tensor_parallel_output_grad=False)
        return self.score(hidden_states), None


class RMSNorm(nn.RMSNorm):
    """``torch.nn.RMSNorm`` built the way megatron builds its norms (``Norm(config, hidden_size, eps)``).

    megatron-core's local layer spec uses ``WrappedTorchNorm``, which refuses ``config.sequence_parallel``. With
    sequence parallelism each tensor-parallel rank normalises its own slice of the sequence, so the weight's
    gradient is a partial sum: :class:`SequenceParallelRMSNorm` marks its weight ``sequence_parallel`` and
    megatron's ``finalize_model_grads`` sums those gradients over the tensor-parallel group. This class (the
    query/key norms, which run on the whole sequence of this rank's heads) marks nothing: megatron sums the
    q/k-norm gradients over the tensor-parallel group by name.
    """

    marks_sequence_parallel = False

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                 zero_centered_gamma: bool = False, normalization: str = "RMSNorm") -> None:
        if config.normalization != "RMSNorm" or zero_centered_gamma or config.layernorm_zero_centered_gamma:
            raise ValueError("polyrl_engine_megatron.model.RMSNorm: plain RMSNorm only (Llama/Qwen/Mistral)")
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = bool(config.sequence_parallel and self.marks_sequence_parallel)


class SequenceParallelRMSNorm(RMSNorm):
    """The layer and final norms under sequence parallelism: the weight's gradient is summed over TP."""

    marks_sequence_parallel = True


def _layer_spec(config: Any, qk_norm: bool, pp_rank: int | None, *, num_experts: int = 0,
                own_attention: bool = False) -> Any:
    """megatron's local GPT layer spec (with megatron's MoE layer and sequential experts for ``num_experts``);
    with ``config.sequence_parallel`` the same block with our norms; with ``own_attention`` (context parallelism,
    packed sequences) :class:`~polyrl_engine_megatron.attention.ContextParallelAttention` as its core attention."""
    from dataclasses import replace

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    layer = get_gpt_layer_local_spec(num_experts=num_experts or None, moe_grouped_gemm=False, qk_layernorm=qk_norm,
                                     normalization="RMSNorm")
    attention = layer.submodules.self_attention
    if own_attention:
        from polyrl_engine_megatron.attention import ContextParallelAttention

        attention = replace(attention, submodules=replace(attention.submodules,
                                                          core_attention=ContextParallelAttention))
        layer = replace(layer, submodules=replace(layer.submodules, self_attention=attention))
    if not config.sequence_parallel:
        return layer
    if qk_norm:
        attention = replace(attention, submodules=replace(attention.submodules, q_layernorm=RMSNorm,
                                                          k_layernorm=RMSNorm))
    layer = replace(layer, submodules=replace(layer.submodules, input_layernorm=SequenceParallelRMSNorm,
                                              self_attention=attention, pre_mlp_layernorm=SequenceParallelRMSNorm))
    count = get_num_layers_to_build(config, pp_rank=pp_rank)
    return TransformerBlockSubmodules(layer_specs=[layer] * count, layer_norm=SequenceParallelRMSNorm)


def _megatron_moe_without_te() -> None:
    """megatron-core 0.16.1's router gating (``moe_utils.RouterGatingLinearFunction``) tests ``te_general_gemm is not
    None`` but only defines the name when Transformer Engine imports: without TE every MoE forward is a NameError.
    Define it as ``None`` (megatron's own fallback, ``torch.mm``, then runs), as the module intends."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def build_gpt_model(hf_config: Any, *, value_head: bool = False, tp: int | None = None, pp: int | None = None,
                    sequence_parallel: bool = False, dtype: torch.dtype = torch.float32,
                    pre_process: bool | None = None, post_process: bool | None = None,
                    config: Any = None, packed: bool = False, **overrides: Any) -> Any:
    """This rank's part of a megatron-core ``GPTModel`` for ``hf_config`` (random weights; load them with
    :func:`polyrl_engine_megatron.convert.load_hf_weights`).

    Needs megatron's parallel state; ``tp``/``pp`` default to it, ``pre_process``/``post_process`` to this rank's
    pipeline stage; the context- and expert-parallel sizes to it when ``config`` is not given. ``config`` replaces
    :func:`transformer_config_from_hf` (``overrides`` go to it otherwise). ``packed``: the model will be called
    with ``packed_seq_params`` (``thd`` sequences), which megatron's local attention cannot take.
    Forward: ``model(input_ids [b, s], position_ids [b, s], attention_mask)`` returns, on the last stage, logits
    ``[b, s, vocab / tp]`` (this rank's vocabulary shard) or, with ``value_head``, values ``[b, s, 1]``; other
    stages return hidden states ``[s, b, h]`` (``[s / tp, b, h]`` with sequence parallelism). Tied embeddings
    (``tie_word_embeddings``) are shared as megatron shares them (a copy on the last stage when ``pp > 1``),
    except for a critic, whose head is its own.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    spec = model_spec(hf_config)
    tp = ps.get_tensor_model_parallel_world_size() if tp is None else tp
    pp = ps.get_pipeline_model_parallel_world_size() if pp is None else pp
    if config is None:
        cp, ep = ps.get_context_parallel_world_size(), ps.get_expert_model_parallel_world_size()
        etp = ps.get_expert_tensor_parallel_world_size() if spec.is_moe else None
        config = transformer_config_from_hf(hf_config, tp=tp, pp=pp, sequence_parallel=sequence_parallel,
                                            dtype=dtype, cp=cp, ep=ep, etp=etp, **overrides)
    if spec.is_moe:
        _megatron_moe_without_te()
    pre = ps.is_pipeline_first_stage() if pre_process is None else pre_process
    post = ps.is_pipeline_last_stage() if post_process is None else post_process
    layer_spec = _layer_spec(config, spec.qk_norm, ps.get_pipeline_model_parallel_rank(), num_experts=spec.num_experts,
                             own_attention=packed or config.context_parallel_size > 1)
    model = GPTModel(
        config, layer_spec, vocab_size=spec.vocab_size, max_sequence_length=spec.max_position_embeddings,
        pre_process=pre, post_process=post, parallel_output=True,
        share_embeddings_and_output_weights=spec.tie_word_embeddings and not value_head,
        position_embedding_type="rope", rotary_base=spec.rope_theta,
        rope_scaling=spec.rope_scaling_factor is not None, rope_scaling_factor=spec.rope_scaling_factor or 8.0,
    )
    if value_head and post:
        device = next(model.decoder.final_layernorm.parameters()).device
        model.output_layer = ValueHead(spec.hidden_size, bias=spec.value_head_bias,
                                       sequence_parallel=config.sequence_parallel, dtype=config.params_dtype,
                                       device=device)
    return model
