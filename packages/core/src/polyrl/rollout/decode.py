"""The ``hf`` rollout's own decode loop: a static KV cache and the model's weights called step by step.

transformers' ``forward`` spends a third of a small model's decode step in per-layer Python (attention
interface dispatch, mask building, cache bookkeeping, output dataclasses). :class:`StaticDecoder` runs the
same arithmetic as a Llama/Qwen2/Qwen3/Mistral-style decoder, reading the model's own parameters (so weight
updates land without a copy), with:

- a KV cache allocated once per batch (``[rows, kv_heads, prompt + max_new_tokens, head_dim]`` per layer)
  and written in place: every row of a left-padded batch writes its next key at the same column;
- the prompt prefill run once per distinct prompt and its keys/values copied to each of that prompt's
  samples (GRPO's group);
- attention for one query token as two batched products over the kv heads (no repeat of the kv heads);
- logits for the last position only.

:func:`supports` says whether a model is one it runs; anything else (mixtures of experts, sliding-window
layers, vision-language models, other architectures) keeps transformers' forward in :mod:`polyrl.rollout.hf`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

logger = logging.getLogger("polyrl")

#: Model types whose decoder layers have the shape this module computes (RMSNorm, rotary attention with
#: optional q/k biases or q/k norms, SiLU-gated MLP), in transformers' module layout.
SUPPORTED_MODEL_TYPES = frozenset({"llama", "qwen2", "qwen3", "mistral"})


def supports(model: Any) -> str | None:
    """``None`` when :class:`StaticDecoder` can run ``model``; otherwise why not (for the debug log)."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        return f"model type {model_type!r} is not one of {sorted(SUPPORTED_MODEL_TYPES)}"
    base = getattr(model, "model", None)
    if base is None or not all(hasattr(base, n) for n in ("embed_tokens", "layers", "norm", "rotary_emb")) \
            or not hasattr(model, "lm_head"):
        return "the model does not have the embed_tokens / layers / norm / rotary_emb / lm_head layout"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"hidden_act {config.hidden_act!r} is not silu"
    layer_types = getattr(config, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types) or (
            model_type == "mistral" and getattr(config, "sliding_window", None)):
        return "the model has sliding-window attention layers"
    for layer in base.layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if attn is None or mlp is None or not all(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")) \
                or not all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")):
            return "a decoder layer is not attention + gated MLP (a mixture of experts?)"
        for norm in (layer.input_layernorm, layer.post_attention_layernorm, *_qk_norms(attn)):
            if _eps(norm) is None:
                return f"norm {type(norm).__name__} is not an RMSNorm"
    if _eps(base.norm) is None:
        return f"norm {type(base.norm).__name__} is not an RMSNorm"
    return None


def _qk_norms(attn: Any) -> tuple[Any, ...]:
    return tuple(m for m in (getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)) if m is not None)


def _eps(norm: Any) -> float | None:
    """An RMSNorm's epsilon (transformers' ``XRMSNorm`` modules: ``weight`` and ``variance_epsilon``)."""
    if not type(norm).__name__.endswith("RMSNorm") or not hasattr(norm, "weight"):
        return None
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    return float(eps) if eps is not None else None


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm: normalised in float32, then cast back and scaled."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class _Linear:
    """A linear layer's weight kept transposed (``[in, out]``, contiguous) beside the model's ``[out, in]``.

    One core multiplies a skinny ``[rows, in]`` activation by a contiguous ``[in, out]`` matrix 1.3-1.8x faster
    than by the transposed view ``F.linear`` uses (measured on this project's CPU for the small model's shapes at
    16 and 32 rows). The copy follows the model's parameter: :meth:`refresh` copies it again when the
    parameter's version counter moved (every in-place write, ``HFRollout.update_weights`` included).
    """

    __slots__ = ("source", "bias", "weight", "version")

    def __init__(self, module: Any) -> None:
        self.source: torch.Tensor = module.weight
        self.bias: torch.Tensor | None = getattr(module, "bias", None)
        self.weight = torch.empty(0)
        self.version = -1

    def refresh(self) -> None:
        if self.version != self.source._version or self.weight.device != self.source.device \
                or self.weight.dtype != self.source.dtype:
            with torch.no_grad():
                self.weight = self.source.detach().t().contiguous()
            self.version = self.source._version

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is None:
            return x @ self.weight
        return torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight).view(*x.shape[:-1], -1)


@dataclass
class _Layer:
    """One decoder layer: its norms (the model's own tensors) and linear layers (:class:`_Linear`)."""

    ln1: torch.Tensor
    eps1: float
    ln2: torch.Tensor
    eps2: float
    q: _Linear
    k: _Linear
    v: _Linear
    o: _Linear
    q_norm: tuple[torch.Tensor, float] | None
    k_norm: tuple[torch.Tensor, float] | None
    gate: _Linear
    up: _Linear
    down: _Linear

    def linears(self) -> tuple[_Linear, ...]:
        return self.q, self.k, self.v, self.o, self.gate, self.up, self.down


class StaticDecoder:
    """Prefill and decode of a supported causal LM (:func:`supports`) over a preallocated KV cache.

    Holds references to the model's parameters, so :meth:`HFRollout.update_weights` (an in-place copy) is
    seen by the next call. Use :meth:`start` once per batch, then :meth:`step` per generated token and
    :meth:`keep` to drop finished rows.
    """

    def __init__(self, model: Any) -> None:
        reason = supports(model)
        if reason is not None:
            raise ValueError(f"StaticDecoder: {reason}")
        config = model.config
        base = model.model
        self.model = model
        self.embed = base.embed_tokens.weight
        self.rotary = base.rotary_emb
        self.norm = base.norm.weight
        self.norm_eps = _eps(base.norm)
        self.lm_head = _Linear(model.lm_head)
        first = base.layers[0].self_attn
        self.head_dim = int(getattr(first, "head_dim", config.hidden_size // config.num_attention_heads))
        self.n_heads = int(config.num_attention_heads)
        self.n_kv = int(config.num_key_value_heads)
        self.scaling = float(getattr(first, "scaling", self.head_dim ** -0.5))
        self.layers = [self._layer(layer) for layer in base.layers]
        self._linears = [self.lm_head, *(lin for layer in self.layers for lin in layer.linears())]
        #: rope types whose cos/sin depend on the sequence length seen so far: computed per step, not tabled
        rope = getattr(self.rotary, "rope_type", "default")
        self._rope_table = rope not in ("dynamic", "longrope")
        self._cos = self._sin = torch.empty(0)
        # state of the batch being decoded
        self.cache_k: list[torch.Tensor] = []
        self.cache_v: list[torch.Tensor] = []
        self.bias = torch.empty(0)  # [rows, 1, 1, columns]: 0 where a row may attend, -inf on its padding
        self.length = 0  # columns of the cache filled

    @staticmethod
    def _layer(layer: Any) -> _Layer:
        attn, mlp = layer.self_attn, layer.mlp

        def norm(m: Any) -> tuple[torch.Tensor, float] | None:
            return None if m is None else (m.weight, _eps(m))  # type: ignore[return-value]

        return _Layer(
            ln1=layer.input_layernorm.weight, eps1=_eps(layer.input_layernorm),  # type: ignore[arg-type]
            ln2=layer.post_attention_layernorm.weight, eps2=_eps(layer.post_attention_layernorm),  # type: ignore[arg-type]
            q=_Linear(attn.q_proj), k=_Linear(attn.k_proj), v=_Linear(attn.v_proj), o=_Linear(attn.o_proj),
            q_norm=norm(getattr(attn, "q_norm", None)), k_norm=norm(getattr(attn, "k_norm", None)),
            gate=_Linear(mlp.gate_proj), up=_Linear(mlp.up_proj), down=_Linear(mlp.down_proj),
        )

    # ------------------------------------------------------------------ prefill
    def start(self, ids: torch.Tensor, mask: torch.Tensor, expand: torch.Tensor | None,
              max_new_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Prefill left-padded prompts ``ids`` ``[U, W]`` (``mask`` 1 on tokens) and set up a cache for
        ``len(expand)`` rows (row ``i`` continues prompt ``expand[i]``; ``None``: one row per prompt) with room
        for ``max_new_tokens``. Returns the rows' next-token logits ``[rows, vocab]`` (float32) and their next
        positions ``[rows]``."""
        u, width = ids.shape
        dtype, device = self.embed.dtype, ids.device
        for linear in self._linears:
            linear.refresh()
        position = (mask.cumsum(-1) - 1).clamp(min=0)
        x = F.embedding(ids, self.embed)
        if self._rope_table:  # cos/sin of every position this batch reaches, looked up per step
            span = torch.arange(width + max_new_tokens, device=device)[None]
            self._cos, self._sin = (t[0] for t in self.rotary(x, span))
            cos, sin = self._cos[position], self._sin[position]
        else:
            cos, sin = self.rotary(x, position)
        cos, sin = cos[:, None], sin[:, None]  # [U, 1, W, D]
        valid = mask.bool()
        causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()
        # a padding query attends to itself only (its output is never used; no all-masked softmax row)
        allowed = (causal[None] & valid[:, None, :]) | torch.eye(width, dtype=torch.bool, device=device)[None]
        attn_mask = allowed[:, None]  # [U, 1, W, W]
        rows = u if expand is None else int(expand.numel())
        columns = width + max_new_tokens
        self.cache_k = []
        self.cache_v = []
        d, hq, hkv = self.head_dim, self.n_heads, self.n_kv
        for layer in self.layers:
            h = _rms_norm(x, layer.ln1, layer.eps1)
            q = layer.q(h).view(u, width, hq, d).transpose(1, 2)
            k = layer.k(h).view(u, width, hkv, d).transpose(1, 2)
            v = layer.v(h).view(u, width, hkv, d).transpose(1, 2)
            if layer.q_norm is not None:
                q = _rms_norm(q, *layer.q_norm)
            if layer.k_norm is not None:
                k = _rms_norm(k, *layer.k_norm)
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
            ck = torch.empty(rows, hkv, columns, d, dtype=dtype, device=device)
            cv = torch.empty_like(ck)
            ck[:, :, :width] = k if expand is None else k[expand]
            cv[:, :, :width] = v if expand is None else v[expand]
            self.cache_k.append(ck)
            self.cache_v.append(cv)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=self.scaling,
                                                 enable_gqa=hq != hkv)
            out = out.transpose(1, 2).reshape(u, width, hq * d)
            x = x + layer.o(out)
            x = x + self._mlp(layer, _rms_norm(x, layer.ln2, layer.eps2))
        last = x[:, -1]  # left padding: every prompt ends in the last column
        logits = self._logits(last)
        bias = torch.zeros(u, 1, 1, columns, dtype=dtype, device=device)
        bias[:, 0, 0, :width].masked_fill_(~valid, float("-inf"))
        next_pos = position[:, -1] + 1
        if expand is not None:
            logits, bias, next_pos = logits[expand], bias[expand], next_pos[expand]
        self.bias = bias
        self.length = width
        return logits, next_pos

    # ------------------------------------------------------------------ decode
    def step(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Append one token per row (``tokens`` ``[rows]`` at ``positions`` ``[rows]``) and return the next
        logits ``[rows, vocab]`` (float32)."""
        rows = tokens.shape[0]
        d, hq, hkv = self.head_dim, self.n_heads, self.n_kv
        col = self.length
        if col >= self.cache_k[0].shape[2]:
            raise RuntimeError("StaticDecoder: the KV cache is full (more steps than start()'s max_new_tokens)")
        self.length = col + 1
        x = F.embedding(tokens, self.embed)  # [rows, hidden]
        if self._rope_table:
            cos, sin = self._cos[positions][:, None], self._sin[positions][:, None]  # [rows, 1, D]
        else:
            cos, sin = self.rotary(x, positions[:, None])
        cos, sin = cos[:, :, None], sin[:, :, None]  # broadcast over heads: [rows, 1, 1, D]
        bias = self.bias[..., : col + 1]  # [rows, 1, 1, L]
        for i, layer in enumerate(self.layers):
            h = _rms_norm(x, layer.ln1, layer.eps1)
            q = layer.q(h).view(rows, hkv, hq // hkv, d)
            k = layer.k(h).view(rows, hkv, 1, d)
            v = layer.v(h).view(rows, hkv, 1, d)
            if layer.q_norm is not None:
                q = _rms_norm(q, *layer.q_norm)
            if layer.k_norm is not None:
                k = _rms_norm(k, *layer.k_norm)
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
            ck, cv = self.cache_k[i], self.cache_v[i]
            ck[:, :, col : col + 1] = k
            cv[:, :, col : col + 1] = v
            # [rows, kv, group, D] x [rows, kv, D, L]: the group's query heads share their kv head's keys
            scores = torch.matmul(q, ck[:, :, : col + 1].transpose(-1, -2)) * self.scaling + bias
            probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
            out = torch.matmul(probs, cv[:, :, : col + 1]).reshape(rows, hq * d)
            x = x + layer.o(out)
            x = x + self._mlp(layer, _rms_norm(x, layer.ln2, layer.eps2))
        return self._logits(x)

    def keep(self, rows: torch.Tensor) -> None:
        """Keep only ``rows`` (indices into the current rows) in the cache, in that order."""
        self.cache_k = [c.index_select(0, rows) for c in self.cache_k]
        self.cache_v = [c.index_select(0, rows) for c in self.cache_v]
        self.bias = self.bias.index_select(0, rows)

    def release(self) -> None:
        """Free the batch's cache."""
        self.cache_k, self.cache_v, self.bias, self.length = [], [], torch.empty(0), 0
        self._cos = self._sin = torch.empty(0)

    # ------------------------------------------------------------------ pieces
    @staticmethod
    def _mlp(layer: _Layer, h: torch.Tensor) -> torch.Tensor:
        return layer.down(F.silu(layer.gate(h)) * layer.up(h))

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        h = _rms_norm(x, self.norm, self.norm_eps)  # type: ignore[arg-type]
        return self.lm_head(h).float()


__all__ = ["SUPPORTED_MODEL_TYPES", "StaticDecoder", "supports"]
