"""LoRA adapter sync for engine-backed rollouts: adapter tensors from ``update_weights`` become a peft folder.

vLLM and SGLang load adapters from disk, not from tensors in memory, so each sync writes the adapter
(``adapter_config.json`` + ``adapter_model.safetensors``) to a fresh folder, published under a new name and
version: engines cache adapters by id, so an id is never reused for other weights. vLLM wraps the folder in a
``LoRARequest``; SGLang loads it with ``load_lora_adapter``.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

#: peft's prefix in ``adapter_model.safetensors``; the engine's ``weights_for_rollout`` sends names with it.
PEFT_PREFIX = "base_model.model."
_ADAPTER_NAME = re.compile(r"(?P<module>.+)\.lora_(?P<ab>[AB])\.weight")


class LoRAAdapterSync:
    """The adapter a rollout serves: checked, staged, then published as a peft folder.

    ``rollout`` names the rollout in errors and its config block (``rollout.<rollout>.lora_alpha``,
    ``rollout.<rollout>.max_lora_rank``); ``lora_alpha`` must equal the actor's ``model.lora.alpha``.
    """

    def __init__(self, rollout: str, *, lora_alpha: float | None, max_lora_rank: int) -> None:
        self.rollout = rollout
        self.lora_alpha = lora_alpha
        self.max_lora_rank = max_lora_rank
        self.staged: dict[str, torch.Tensor] = {}
        self.version = 0
        self.root = Path(tempfile.mkdtemp(prefix=f"polyrl-{rollout}-lora-"))
        weakref.finalize(self, shutil.rmtree, str(self.root), True)

    @staticmethod
    def is_adapter_name(name: str) -> bool:
        """Whether ``name`` is a LoRA tensor (``...lora_A.weight``, ``...lora_B.weight``, embeddings too)."""
        return ".lora_" in name

    @staticmethod
    def _key(name: str) -> str:
        return name if name.startswith(PEFT_PREFIX) else PEFT_PREFIX + name

    @property
    def pending(self) -> bool:
        """Adapter tensors arrived since the last publish."""
        return bool(self.staged)

    def check(self, tensors: Sequence[tuple[str, torch.Tensor]], shapes: dict[str, tuple[int, ...]]) -> None:
        """Names and shapes against the base model (``KeyError`` / ``ValueError``), before anything is kept."""
        if self.lora_alpha is None:
            raise ValueError(f"{self.rollout} rollout: LoRA adapter sync needs rollout.{self.rollout}.lora_alpha (set "
                             "it to the actor's model.lora.alpha)")
        for name, tensor in tensors:
            match = _ADAPTER_NAME.fullmatch(self._key(name)[len(PEFT_PREFIX):])
            base = f"{match['module']}.weight" if match else None
            if base not in shapes:
                raise KeyError(f"{self.rollout} rollout: adapter tensor '{name}' matches no linear layer of the model (expected "
                               "'<module>.lora_A.weight' / '<module>.lora_B.weight' of a weight the model has)")
            out_features, in_features = shapes[base]
            rank = tensor.shape[0] if match["ab"] == "A" else tensor.shape[-1]
            expected = (rank, in_features) if match["ab"] == "A" else (out_features, rank)
            if tensor.dim() != 2 or tuple(tensor.shape) != expected:
                raise ValueError(f"{self.rollout} rollout: adapter tensor '{name}' has shape {tuple(tensor.shape)}; for "
                                 f"'{base}' {shapes[base]} it must be {expected} (rank first for lora_A)")
            if rank > self.max_lora_rank:
                raise ValueError(f"{self.rollout} rollout: adapter tensor '{name}' has rank {rank} > "
                                 f"rollout.{self.rollout}.max_lora_rank {self.max_lora_rank}; raise max_lora_rank")

    def stage(self, tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Keep checked tensors (on the host) until the next generation."""
        for name, tensor in tensors:
            self.staged[self._key(name)] = tensor.detach().to("cpu").contiguous()

    def publish(self, make: Callable[[str, int, str], Any]) -> Any:
        """Write the staged adapter and return ``make(name, version, folder)`` (vLLM: its ``LoRARequest`` class).

        The adapter tensors sent since the last generation (all buckets of one sync) are the whole new adapter:
        it replaces the previous one. A module without both ``lora_A`` and ``lora_B``, or ranks that differ, is a
        ``ValueError``; the staged tensors are then dropped and the previous adapter stays in use.
        """
        adapter, self.staged = self.staged, {}
        modules: dict[str, dict[str, torch.Tensor]] = {}
        for key, tensor in adapter.items():
            match = _ADAPTER_NAME.fullmatch(key[len(PEFT_PREFIX):])
            modules.setdefault(match["module"], {})[match["ab"]] = tensor
        ranks = set()
        for module, parts in modules.items():
            if set(parts) != {"A", "B"}:
                raise ValueError(f"{self.rollout} rollout: the adapter sync sent only lora_{''.join(parts)} of '{module}'; send "
                                 "lora_A and lora_B of every adapted module")
            if parts["A"].shape[0] != parts["B"].shape[1]:
                raise ValueError(f"{self.rollout} rollout: '{module}' has lora_A rank {parts['A'].shape[0]} but lora_B rank "
                                 f"{parts['B'].shape[1]}")
            ranks.add(parts["A"].shape[0])
        if len(ranks) != 1:
            raise ValueError(f"{self.rollout} rollout: the adapter mixes ranks {sorted(ranks)}; one rank for every module")
        from safetensors.torch import save_file

        self.version += 1
        folder = self.root / f"v{self.version}"
        folder.mkdir()
        config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": ranks.pop(), "lora_alpha": self.lora_alpha,
                  "target_modules": sorted({m.rsplit(".", 1)[-1] for m in modules}), "bias": "none",
                  "lora_dropout": 0.0, "base_model_name_or_path": None}
        (folder / "adapter_config.json").write_text(json.dumps(config))
        save_file(adapter, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
        previous = self.root / f"v{self.version - 1}"
        if previous.exists():  # the engine read it when it first served that id, and the id is never asked for again
            shutil.rmtree(previous, ignore_errors=True)
        return make(f"polyrl-adapter-v{self.version}", self.version, str(folder))
