"""Methods polyrl adds to every vLLM worker (``worker_extension_cls``), reached with ``collective_rpc``.

vLLM mixes this class into its worker class, in whatever process the worker runs: this process (``vllm.LLM``
with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``), the engine-core process of ``AsyncLLM``, or one process per
tensor-parallel rank. ``collective_rpc("polyrl_load_weights", ...)`` then reaches every rank the same way.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Sequence
from typing import Any

import torch

#: A weight as it crosses vLLM's msgpack channel to an out-of-process engine core: name, dtype, shape, raw bytes.
PackedWeight = tuple[str, str, Sequence[int], bytes]


def pack_weights(weights: Sequence[tuple[str, torch.Tensor]]) -> list[PackedWeight]:
    """Tensors as plain bytes: vLLM's utility-call encoder does not carry tensors nested in arguments."""
    packed = []
    for name, tensor in weights:
        flat = tensor.detach().to("cpu").contiguous()
        packed.append((name, str(flat.dtype).removeprefix("torch."), list(flat.shape),
                       flat.view(torch.uint8).numpy().tobytes()))
    return packed


def unpack_weights(weights: Sequence[Any]) -> Iterator[tuple[str, torch.Tensor]]:
    """Inverse of :func:`pack_weights`; ``(name, tensor)`` pairs pass through unchanged."""
    for item in weights:
        if len(item) == 2:
            yield item[0], item[1]
            continue
        name, dtype, shape, raw = item
        tensor = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        yield name, tensor.view(getattr(torch, dtype)).reshape(tuple(shape))


class WeightSyncExtension:
    """Mixed into vLLM's worker: loads HF-named weights in place."""

    def polyrl_load_weights(self, weights: Sequence[Any]) -> None:
        """Load ``weights`` (``(name, tensor)`` pairs or :data:`PackedWeight`) into this worker's model.

        ``reload_weights`` goes through vLLM's checkpoint loader, which knows how to shard, fuse (q/k/v,
        gate/up) and, on the CPU backend, repack linear weights; ``model.load_weights`` on the live model
        fails there because the repacked parameters no longer have checkpoint shapes.
        """
        pairs = list(unpack_weights(weights))
        reload = getattr(self.model_runner, "reload_weights", None)
        if reload is not None and "weights_iterator" in inspect.signature(reload).parameters:
            self.reload_weights(weights_iterator=iter(pairs))
            _prepack_cpu_experts_again(self.model_runner, {name for name, _ in pairs})
            _prepack_tied_cpu_head_again(self.model_runner, {name for name, _ in pairs})
        else:  # vLLM releases whose reload_weights only rereads the checkpoint (GPU backends)
            self.model_runner.model.load_weights(iter(pairs))


def _prepack_tied_cpu_head_again(model_runner: Any, names: set[str]) -> None:
    """Prepack the LM head again after a sync of the embedding it is tied to, on vLLM's CPU backend.

    With tied embeddings (SmolLM2, Qwen2.5-0.5B/1.5B) vLLM's ``lm_head`` shares ``embed_tokens``' weight, but the CPU
    backend computes the logits from a copy prepacked at load time (``cpu_linear``); ``reload_weights`` writes the
    shared weight and does not prepack the head again, so the logits kept the old embedding (SmolLM2-135M's log-probs
    were 0.1 off the engine's after one optimizer step). Rebuilt only when the sync held the embedding.
    """
    if "model.embed_tokens.weight" not in names and "lm_head.weight" not in names:
        return
    get_model = getattr(model_runner, "get_model", None)
    model = get_model() if get_model is not None else getattr(model_runner, "model", None)
    head = getattr(model, "lm_head", None)
    method = getattr(head, "quant_method", None)
    if head is None or method is None or not hasattr(head, "cpu_linear"):
        return
    method.process_weights_after_loading(head)


def _prepack_cpu_experts_again(model_runner: Any, names: set[str]) -> None:
    """Prepack the experts of every mixture-of-experts layer an in-place reload wrote, on vLLM's CPU backend.

    vLLM 0.32's CPU MoE kernel (``CPUUnquantizedExperts``) prepacks the expert weights into its own layout when the
    model loads; ``reload_weights`` writes checkpoint-layout experts back and does not prepack them again, so the
    experts compute from scrambled weights (a sync of unchanged weights moved a tiny Qwen3-MoE's log-probs by 0.03).
    A layer's experts are prepacked only when the sync held one of its expert tensors (``...experts.E...``).
    """
    get_model = getattr(model_runner, "get_model", None)
    model = get_model() if get_model is not None else getattr(model_runner, "model", None)
    if model is None:
        return
    for name, module in model.named_modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if experts is None or not type(experts).__name__.startswith("CPU") or ".experts" not in name:
            continue
        prefix = name[: name.rindex(".experts") + len(".experts.")]
        if any(n.startswith(prefix) for n in names):
            experts.process_weights_after_loading(module)
