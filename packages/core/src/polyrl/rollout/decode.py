"""The ``hf`` rollout's own decode loop: a static KV cache and the model's weights called step by step.

transformers' ``forward`` spends a third of a small model's decode step in per-layer Python (attention
interface dispatch, mask building, cache bookkeeping, output dataclasses). :class:`StaticDecoder` runs the
same arithmetic as a Llama/Qwen2/Qwen3/Mistral-style decoder, reading the model's own parameters (so weight
updates land without a copy), with:

- the prompt prefill run once per distinct prompt (GRPO's group of samples shares it), and its keys and values
  kept once per prompt: at every step the samples of one prompt attend to them in one product, so the
  prompt's keys are read once per step, not once per sample (a shared-prefix "cascade" attention); a prompt
  no longer than the answer is instead copied into each row's cache (``StaticDecoder.share_prefix_above``);
- for 16-bit models the attention (cached keys and values, scores, softmax) in float32;
- the generated tokens' keys and values in a cache allocated once per batch (``[rows, kv_heads,
  max_new_tokens, head_dim]`` per layer) and written in place;
- attention for one query token as batched products over the kv heads (no repeat of the kv heads), the
  prompt's and the generated tokens' scores in one softmax;
- the linear layers as ``x @ W.T`` with ``W.T`` kept contiguous (faster for skinny products on CPU), in bfloat16
  with oneDNN's prepacked weights where the CPU has bf16 kernels (:class:`_Linear`);
- a rotary cos/sin table per batch, looked up per step; logits for the last position only.

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
    act = getattr(config, "hidden_act", "silu")
    if act != "silu":
        return f"hidden_act {act!r} is not silu"
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
    """One or more linear layers of the same input: their weights kept transposed (``[in, out]``, contiguous)
    beside the model's ``[out, in]`` ones, and in 16-bit dtypes side by side as one matrix.

    One core multiplies a skinny ``[rows, in]`` activation by a contiguous ``[in, out]`` matrix 1.3-1.8x faster
    than by the transposed view ``F.linear`` uses. In bfloat16 one product of the joined matrix (q, k and v; gate
    and up) is 15% faster than one per layer (16 rows, the small model's layers: 5.4 ms against 6.4 ms), which
    makes a whole ``generate`` call 1-3% faster; in float32 joining them made it 5% slower, so they stay apart
    there (measured on this project's CPU).
    In bfloat16 on a CPU with oneDNN's bf16 kernels the (joined) matrix is also kept in oneDNN's own blocked layout
    (:func:`_pack`): a product then skips the reorder oneDNN otherwise does on every call, 1.6-2.4x faster at 1 to
    200 rows (two cores of this project's CPU, the small model's shapes) with the same bits as ``F.linear``.
    The copies follow the model's parameters: :meth:`refresh` copies again when a parameter's version counter
    moved (every in-place write, ``HFRollout.update_weights`` included).
    """

    __slots__ = ("sources", "biases", "sizes", "weights", "bias", "versions", "packed")

    def __init__(self, *modules: Any) -> None:
        self.sources: tuple[torch.Tensor, ...] = tuple(m.weight for m in modules)
        self.biases: tuple[torch.Tensor | None, ...] = tuple(getattr(m, "bias", None) for m in modules)
        self.sizes = [int(w.shape[0]) for w in self.sources]
        self.weights: list[torch.Tensor] = []
        self.bias: list[torch.Tensor | None] = []
        self.versions: tuple[Any, ...] = ()
        self.packed = False

    def refresh(self) -> None:
        first = self.sources[0]
        versions = (first.device, first.dtype, *(t._version for t in (*self.sources, *self.biases) if t is not None))
        if versions == self.versions:
            return
        with torch.no_grad():
            weights = [w.detach().t() for w in self.sources]
            biases = [None if b is None else b.detach() for b in self.biases]
            if len(weights) > 1 and first.dtype in (torch.bfloat16, torch.float16):
                if any(b is not None for b in biases):
                    biases = [torch.cat([w.new_zeros(w.shape[0]) if b is None else b
                                         for w, b in zip(self.sources, biases)])]
                else:
                    biases = [None]
                weights = [torch.cat(weights, dim=1)]
            self.packed = len(weights) == 1 and _packs(first)
            self.weights = [_pack(w.t()) if self.packed else w.contiguous() for w in weights]
            self.bias = biases
        self.versions = versions

    @staticmethod
    def _product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if bias is None:
            return x @ weight
        return torch.addmm(bias, x.reshape(-1, x.shape[-1]), weight).view(*x.shape[:-1], -1)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The output of a single linear layer."""
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weights[0], self.bias[0], "none", [], "")
        return self._product(x, self.weights[0], self.bias[0])

    def split(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The outputs of each linear layer this one holds, in order."""
        if len(self.weights) == 1:
            return self(x).split(self.sizes, dim=-1)
        return tuple(self._product(x, w, b) for w, b in zip(self.weights, self.bias))


#: Whether oneDNN's prepacked linear (:func:`_pack`) gives ``F.linear``'s result here, per dtype (probed once).
_PACKED_OK: dict[torch.dtype, bool] = {}


def _packs(weight: torch.Tensor) -> bool:
    """Whether :class:`_Linear` keeps ``weight``'s matrix prepacked: bfloat16 on a CPU whose oneDNN has bf16 kernels
    (AMX or AVX512-BF16), where torch's ``mkldnn._reorder_linear_weight`` / ``mkldnn._linear_pointwise`` exist (the
    ops torch's own compiler uses for CPU linear layers) and give ``F.linear``'s result on a probe."""
    dtype = weight.dtype
    if weight.device.type != "cpu" or dtype != torch.bfloat16:
        return False
    if dtype not in _PACKED_OK:
        try:
            ok = torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
            if ok:
                gen = torch.Generator().manual_seed(0)
                w = torch.randn(48, 32, generator=gen).to(dtype)
                x, b = torch.randn(5, 32, generator=gen).to(dtype), torch.randn(48, generator=gen).to(dtype)
                got = torch.ops.mkldnn._linear_pointwise(x, _pack(w), b, "none", [], "")
                ok = torch.allclose(got.float(), F.linear(x, w, b).float(), rtol=1e-2, atol=1e-2)
        except (RuntimeError, AttributeError, NotImplementedError) as exc:
            logger.debug("decode loop: no prepacked bf16 linear layers (%s)", exc)
            ok = False
        _PACKED_OK[dtype] = ok
    return _PACKED_OK[dtype]


def _pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` (``[out, in]``) in oneDNN's blocked layout for :func:`torch.ops.mkldnn._linear_pointwise`."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), 32)


@dataclass
class _Layer:
    """One decoder layer: its norms (the model's own tensors) and linear layers (:class:`_Linear`; q, k and v
    joined, and gate and up)."""

    ln1: torch.Tensor
    eps1: float
    ln2: torch.Tensor
    eps2: float
    qkv: _Linear
    o: _Linear
    q_norm: tuple[torch.Tensor, float] | None
    k_norm: tuple[torch.Tensor, float] | None
    gate_up: _Linear
    down: _Linear

    def linears(self) -> tuple[_Linear, ...]:
        return self.qkv, self.o, self.gate_up, self.down


class StaticDecoder:
    """Prefill and decode of a supported causal LM (:func:`supports`) over a preallocated KV cache.

    Reads the model's own parameters (the linear layers through transposed copies that follow every in-place
    write, :class:`_Linear`), so :meth:`HFRollout.update_weights` is seen by the next batch. :meth:`start`
    prefills a batch and returns its :class:`DecodeBatch`; then :meth:`DecodeBatch.step` per generated token and
    :meth:`DecodeBatch.keep` to drop finished rows.
    """

    #: prompts wider than this many tokens keep their keys and values once per prompt (the shared-prefix
    #: products, :meth:`DecodeBatch.step`); narrower ones are copied to each of their rows, in front of the
    #: generated tokens', and a step attends to one cache per row in two products instead of four plus the
    #: reshapes around them. ``None``: the batch's ``max_new_tokens`` (a prompt no longer than the answer)
    share_prefix_above: int | None = None

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
        #: attention (scores, softmax, the cached keys and values) in float32 for 16-bit models: a CPU core's
        #: batched products of these shapes are 2.5-3.5x faster in float32 than in bfloat16, and the actor's
        #: attention under autocast is float32 too (``polyrl_sdpa_float32``)
        self.attn_dtype = torch.float32 if self.embed.dtype in (torch.bfloat16, torch.float16) else self.embed.dtype

    @staticmethod
    def _layer(layer: Any) -> _Layer:
        attn, mlp = layer.self_attn, layer.mlp

        def norm(m: Any) -> tuple[torch.Tensor, float] | None:
            return None if m is None else (m.weight, _eps(m))  # type: ignore[return-value]

        return _Layer(
            ln1=layer.input_layernorm.weight, eps1=_eps(layer.input_layernorm),  # type: ignore[arg-type]
            ln2=layer.post_attention_layernorm.weight, eps2=_eps(layer.post_attention_layernorm),  # type: ignore[arg-type]
            qkv=_Linear(attn.q_proj, attn.k_proj, attn.v_proj), o=_Linear(attn.o_proj),
            q_norm=norm(getattr(attn, "q_norm", None)), k_norm=norm(getattr(attn, "k_norm", None)),
            gate_up=_Linear(mlp.gate_proj, mlp.up_proj), down=_Linear(mlp.down_proj),
        )

    # ------------------------------------------------------------------ prefill
    def start(self, ids: torch.Tensor, mask: torch.Tensor, expand: torch.Tensor | None,
              max_new_tokens: int) -> tuple[DecodeBatch, torch.Tensor, torch.Tensor]:
        """Prefill left-padded prompts ``ids`` ``[U, W]`` (``mask`` 1 on tokens) and set up a cache for
        ``len(expand)`` rows (row ``i`` continues prompt ``expand[i]``; ``None``: one row per prompt) with room
        for ``max_new_tokens``. Returns the batch's state (:class:`DecodeBatch`: its own, so concurrent calls do not
        share one), the rows' next-token logits ``[rows, vocab]`` (float32) and their next positions ``[rows]``."""
        u, width = ids.shape
        dtype, device = self.embed.dtype, ids.device
        adt = self.attn_dtype
        state = DecodeBatch(self)
        for linear in self._linears:
            linear.refresh()
        position = (mask.cumsum(-1) - 1).clamp(min=0)
        x = F.embedding(ids, self.embed)
        if self._rope_table:  # cos/sin of every position this batch reaches, looked up per step
            span = torch.arange(width + max_new_tokens, device=device)[None]
            state.cos, state.sin = (t[0] for t in self.rotary(x, span))
            cos, sin = state.cos[position], state.sin[position]
        else:
            cos, sin = self.rotary(x, position)
        cos, sin = cos[:, None], sin[:, None]  # [U, 1, W, D]
        valid = mask.bool()
        causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()
        # a padding query attends to itself only (its output is never used; no all-masked softmax row)
        allowed = (causal[None] & valid[:, None, :]) | torch.eye(width, dtype=torch.bool, device=device)[None]
        attn_mask = allowed[:, None]  # [U, 1, W, W]
        d, hq, hkv = self.head_dim, self.n_heads, self.n_kv
        for layer in self.layers:
            h = _rms_norm(x, layer.ln1, layer.eps1)
            q, k, v = layer.qkv.split(h)
            q = q.view(u, width, hq, d).transpose(1, 2)
            k = k.view(u, width, hkv, d).transpose(1, 2)
            v = v.view(u, width, hkv, d).transpose(1, 2)
            if layer.q_norm is not None:
                q = _rms_norm(q, *layer.q_norm)
            if layer.k_norm is not None:
                k = _rms_norm(k, *layer.k_norm)
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
            q, k, v = q.to(adt), k.to(adt).contiguous(), v.to(adt).contiguous()
            state.prefix_k.append(k)
            state.prefix_v.append(v)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=self.scaling,
                                                 enable_gqa=hq != hkv)
            out = out.transpose(1, 2).reshape(u, width, hq * d).to(dtype)
            x = x + layer.o(out)
            x = x + self._mlp(layer, _rms_norm(x, layer.ln2, layer.eps2))
        logits = self._logits(x[:, -1])  # left padding: every prompt ends in the last column
        state.prefix_bias = torch.zeros(u, 1, 1, width, dtype=adt, device=device).masked_fill_(
            ~valid[:, None, None, :], float("-inf"))
        next_pos = position[:, -1] + 1
        # each row's slot: its prompt's block of ``group`` slots, in the order the rows come
        owner = torch.arange(u, device=device) if expand is None else expand
        counts = torch.bincount(owner, minlength=u)
        state.group = int(counts.max())
        seen: dict[int, int] = {}
        rank = []
        for o in owner.tolist():
            rank.append(seen.get(o, 0))
            seen[o] = rank[-1] + 1
        state.slot = owner * state.group + torch.tensor(rank, dtype=torch.long, device=device)
        state.dense = owner.numel() == u * state.group and bool((state.slot == torch.arange(
            owner.numel(), device=device)).all())
        rows = owner.numel()
        above = max_new_tokens if self.share_prefix_above is None else self.share_prefix_above
        if width <= above:  # one cache per row: [rows, kv, W + max_new_tokens, D], the prompt's part copied in
            state.width = width
            state.suffix_k = [torch.cat([pk[owner], pk.new_empty(rows, hkv, max_new_tokens, d)], dim=2)
                              for pk in state.prefix_k]
            state.suffix_v = [torch.cat([pv[owner], pv.new_empty(rows, hkv, max_new_tokens, d)], dim=2)
                              for pv in state.prefix_v]
            state.row_bias = None if bool(valid.all()) else F.pad(state.prefix_bias[owner], (0, max_new_tokens))
            state.prefix_k, state.prefix_v = [], []
        else:
            state.suffix_k = [torch.empty(rows, hkv, max_new_tokens, d, dtype=adt, device=device) for _ in self.layers]
            state.suffix_v = [torch.empty_like(t) for t in state.suffix_k]
        if expand is not None:
            logits, next_pos = logits[expand], next_pos[expand]
        return state, logits, next_pos

    # ------------------------------------------------------------------ pieces
    @staticmethod
    def _mlp(layer: _Layer, h: torch.Tensor) -> torch.Tensor:
        gate, up = layer.gate_up.split(h)
        return layer.down(F.silu(gate) * up)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        h = _rms_norm(x, self.norm, self.norm_eps)  # type: ignore[arg-type]
        return self.lm_head(h).float()


class DecodeBatch:
    """One batch being decoded by a :class:`StaticDecoder` (from :meth:`StaticDecoder.start`): the prompts' keys
    and values once per distinct prompt (the prefix), the generated tokens' per row (the suffix, preallocated
    for ``max_new_tokens``), and each row's slot in the ``[prompts x samples]`` layout, so a prompt's keys are
    read once per step for all its samples."""

    def __init__(self, decoder: StaticDecoder) -> None:
        self.decoder = decoder
        self.prefix_k: list[torch.Tensor] = []  # [U, kv, W, D] per layer
        self.prefix_v: list[torch.Tensor] = []
        self.prefix_bias = torch.empty(0)  # [U, 1, 1, W]: 0 on a prompt's tokens, -inf on its left padding
        self.suffix_k: list[torch.Tensor] = []  # [rows, kv, max_new_tokens, D] per layer
        self.suffix_v: list[torch.Tensor] = []
        self.length = 0  # suffix columns filled
        self.slot = torch.empty(0, dtype=torch.long)  # row -> prompt * group + its index among the prompt's rows
        self.group = 1  # the most rows of one prompt
        self.dense = True  # rows are exactly the slots, in order (no scatter / gather around the prefix products)
        self.cos = self.sin = torch.empty(0)  # rotary table of the positions the batch reaches
        #: prompt columns at the front of each row's cache (``suffix_k``/``suffix_v``) when the prompt's keys are
        #: copied to every row (no prefix products); 0: kept once per prompt in ``prefix_k``/``prefix_v``
        self.width = 0
        self.row_bias: torch.Tensor | None = None  # [rows, 1, 1, W + max_new_tokens] with ``width``: left padding

    def step(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Append one token per row (``tokens`` ``[rows]`` at ``positions`` ``[rows]``) and return the next
        logits ``[rows, vocab]`` (float32)."""
        dec = self.decoder
        rows = tokens.shape[0]
        d, hq, hkv = dec.head_dim, dec.n_heads, dec.n_kv
        col = self.length + self.width
        if col >= self.suffix_k[0].shape[2]:
            raise RuntimeError("StaticDecoder: the KV cache is full (more steps than start()'s max_new_tokens)")
        self.length += 1
        x = F.embedding(tokens, dec.embed)  # [rows, hidden]
        if dec._rope_table:
            cos, sin = self.cos[positions][:, None], self.sin[positions][:, None]  # [rows, 1, D]
        else:
            cos, sin = dec.rotary(x, positions[:, None])
        width = self.prefix_bias.shape[-1]
        nq, nqk = hq * d, (hq + hkv) * d
        for i, layer in enumerate(dec.layers):
            h = _rms_norm(x, layer.ln1, layer.eps1)
            if len(layer.qkv.weights) == 1 and layer.q_norm is None and layer.k_norm is None:
                # q and k side by side in the joined product's output: one rotation for both
                qkv = layer.qkv(h)
                qk = _rotate(qkv[:, :nqk].view(rows, hq + hkv, d), cos, sin)
                q, k = qk[:, :hq].view(rows, hkv, hq // hkv, d), qk[:, hq:].view(rows, hkv, 1, d)
                v = qkv[:, nqk:].view(rows, hkv, 1, d)
            else:
                q, k, v = layer.qkv.split(h)
                q = q.view(rows, hkv, hq // hkv, d)
                k = k.view(rows, hkv, 1, d)
                v = v.view(rows, hkv, 1, d)
                if layer.q_norm is not None:
                    q = _rms_norm(q, *layer.q_norm)
                if layer.k_norm is not None:
                    k = _rms_norm(k, *layer.k_norm)
                c4, s4 = cos[:, :, None], sin[:, :, None]  # broadcast over heads: [rows, 1, 1, D]
                q, k = _rotate(q, c4, s4), _rotate(k, c4, s4)
            q = q.to(dec.attn_dtype) * dec.scaling
            sk, sv = self.suffix_k[i], self.suffix_v[i]
            sk[:, :, col : col + 1] = k
            sv[:, :, col : col + 1] = v
            sk, sv = sk[:, :, : col + 1], sv[:, :, : col + 1]
            if self.width:  # the prompt's keys in each row's cache: [rows, kv, heads per kv, D] x [rows, kv, D, W + t]
                scores = torch.matmul(q, sk.transpose(-1, -2))
                if self.row_bias is not None:
                    scores = scores + self.row_bias[..., : col + 1]
                out = torch.matmul(torch.softmax(scores, dim=-1), sv)
            else:
                # the prompt's keys are read once for all its rows: [U, kv, group x heads per kv, D] x [U, kv, D, W]
                prefix_scores = self._from_slots(torch.matmul(self._to_slots(q), self.prefix_k[i].transpose(-1, -2))
                                                 + self.prefix_bias, width)
                # the generated tokens' keys, per row: [rows, kv, heads per kv, D] x [rows, kv, D, t]
                suffix_scores = torch.matmul(q, sk.transpose(-1, -2))
                probs = torch.softmax(torch.cat([prefix_scores, suffix_scores], dim=-1), dim=-1)
                out = torch.matmul(self._to_slots(probs[..., :width]), self.prefix_v[i])
                out = self._from_slots(out, d) + torch.matmul(probs[..., width:], sv)
            x = x + layer.o(out.reshape(rows, nq).to(x.dtype))
            x = x + dec._mlp(layer, _rms_norm(x, layer.ln2, layer.eps2))
        return dec._logits(x)

    def _to_slots(self, t: torch.Tensor) -> torch.Tensor:
        """``[rows, kv, g, C]`` -> ``[U, kv, group * g, C]``: each prompt's rows side by side (empty slots zero)."""
        _, kv, g, c = t.shape
        u = self.prefix_bias.shape[0]
        if not self.dense:
            full = t.new_zeros(u * self.group, kv, g, c)
            full[self.slot] = t
            t = full
        return t.view(u, self.group, kv, g, c).transpose(1, 2).reshape(u, kv, self.group * g, c)

    def _from_slots(self, t: torch.Tensor, c: int) -> torch.Tensor:
        """The inverse of :meth:`_to_slots`: ``[U, kv, group * g, C]`` -> ``[rows, kv, g, C]``."""
        u, kv = t.shape[:2]
        t = t.view(u, kv, self.group, -1, c).transpose(1, 2).reshape(u * self.group, kv, -1, c)
        return t if self.dense else t[self.slot]

    def keep(self, rows: torch.Tensor) -> None:
        """Keep only ``rows`` (indices into the current rows) in the cache, in that order."""
        self.suffix_k = [c.index_select(0, rows) for c in self.suffix_k]
        self.suffix_v = [c.index_select(0, rows) for c in self.suffix_v]
        if self.row_bias is not None:
            self.row_bias = self.row_bias.index_select(0, rows)
        self.slot = self.slot[rows]
        self.dense = False

    def release(self) -> None:
        """Free the batch's cache."""
        self.prefix_k, self.prefix_v, self.suffix_k, self.suffix_v = [], [], [], []
        self.prefix_bias = self.cos = self.sin = torch.empty(0)
        self.row_bias = None


__all__ = ["SUPPORTED_MODEL_TYPES", "DecodeBatch", "StaticDecoder", "supports"]
