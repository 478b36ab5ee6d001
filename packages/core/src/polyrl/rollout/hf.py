"""``hf``: the embedded rollout, transformers generation on token ids with per-token log-probs.

Vision-language models (Qwen2-VL, Qwen2.5-VL) generate from images too: requests whose ``multi_modal`` holds
processed images take :meth:`HFRollout._generate_batch_multimodal`, beside the text path.

Slow next to vLLM on a GPU, but it needs nothing beyond transformers, runs
anywhere, and is exact: it samples from the very model the trainer trains.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from polyrl.models.kv_cache import cache_kwargs, new_cache
from polyrl.platforms.precision import warn_if_slow_dtype
from polyrl.protocols import GenerationRequest, GenerationResult, RolloutCapabilities, SamplingParams
from polyrl.rollout.decode import StaticDecoder, supports
from polyrl.rollout.limits import check_model_length

logger = logging.getLogger("polyrl")


class HFRollout:
    """Batched sampling with a KV cache; log-probs under the temperature-scaled distribution.

    The log-prob of a sampled token is taken from ``log_softmax(logits / T)`` before
    top-p / top-k filtering (vLLM's default "raw" log-probs), which is what the
    trainer recomputes. ``temperature=0`` is greedy (log-probs at ``T=1``).
    """

    capabilities = RolloutCapabilities(sleep=False, async_generate=False, log_probs=True)

    def __init__(self, config: Any, *, model_path: str, tokenizer: Any, platform: Any = None) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.device = platform.current_device() if platform is not None else torch.device("cpu")
        dtype = getattr(torch, getattr(config, "dtype", "float32"))
        warn_if_slow_dtype(dtype, self.device, "rollout.dtype")
        self.model = _load_model(model_path, dtype).to(self.device).eval()
        #: A vision-language model's image token and patch merge (``None``: a text-only model).
        self.vision = _vision_tokens(self.model.config)
        self.max_model_len = config.max_model_len or self.model.config.get_text_config().max_position_embeddings
        self.max_batch_size = getattr(config, "max_batch_size", 64)
        self.eos_ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        # remove_duplicate=False: a tied lm_head is reachable under both of its names
        self._params = dict(self.model.named_parameters(remove_duplicate=False))
        self._keeps_logits = "logits_to_keep" in inspect.signature(self.model.forward).parameters
        #: Prefill each distinct prompt of a batch once (False: one prefill row per sample, for comparison).
        self.share_prefill = True
        #: polyrl's own decode loop (:mod:`polyrl.rollout.decode`) where the model is one it runs, else ``None``
        #: (transformers' forward step by step); set it to ``None`` to compare.
        self.decoder: StaticDecoder | None = None
        choice = os.environ.get("POLYRL_HF_DECODE", "static")
        if choice not in ("static", "transformers"):
            raise ValueError(f"POLYRL_HF_DECODE={choice!r}: use 'static' (polyrl's decode loop, the default) or "
                             "'transformers' (transformers' forward step by step)")
        if self.vision is None and choice == "static":
            reason = supports(self.model)
            if reason is None:
                self.decoder = StaticDecoder(self.model)
            else:
                logger.debug("hf rollout: transformers' forward decodes %s (%s)", type(self.model).__name__, reason)
        #: Finished rows leave the batch (a copy of the KV cache) once fewer than this fraction of its rows
        #: are still generating; until then they ride along, masked (1.0: drop at every finish, 0: never).
        self.compact_below = 0.75

    # ------------------------------------------------------------------ generation
    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        """``n`` results per request, flattened in request order; ``ValueError`` if one exceeds the model length."""
        check_model_length(requests, self.max_model_len)
        expanded = [(req, k) for req in requests for k in range(req.sampling_params.n)]
        # one generator per call, seeded by the first seeded request: consecutive chunks continue
        # its stream instead of replaying it (identical prompts in two chunks must not get identical samples)
        seed = next((r.sampling_params.seed for r in requests if r.sampling_params.seed is not None), None)
        generator = torch.Generator(device=self.device)
        generator.manual_seed(seed if seed is not None else int(torch.randint(0, 2**31, (1,))))
        results: list[GenerationResult] = []
        # Requests with the same sampling params are generated together.
        start = 0
        while start < len(expanded):
            params = expanded[start][0].sampling_params
            images = _has_images(expanded[start][0])  # requests with images take the multimodal path
            end = start
            while end < len(expanded) and end - start < self.max_batch_size and expanded[end][0].sampling_params == params \
                    and _has_images(expanded[end][0]) == images:
                end += 1
            run = self._generate_batch_multimodal if images else \
                self._generate_batch_static if self.decoder is not None else self._generate_batch
            results += run(expanded[start:end], params, generator)
            start = end
        return results

    @torch.inference_mode()
    def _generate_batch(self, items: list[tuple[GenerationRequest, int]], params: SamplingParams,
                        generator: torch.Generator) -> list[GenerationResult]:
        # Identical prompts (GRPO's n samples of one prompt) are prefilled once; their KV cache is then
        # copied to every sample (the cache's beam-search reorder, which every HF cache implements).
        prompts, ids, mask, expand, stop_t = self._prompt_batch(items, params)
        b = len(prompts)
        out_tokens = torch.full((b, params.max_new_tokens), self.pad_id, dtype=torch.long, device=self.device)
        out_logp = torch.zeros((b, params.max_new_tokens), dtype=torch.float32, device=self.device)
        lengths = torch.zeros(b, dtype=torch.long, device=self.device)
        stopped = torch.zeros(b, dtype=torch.bool, device=self.device)
        position = (mask.cumsum(-1) - 1).clamp(min=0)
        # our own cache object, filled in place by every forward (never read back from the output, whose field
        # transformers renamed): polyrl.models.kv_cache
        past = new_cache(self.model)
        cached = cache_kwargs(self.model, past)
        cur_ids, cur_pos, attn = ids, position, mask
        # Rows still generating (indices into the batch); finished rows leave the batch and its KV cache,
        # so the tail of a batch with mixed lengths costs what its live rows cost.
        live = torch.arange(b, device=self.device)
        extra = {"logits_to_keep": 1} if self._keeps_logits else {}  # no [prompt x vocab] logits at prefill
        for t in range(params.max_new_tokens):
            out = self.model(input_ids=cur_ids, attention_mask=attn, position_ids=cur_pos, use_cache=True, **cached,
                             **extra)
            logits = out.logits[:, -1, :].float()
            if t == 0 and expand is not None:  # one prefilled row per distinct prompt -> one row per sample
                past.reorder_cache(expand)
                logits, cur_pos, attn = logits[expand], cur_pos[expand], attn[expand]
            token, logp = _sample(logits, params, generator)
            out_tokens[live, t] = token
            out_logp[live, t] = logp
            lengths[live] += 1
            hit = torch.isin(token, stop_t) if stop_t is not None else torch.zeros_like(token, dtype=torch.bool)
            stopped[live] |= hit
            if bool(hit.any()):
                keep = (~hit).nonzero().squeeze(-1)
                if keep.numel() == 0:
                    break
                live, token, cur_pos, attn = live[keep], token[keep], cur_pos[keep], attn[keep]
                past.reorder_cache(keep)
            cur_ids = token.unsqueeze(-1)
            cur_pos = cur_pos[:, -1:] + 1
            attn = torch.cat([attn, torch.ones_like(attn[:, :1])], dim=-1)
        return self._results(items, prompts, out_tokens, out_logp, lengths, stopped, params)

    @torch.inference_mode()
    def _generate_batch_static(self, items: list[tuple[GenerationRequest, int]], params: SamplingParams,
                               generator: torch.Generator) -> list[GenerationResult]:
        """:meth:`_generate_batch` through :class:`~polyrl.rollout.decode.StaticDecoder`: one prefill per
        distinct prompt, then one token per live row per step over a preallocated KV cache."""
        assert self.decoder is not None
        prompts, ids, mask, expand, stop_t = self._prompt_batch(items, params)
        b, steps = len(prompts), params.max_new_tokens
        out_tokens = torch.full((b, steps), self.pad_id, dtype=torch.long, device=self.device)
        out_logp = torch.zeros((b, steps), dtype=torch.float32, device=self.device)
        lengths = torch.zeros(b, dtype=torch.long, device=self.device)
        stopped = torch.zeros(b, dtype=torch.bool, device=self.device)
        state, logits, pos = self.decoder.start(ids, mask, expand, steps)
        try:
            rows = torch.arange(b, device=self.device)  # the batch index of each cache row
            alive = torch.ones(b, dtype=torch.bool, device=self.device)
            n_alive = b
            for t in range(steps):
                token, logp = _sample(logits, params, generator)
                if n_alive == rows.numel():  # every row generating: no masking
                    out_tokens[rows, t] = token
                    out_logp[rows, t] = logp
                    lengths[rows] += 1
                else:
                    live = rows[alive]
                    out_tokens[live, t] = token[alive]
                    out_logp[live, t] = logp[alive]
                    lengths[live] += 1
                if stop_t is None:
                    hit_any = False
                else:
                    hit = torch.isin(token, stop_t) & alive
                    hit_any = bool(hit.any())
                if hit_any:
                    stopped[rows[hit]] = True
                    alive &= ~hit
                    n_alive = int(alive.sum())
                    if n_alive == 0:
                        break
                    if n_alive < self.compact_below * rows.numel():
                        keep = alive.nonzero().squeeze(-1)
                        state.keep(keep)
                        rows, token, pos, alive = rows[keep], token[keep], pos[keep], alive[keep]
                if t + 1 < steps:
                    logits = state.step(token, pos)
                    pos = pos + 1
        finally:
            state.release()
        return self._results(items, prompts, out_tokens, out_logp, lengths, stopped, params)

    def _prompt_batch(self, items: list[tuple[GenerationRequest, int]], params: SamplingParams
                      ) -> tuple[list[list[int]], torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """The requests' prompts; the left-padded ids and mask to prefill (one row per distinct prompt where
        ``share_prefill``); ``expand`` (each sample's prefilled row, ``None`` when every row is its own); the
        stop token ids (``None``: none)."""
        prompts = [list(req.prompt_ids) for req, _ in items]
        first: dict[tuple[int, ...], int] = {}
        owner = [first.setdefault(tuple(p), len(first)) for p in prompts]
        unique = [list(p) for p in first] if self.share_prefill else prompts
        expand = torch.tensor(owner, device=self.device) if self.share_prefill and len(unique) < len(prompts) else None
        width = max(len(p) for p in unique)
        ids = torch.full((len(unique), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(unique):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        stop = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_ids)
        stop_t = torch.tensor(sorted(stop), device=self.device) if stop else None
        return prompts, ids.to(self.device), mask.to(self.device), expand, stop_t

    def _results(self, items: list[tuple[GenerationRequest, int]], prompts: list[list[int]], out_tokens: torch.Tensor,
                 out_logp: torch.Tensor, lengths: torch.Tensor, stopped: torch.Tensor,
                 params: SamplingParams) -> list[GenerationResult]:
        tokens, logps = out_tokens.tolist(), out_logp.tolist() if params.logprobs else None
        n, stops = lengths.tolist(), stopped.tolist()
        return [GenerationResult(
            prompt_ids=prompts[i], response_ids=tokens[i][: n[i]], log_probs=logps[i][: n[i]] if logps else [],
            finish_reason="stop" if stops[i] else "length", request_id=req.request_id, sample_index=k)
            for i, (req, k) in enumerate(items)]

    @torch.inference_mode()
    def _generate_batch_multimodal(self, items: list[tuple[GenerationRequest, int]], params: SamplingParams,
                                   generator: torch.Generator) -> list[GenerationResult]:
        """:meth:`_generate_batch` for prompts with images (``request.multi_modal``: the processed images of
        :class:`polyrl.data.multimodal.ImageInputs`). The prefill runs the vision tower on each distinct
        (prompt, images) pair once, with Qwen-VL's M-RoPE positions ``[3, b, L]``; decoding continues the
        text positions after each prompt's last."""
        from polyrl.data.multimodal import mrope_position_ids

        if self.vision is None:
            raise ValueError("hf rollout: a request has images but the model is text-only")
        prompts = [list(req.prompt_ids) for req, _ in items]
        first: dict[tuple[Any, ...], int] = {}
        owner = [first.setdefault((tuple(p), req.multi_modal["key"]), len(first)) for p, (req, _) in zip(prompts, items)]
        if not self.share_prefill:
            owner = list(range(len(items)))
        lead = [owner.index(u) for u in range(max(owner) + 1)]  # the first item of each distinct prompt
        expand = torch.tensor(owner, device=self.device) if len(lead) < len(items) else None
        width = max(len(prompts[i]) for i in lead)
        ids = torch.full((len(lead), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, i in enumerate(lead):
            ids[row, width - len(prompts[i]):] = torch.tensor(prompts[i])
            mask[row, width - len(prompts[i]):] = 1
        grids = [items[i][0].multi_modal["image_grid_thw"] for i in lead]
        position = torch.stack([mrope_position_ids(ids[row], mask[row], grids[row], **self.vision)
                                for row in range(len(lead))], dim=1)  # [3, U, width]
        images = {"pixel_values": torch.cat([items[i][0].multi_modal["pixel_values"] for i in lead]).to(self.device),
                  "image_grid_thw": torch.cat(grids).to(self.device)}
        ids, mask, position = ids.to(self.device), mask.to(self.device), position.to(self.device)
        stop = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_ids)
        stop_t = torch.tensor(sorted(stop), device=self.device) if stop else None
        b = len(items)
        out_tokens = torch.full((b, params.max_new_tokens), self.pad_id, dtype=torch.long, device=self.device)
        out_logp = torch.zeros((b, params.max_new_tokens), dtype=torch.float32, device=self.device)
        lengths = torch.zeros(b, dtype=torch.long, device=self.device)
        stopped = torch.zeros(b, dtype=torch.bool, device=self.device)
        live = torch.arange(b, device=self.device)
        past = None
        cur_ids, cur_pos, attn, extra = ids, position, mask, {"logits_to_keep": 1, **images}
        for t in range(params.max_new_tokens):
            out = self.model(input_ids=cur_ids, attention_mask=attn, position_ids=cur_pos, past_key_values=past,
                             use_cache=True, **extra)
            past, extra = out.past_key_values, {"logits_to_keep": 1}  # the images enter at the prefill only
            logits = out.logits[:, -1, :].float()
            if t == 0 and expand is not None:  # one prefilled row per distinct prompt -> one row per sample
                past.reorder_cache(expand)
                logits, cur_pos, attn = logits[expand], cur_pos[:, expand], attn[expand]
            token, logp = _sample(logits, params, generator)
            out_tokens[live, t] = token
            out_logp[live, t] = logp
            lengths[live] += 1
            hit = torch.isin(token, stop_t) if stop_t is not None else torch.zeros_like(token, dtype=torch.bool)
            stopped[live] |= hit
            if bool(hit.any()):
                keep = (~hit).nonzero().squeeze(-1)
                if keep.numel() == 0:
                    break
                live, token, cur_pos, attn = live[keep], token[keep], cur_pos[:, keep], attn[keep]
                past.reorder_cache(keep)
            cur_ids = token.unsqueeze(-1)
            cur_pos = cur_pos[..., -1:] + 1  # a prompt ends in text: the next token is one further on every axis
            attn = torch.cat([attn, torch.ones_like(attn[:, :1])], dim=-1)
        return self._results(items, prompts, out_tokens, out_logp, lengths, stopped, params)

    async def agenerate(self, request: GenerationRequest) -> list[GenerationResult]:
        """``generate([request])`` in a worker thread (no native async engine: prefer ``BatchingClient``)."""
        return await asyncio.to_thread(self.generate, [request])

    # ------------------------------------------------------------------ weights
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors in; every name and shape is checked before any weight changes.

        Names are the model's parameters' or its checkpoint's: a mixture of experts' per-expert tensors (what
        checkpoints, vLLM and the megatron engine use) go into the experts transformers fuses in memory.
        """
        staged = []
        for name, tensor in named_tensors:
            param, where = self._params.get(name), None
            if param is None and self._checkpoint_names() is not None and name in self._checkpoint_names():
                param, where = self._checkpoint_names().locate(name)
                shape = self._checkpoint_names().shape(name)
            elif param is not None:
                shape = tuple(param.shape)
            else:
                raise KeyError(f"hf rollout: weight '{name}' matches no parameter of the model")
            if shape != tuple(tensor.shape):
                raise ValueError(f"hf rollout: weight '{name}' has shape {tuple(tensor.shape)}, the model's is {shape}")
            staged.append((param, where, tensor))
        with torch.no_grad():  # checked everything first: a bad bucket changes nothing
            for param, where, tensor in staged:
                if where is None:
                    param.copy_(tensor)  # casts and moves in one pass (a .to() first wrote a temporary: 27% slower)
                else:
                    param.view(-1)[where.to(param.device)] = tensor.reshape(-1).to(param.device, param.dtype)

    def _checkpoint_names(self) -> Any:
        """The model's checkpoint-name map (``polyrl.models.hf_names``), built on first use; ``None`` when its
        checkpoint names are its parameter names."""
        if not hasattr(self, "_ckpt_names"):
            from polyrl.models.hf_names import CheckpointNameMap

            names = CheckpointNameMap(self.model)
            self._ckpt_names = names if any(n not in self._params for n in names) else None
        return self._ckpt_names

    def sleep(self, level: int = 1) -> None:
        """No-op: the HF model has no separate KV-cache pool to release."""

    def wake_up(self) -> None:
        """No-op."""

    def shutdown(self) -> None:
        """No-op: the model is freed with the rollout (no engine processes to stop)."""


def _load_model(model_path: str, dtype: torch.dtype) -> Any:
    """The model at ``model_path``: a causal LM, or a vision-language model (its config has a ``vision_config``)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    config = AutoConfig.from_pretrained(model_path)
    cls = AutoModelForImageTextToText if getattr(config, "vision_config", None) is not None else AutoModelForCausalLM
    return cls.from_pretrained(model_path, dtype=dtype)


def _vision_tokens(config: Any) -> dict[str, int] | None:
    """``image_token_id`` and ``spatial_merge_size`` of a Qwen-VL config (``None`` for a text-only model)."""
    vision = getattr(config, "vision_config", None)
    if vision is None:
        return None
    return {"image_token_id": int(config.image_token_id), "spatial_merge_size": int(vision.spatial_merge_size)}


def _has_images(request: GenerationRequest) -> bool:
    return bool(request.multi_modal) and request.multi_modal.get("pixel_values") is not None


def _sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row; return it and its log-prob before top-p/top-k filtering."""
    if params.temperature <= 0:
        token = logits.argmax(-1)
        return token, torch.log_softmax(logits, -1).gather(-1, token[:, None]).squeeze(-1)
    scaled = logits / params.temperature if params.temperature != 1.0 else logits  # x / 1 is x: no pass over it
    logp_full = torch.log_softmax(scaled, -1)
    filtered = scaled
    if params.top_k and params.top_k > 0:
        kth = torch.topk(filtered, min(params.top_k, filtered.shape[-1]), dim=-1).values[:, -1:]
        filtered = filtered.masked_fill(filtered < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(filtered, descending=True, dim=-1)
        probs = torch.softmax(sorted_logits, -1)
        remove = probs.cumsum(-1) - probs > params.top_p
        sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
        filtered = torch.full_like(filtered, float("-inf")).scatter(-1, order, sorted_logits)
    token = draw(torch.softmax(filtered, -1), generator)
    return token, logp_full.gather(-1, token[:, None]).squeeze(-1)


#: :func:`draw` splits a vocabulary wider than this into blocks of this many entries.
DRAW_BLOCK = 1024


def draw(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One index per row of ``probs`` ``[b, V]``, index ``v`` with probability ``probs[:, v]`` (rows sum to 1).

    Inverse transform sampling: the first index whose running sum (in float64) exceeds a uniform draw scaled to
    the row's total, so a zero-probability entry is never drawn. One random number per row, where
    ``torch.multinomial`` draws one exponential per entry of the vocabulary (on a CPU core 1.8 ms against 0.12 ms
    for 256 rows of 262 entries, a draw per decoded token).

    A vocabulary wider than :data:`DRAW_BLOCK` is cut into blocks of that many entries: the draw picks a block
    by the running sum of the blocks' totals (each summed in float64), then an entry by the running sum inside
    that block alone, so the float64 running sum covers ``V / DRAW_BLOCK + DRAW_BLOCK`` entries a row instead of
    ``V`` and no ``[b, V]`` float64 copy is made. The blocks' totals are float32 sums (their rounding, about
    1e-7 of a block's mass, is that of the float32 probabilities themselves); a zero-probability entry is still
    never drawn. On the real model's 49,152-token vocabulary the flat float64 running sum took 14-22 ms a decode
    step at 32 rows on one loaded core (its 12.6 MB float64 temporary, fresh pages each step) against 11 ms for the
    LM head (issue 48, docs/benchmarks.md)."""
    b, width = probs.shape
    if width <= 2 * DRAW_BLOCK:
        cdf = probs.to(torch.float64).cumsum(-1)
        u = torch.rand(b, 1, generator=generator, dtype=torch.float64, device=probs.device) * cdf[:, -1:]
        return _first_above(cdf, u)
    blocks = -(-width // DRAW_BLOCK)
    if blocks * DRAW_BLOCK != width:
        probs = torch.nn.functional.pad(probs, (0, blocks * DRAW_BLOCK - width))
    grid = probs.reshape(b, blocks, DRAW_BLOCK)
    # the blocks' totals in float32 (a float64 sum would first copy [b, V] to float64: at 32 rows a 12.6 MB
    # temporary, whose fresh pages cost more than the sum) and their running sum in float64
    ends = grid.sum(-1).to(torch.float64).cumsum(-1)  # [b, blocks]: the running sum at each block's end
    u = torch.rand(b, 1, generator=generator, dtype=torch.float64, device=probs.device) * ends[:, -1:]
    block = _first_above(ends, u)  # [b]
    rows = torch.arange(b, device=probs.device)
    start = torch.where(block > 0, ends[rows, (block - 1).clamp(min=0)], torch.zeros_like(u[:, 0]))
    inner = grid[rows, block].to(torch.float64).cumsum(-1)  # [b, DRAW_BLOCK]
    entry = _first_above(inner, (u[:, 0] - start)[:, None])
    return (block * DRAW_BLOCK + entry).clamp_(max=width - 1)


def _first_above(cdf: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row, the first index whose running sum ``cdf`` ``[b, n]`` exceeds ``u`` ``[b, 1]``; never past the last
    entry that adds to the sum (rounding may put ``u`` at or past the row's total: the draw then stays on an entry
    of nonzero probability)."""
    last = torch.searchsorted(cdf, cdf[:, -1:].contiguous(), right=False)  # the first index reaching the total
    return torch.minimum(torch.searchsorted(cdf, u, right=True), last).squeeze(-1)
