"""``sglang``: the SGLang rollout — SGLang's offline ``Engine`` on token ids, in-place weight sync, memory release.

SGLang is imported here, when a run builds the rollout, never when polyrl loads the plugin. The engine runs its
scheduler (one process per tensor-parallel rank). It is built in the calling thread (SGLang installs signal
handlers, which only the main thread may do) and then driven from one helper thread that adopts the engine's
event loop: SGLang's synchronous API runs ``loop.run_until_complete``, which cannot run inside the agent loops'
running event loop, so every engine call after construction goes through that thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from polyrl.errors import PolyrlError
from polyrl.protocols import GenerationRequest, GenerationResult, RolloutCapabilities
from polyrl.rollout.limits import check_model_length
from polyrl.rollout.lora_adapter import LoRAAdapterSync
from polyrl.rollout.weights import check_named_tensors, hf_param_shapes
from polyrl_rollout_sglang.config import SGLangConfig
from polyrl_rollout_sglang.requests import (
    engine_inputs,
    engine_kwargs,
    image_data_argument,
    memory_tags,
    results_from_outputs,
)

logger = logging.getLogger("polyrl.rollout.sglang")

INSTALL_HINT = "pip install 'polyrl-rollout-sglang[cuda]' (SGLang needs a CUDA GPU; it has no CPU build on PyPI)"
#: The SGLang releases this rollout was written against (the ``[cuda]`` extra pins the same range).
TESTED_SGLANG = ">=0.5,<0.6"


class SGLangNotInstalledError(PolyrlError, ImportError):
    """SGLang is not importable in this process."""


class SGLangVersionError(PolyrlError):
    """The installed SGLang is outside :data:`TESTED_SGLANG`."""


def import_sglang() -> Any:
    """Import sglang or raise :class:`SGLangNotInstalledError` with the install line."""
    try:
        import sglang
    except ImportError as exc:
        raise SGLangNotInstalledError(f"rollout 'sglang' needs SGLang, which does not import here ({exc}). "
                                      f"Install it: {INSTALL_HINT}") from exc
    return sglang


def check_sglang_version(version: str, *, allow_untested: bool = False) -> None:
    """Raise :class:`SGLangVersionError` for a version outside :data:`TESTED_SGLANG` (unless allowed: then
    a warning)."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    try:
        ok = Version(version) in SpecifierSet(TESTED_SGLANG)
    except InvalidVersion:
        ok = False
    if ok:
        return
    msg = (f"sglang rollout: SGLang {version} is outside the range this rollout was written against "
           f"({TESTED_SGLANG}); its engine API may differ.")
    if allow_untested:
        logger.warning("%s Going on (rollout.sglang.allow_untested_version=true).", msg)
        return
    raise SGLangVersionError(f"{msg} Install a tested release (pip install 'sglang{TESTED_SGLANG}'), or set "
                             "rollout.sglang.allow_untested_version=true to try this one.")


def _engine_reply_ok(reply: Any) -> tuple[bool, str]:
    """SGLang answers admin calls with ``(success, message)``, a dict, or an object with ``success``."""
    if isinstance(reply, tuple) and reply and isinstance(reply[0], bool):
        return reply[0], str(reply[1]) if len(reply) > 1 else ""
    if isinstance(reply, dict) and "success" in reply:
        return bool(reply["success"]), str(reply.get("message", ""))
    if hasattr(reply, "success"):
        return bool(reply.success), str(getattr(reply, "message", "") or getattr(reply, "error_message", ""))
    return True, ""


class SGLangRollout:
    """An SGLang ``Engine`` owned by this worker process (the leader of its replica when ``tp > 1``).

    ``config`` is the ``rollout`` block (:class:`polyrl.config.roles.RolloutConfig`); its ``plugin_config`` is an
    :class:`SGLangConfig` or ``None`` (defaults). ``engine_factory`` builds the engine from keyword arguments
    (default ``sglang.Engine``); tests pass a stand-in there.
    """

    def __init__(self, config: Any, *, model_path: str, tokenizer: Any, platform: Any = None,
                 engine_factory: Callable[..., Any] | None = None) -> None:
        self.config = config
        self.scfg: SGLangConfig = config.plugin_config if isinstance(config.plugin_config, SGLangConfig) else SGLangConfig()
        self.tokenizer = tokenizer
        self.model_path = str(model_path)
        self.max_model_len = config.max_model_len or (config.prompt_length + config.response_length)
        self._released: list[str] | None | bool = False  # False: awake; else the tags released
        self._closed = False
        self._flush_pending = False
        if engine_factory is None:
            sglang = import_sglang()
            check_sglang_version(getattr(sglang, "__version__", "0"), allow_untested=self.scfg.allow_untested_version)
            engine_factory = sglang.Engine
        self.capabilities = RolloutCapabilities(sleep=self.scfg.enable_memory_saver, async_generate=False,
                                                log_probs=True, tensor_parallel=True,
                                                lora_adapter=self.scfg.lora_adapter)
        self._adapter = (LoRAAdapterSync("sglang", lora_alpha=self.scfg.lora_alpha, max_lora_rank=self.scfg.max_lora_rank)
                         if self.scfg.lora_adapter else None)
        self._adapter_name: str | None = None  # the adapter generation uses (SGLang's name for it)
        kwargs = engine_kwargs(config, self.scfg, model_path=self.model_path)
        try:
            self.engine = engine_factory(**kwargs)
        except Exception as exc:
            text = str(exc)
            if "not supported" in text.lower() or "architecture" in text.lower():
                raise PolyrlError(f"SGLang cannot serve the model at {model_path} ({text[:400]}). Use rollout.name=vllm "
                                  "or rollout.name=hf for this model.") from exc
            raise
        # one thread drives the engine on the engine's own event loop (see the module docstring)
        loop = getattr(self.engine, "loop", None)
        self._thread = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="polyrl-sglang",
            initializer=asyncio.set_event_loop if loop is not None else None, initargs=(loop,) if loop is not None else ())

    def _call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return self._thread.submit(fn, *args, **kwargs).result()

    # ------------------------------------------------------------------ generation
    def _check(self, requests: Sequence[GenerationRequest]) -> None:
        if self._closed:
            raise RuntimeError("sglang rollout: generate after shutdown(); build a new rollout")
        check_model_length(requests, self.max_model_len, "rollout.max_model_len")

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        """Sample every request in one engine call: ``n`` results per request, in request order.

        The radix cache is flushed first when weights changed since the last generation. Raises ``ValueError``
        naming the request whose prompt plus ``max_new_tokens`` exceeds the model length.
        """
        self._check(requests)
        if not requests:
            return []
        if self._released is not False:
            self.wake_up()
        self._publish_adapter()
        self._flush_if_needed()
        inputs = engine_inputs(requests)
        extra = {"lora_path": [self._adapter_name] * len(inputs)} if self._adapter_name else {}
        extra.update(image_data_argument(inputs))  # a vision-language model's images (none: no keyword)
        outputs = self._call(
            self.engine.generate, input_ids=[i.input_ids for i in inputs],
            sampling_params=[i.sampling_params for i in inputs],
            return_logprob=any(r.sampling_params.logprobs for r in requests), **extra,
        )
        if isinstance(outputs, dict):  # a single input comes back as one dict
            outputs = [outputs]
        return results_from_outputs(requests, inputs, outputs)

    async def agenerate(self, request: GenerationRequest) -> list[GenerationResult]:
        """Sample one request from a coroutine: concurrent calls on one event loop are gathered into one
        :meth:`generate` (SGLang then batches them continuously)."""
        self._check([request])
        loop = asyncio.get_running_loop()
        if getattr(self, "_batcher_loop", None) is not loop:
            from polyrl.agent_loops import BatchingClient

            self._batcher, self._batcher_loop = BatchingClient(self, self.scfg.max_batch_size), loop
        return await self._batcher.agenerate(request)

    # ------------------------------------------------------------------ weights
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named full tensors (one bucket of ``weights_for_rollout()``) in place.

        The bucket is checked against the model's parameter names and shapes first: ``KeyError`` for an unknown
        name, ``ValueError`` for a wrong shape, and nothing of the bucket is loaded. SGLang loads each bucket at
        once (its loader fills fused q/k/v and gate/up shard by shard, so a bucket boundary between them is fine);
        the radix cache is flushed before the next generation. ``RuntimeError`` if SGLang reports a failure.

        With ``rollout.sglang.lora_adapter`` peft adapter tensors (``...lora_A.weight`` / ``...lora_B.weight``) are
        checked and staged; the next generation loads them as a new adapter (``load_lora_adapter``) and serves it.
        """
        tensors = list(named_tensors)
        shapes = hf_param_shapes(self.model_path)
        if self._adapter is not None:
            adapter = [(n, t) for n, t in tensors if LoRAAdapterSync.is_adapter_name(n)]
            if adapter:
                self._adapter.check(adapter, shapes)
                tensors = [(n, t) for n, t in tensors if not LoRAAdapterSync.is_adapter_name(n)]
                check_named_tensors(tensors, shapes, rollout="sglang", model_path=self.model_path)
                self._adapter.stage(adapter)  # served from the next generation on (all buckets of a sync)
        if not tensors:
            return
        check_named_tensors(tensors, shapes, rollout="sglang", model_path=self.model_path,
                            adapter_option="rollout.sglang.lora_adapter=true")
        reply = self._call(self.engine.update_weights_from_tensor, named_tensors=tensors, flush_cache=False)
        ok, message = _engine_reply_ok(reply)
        if not ok:
            raise RuntimeError(f"sglang rollout: SGLang failed to load {len(tensors)} weights "
                               f"({tensors[0][0]} ...): {message}")
        self._flush_pending = True

    def _publish_adapter(self) -> None:
        """Load the adapter staged since the last generation under a new name, then drop the previous one.
        On a failure the previous adapter stays in use."""
        if self._adapter is None or not self._adapter.pending:
            return
        name, _version, folder = self._adapter.publish(lambda n, v, f: (n, v, f))
        ok, message = _engine_reply_ok(self._call(self.engine.load_lora_adapter, lora_name=name, lora_path=folder))
        if not ok:
            raise RuntimeError(f"sglang rollout: SGLang failed to load the LoRA adapter from {folder}: {message}")
        previous, self._adapter_name = self._adapter_name, name
        if previous is not None:
            self._call(self.engine.unload_lora_adapter, lora_name=previous)
        self._flush_pending = True  # cached prefixes were computed with the previous adapter

    def _flush_if_needed(self) -> None:
        if self._flush_pending:
            self._call(self.engine.flush_cache)
            self._flush_pending = False

    # ------------------------------------------------------------------ memory
    def sleep(self, level: int = 1) -> None:
        """Release accelerator memory with ``release_memory_occupation`` (level 1: KV cache and CUDA graphs;
        level 2: weights too, which must be re-sent after :meth:`wake_up`). No-op without the memory saver."""
        tags = memory_tags(level)
        if not self.capabilities.sleep or self._released is not False:
            return
        self._call(self.engine.release_memory_occupation, tags=tags)
        self._released = tags

    def wake_up(self) -> None:
        """Retake what :meth:`sleep` released (``resume_memory_occupation``)."""
        if self._released is False:
            return
        self._call(self.engine.resume_memory_occupation, tags=self._released)
        self._released = False

    # ------------------------------------------------------------------ lifetime
    def shutdown(self) -> None:
        """Stop the engine and its scheduler processes; the rollout is unusable afterwards."""
        if self._closed:
            return
        self._closed = True
        try:
            self._call(self.engine.shutdown)
        finally:
            self._thread.shutdown(wait=True)
