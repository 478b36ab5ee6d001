"""Translation between polyrl's generation protocol and SGLang's offline-engine API (pure: no SGLang import).

SGLang takes a batch as parallel lists (``input_ids``, ``sampling_params`` dicts) and answers with one dict per
input: ``output_ids`` and ``meta_info`` (``finish_reason`` ``{"type": "stop" | "length" | "abort", ...}`` and,
with ``return_logprob``, ``output_token_logprobs`` as ``(logprob, token_id, text)`` triples). A request's ``n``
samples are sent as ``n`` inputs with ``n=1`` each: SGLang wants one ``n`` for a whole batch, and a seed per
sample keeps a GRPO group from sampling the same text. A vision-language model's images travel as
``image_data`` (one list per input), beside ``input_ids`` that already hold the expanded image tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from polyrl.protocols import GenerationRequest, GenerationResult, SamplingParams
from polyrl.rollout.weights import request_seed


@dataclass(frozen=True)
class EngineInput:
    """One SGLang input: sample ``sample_index`` of request ``request_index``."""

    request_index: int
    sample_index: int
    input_ids: list[int]
    sampling_params: dict[str, Any]
    #: A vision-language model's images for this input (PIL images, SGLang's ``image_data``), or ``None``.
    image_data: list[Any] | None = None


def sampling_dict(params: SamplingParams, seed_offset: int = 0) -> dict[str, Any]:
    """SGLang's sampling-parameter dict for one sample (``n`` is always 1: see :func:`engine_inputs`).

    ``top_k=-1`` and ``top_p=1.0`` disable the filters in both; ``temperature=0`` is greedy in both. A seeded
    request gets ``seed + offset`` as SGLang's ``sampling_seed``.
    """
    out: dict[str, Any] = {
        "n": 1,
        "temperature": float(params.temperature),
        "top_p": float(params.top_p),
        "top_k": int(params.top_k) if params.top_k > 0 else -1,
        "max_new_tokens": int(params.max_new_tokens),
        "ignore_eos": bool(params.ignore_eos),
        # SGLang does not count the stop token as output unless told to; polyrl's protocol includes it
        "no_stop_trim": True,
        "skip_special_tokens": False,
    }
    if params.stop_token_ids:
        out["stop_token_ids"] = [int(t) for t in params.stop_token_ids]
    seed = request_seed(params.seed, seed_offset)
    if seed is not None:
        out["sampling_seed"] = int(seed)
    return out


def engine_inputs(requests: Sequence[GenerationRequest]) -> list[EngineInput]:
    """Every sample of every request as its own engine input, grouped by request, in order."""
    inputs = []
    for i, req in enumerate(requests):
        if req.sampling_params.n < 1:
            raise ValueError(f"request {req.request_id or i}: sampling_params.n={req.sampling_params.n}; it must be >= 1")
        images = (req.multi_modal or {}).get("image")
        for k in range(req.sampling_params.n):
            inputs.append(EngineInput(i, k, list(req.prompt_ids), sampling_dict(req.sampling_params, len(inputs)),
                                      list(images) if images else None))
    return inputs


def image_data_argument(inputs: Sequence[EngineInput]) -> dict[str, Any]:
    """``{"image_data": [...]}`` (one list of images per input, ``None`` for inputs without) when any input has
    images, else ``{}``: the keyword ``Engine.generate`` takes with ``input_ids`` whose image tokens the
    processor already expanded."""
    if not any(i.image_data for i in inputs):
        return {}
    return {"image_data": [i.image_data for i in inputs]}


_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}


def finish_reason(meta_info: dict[str, Any]) -> str:
    """polyrl's finish reason from SGLang's ``meta_info["finish_reason"]`` (a dict, a string, or ``None``)."""
    reason = meta_info.get("finish_reason")
    kind = reason.get("type") if isinstance(reason, dict) else reason
    return _FINISH.get(str(kind), "abort") if kind is not None else "abort"


def result_from_output(req: GenerationRequest, sample_index: int, output: dict[str, Any], *,
                       want_logprobs: bool) -> GenerationResult:
    """One :class:`GenerationResult` from one SGLang output dict.

    Raises ``RuntimeError`` when the log-probs SGLang returned do not line up with its output tokens (a
    version whose output format this rollout does not know).
    """
    meta = output.get("meta_info") or {}
    ids = [int(t) for t in (output.get("output_ids") or [])]
    logps: list[float] = []
    if want_logprobs:
        entries = meta.get("output_token_logprobs") or []
        if len(entries) != len(ids):
            raise RuntimeError(f"sglang rollout: {len(entries)} output_token_logprobs for {len(ids)} output tokens "
                               "(an SGLang output format this rollout does not know; see docs/rollouts/sglang.md)")
        for pos, (entry, tok) in enumerate(zip(entries, ids)):
            logp, tok_of_entry = entry[0], entry[1]
            if tok_of_entry is not None and int(tok_of_entry) != tok:
                raise RuntimeError(f"sglang rollout: log-prob {pos} is for token {tok_of_entry}, the output token "
                                   f"is {tok}")
            logps.append(float(logp))
    return GenerationResult(prompt_ids=list(req.prompt_ids), response_ids=ids, log_probs=logps,
                            finish_reason=finish_reason(meta), request_id=req.request_id, sample_index=sample_index)


def results_from_outputs(requests: Sequence[GenerationRequest], inputs: Sequence[EngineInput],
                         outputs: Sequence[dict[str, Any]]) -> list[GenerationResult]:
    """Results in the protocol's order (request by request, samples in ``sample_index`` order)."""
    if len(outputs) != len(inputs):
        raise RuntimeError(f"sglang rollout: the engine returned {len(outputs)} outputs for {len(inputs)} inputs")
    return [result_from_output(requests[inp.request_index], inp.sample_index, out,
                               want_logprobs=requests[inp.request_index].sampling_params.logprobs)
            for inp, out in zip(inputs, outputs)]


def engine_kwargs(config: Any, scfg: Any, *, model_path: str) -> dict[str, Any]:
    """Keyword arguments for ``sglang.Engine`` from the ``rollout`` block and its ``sglang`` block.

    Token ids in and out (``skip_tokenizer_init``); the engine's context length is ``rollout.max_model_len``
    (or prompt + response length); ``tp_size`` is ``rollout.tensor_parallel_size``. The replica's devices are
    the visible ones (the leader narrows them before it builds the engine), so the engine starts at device 0.
    """
    max_len = config.max_model_len or (config.prompt_length + config.response_length)
    kwargs: dict[str, Any] = dict(
        model_path=str(model_path), tokenizer_path=str(model_path), skip_tokenizer_init=True,
        dtype=config.dtype, context_length=max_len, tp_size=config.tensor_parallel_size, base_gpu_id=0,
        random_seed=config.seed, mem_fraction_static=scfg.mem_fraction_static or config.gpu_memory_utilization,
        enable_memory_saver=scfg.enable_memory_saver, disable_radix_cache=scfg.disable_radix_cache,
        disable_cuda_graph=scfg.disable_cuda_graph, log_level=scfg.log_level,
    )
    if scfg.max_running_requests:
        kwargs["max_running_requests"] = scfg.max_running_requests
    if scfg.attention_backend:
        kwargs["attention_backend"] = scfg.attention_backend
    if scfg.lora_adapter:
        targets = list(scfg.lora_target_modules)
        kwargs.update(enable_lora=True, max_lora_rank=scfg.max_lora_rank, max_loras_per_batch=2,
                      lora_target_modules="all" if targets == ["all"] else targets)
    kwargs.update(scfg.engine_kwargs)
    return kwargs


def memory_tags(level: int) -> list[str] | None:
    """What ``sleep(level)`` releases: level 1 the KV cache (and CUDA graphs), level 2 everything
    (``None``: SGLang releases weights, KV cache and CUDA graphs)."""
    if level not in (1, 2):
        raise ValueError(f"sglang rollout: sleep level {level}; use 1 (KV cache) or 2 (weights too)")
    return ["kv_cache", "cuda_graph"] if level == 1 else None
