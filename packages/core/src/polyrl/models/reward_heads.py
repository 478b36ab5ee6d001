"""Which scalar head a checkpoint carries, read from its files without building the model.

A discriminative reward model (and a critic loaded from a checkpoint) is a decoder whose head maps the hidden
state of a token to scores:

* ``score``: transformers' ``XForSequenceClassification`` / ``XForTokenClassification`` (``score.weight``,
  ``[num_labels, hidden]``), what reward models such as Skywork-Reward and polyrl's exported critics hold;
* ``v_head``: a causal LM saved with TRL's value head (``AutoModelForCausalLMWithValueHead``: the causal LM's
  tensors plus ``v_head.summary.weight`` ``[1, hidden]`` and ``v_head.summary.bias`` ``[1]``, applied to the last
  hidden state);
* ``value_head``: a decoder saved with OpenRLHF's head (``get_llm_for_sequence_regression``: the base model's
  tensors plus ``<value_head_prefix>.weight`` ``[1, hidden]``, no bias; ``config.json`` names the prefix,
  ``value_head`` in older releases and ``score`` since, and, trained with ``--normalize_reward``, carries
  ``normalize_reward``, ``mean`` and ``std``: the reward is ``(head(h) - mean) / std``);
* ``none``: a plain causal LM (a critic starts from a zero head; a reward model cannot be one).

:func:`value_head_tensors` gives the saved head of the last two as the ``weight`` and ``bias`` of one linear
layer, OpenRLHF's normalisation folded in, so an engine's ``score`` layer computes the library's own score.

An encoder classifier (BERT-style, pooling its first token through ``classifier``) is reported as
``pooled``: polyrl scores decoders at their last token and refuses it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: Tensor names of each causal-LM value-head format: (weight, bias). OpenRLHF's prefix is read from the config
#: (``value_head_prefix``); ``value_head`` is its older default.
VALUE_HEAD_KEYS: dict[str, tuple[str, str]] = {
    "v_head": ("v_head.summary.weight", "v_head.summary.bias"),
    "value_head": ("value_head.weight", "value_head.bias"),
}


def _is_classifier(arch: str) -> bool:
    return arch.endswith(("ForSequenceClassification", "ForTokenClassification"))


def _head_keys(hf_config: Any) -> list[tuple[str, str, str]]:
    """``(kind, weight, bias)`` of each causal-LM value-head format, the config's OpenRLHF prefix first."""
    prefix = getattr(hf_config, "value_head_prefix", None) if hf_config is not None else None
    keys = [("value_head", f"{prefix}.weight", f"{prefix}.bias")] if isinstance(prefix, str) and prefix else []
    return keys + [(kind, w, b) for kind, (w, b) in VALUE_HEAD_KEYS.items() if (kind, w, b) not in keys]


@dataclass(frozen=True)
class RewardHead:
    """The head a checkpoint carries: its kind (see the module docstring), how many scores it outputs and the
    checkpoint's architecture."""

    kind: str
    outputs: int
    architecture: str = ""


def weight_files(path: str) -> dict[str, str]:
    """``{tensor name: safetensors file}`` of a local folder or a cached Hub id; empty when there is none."""
    from transformers.utils import cached_file

    def local(name: str) -> str | None:
        try:
            return cached_file(path, name, _raise_exceptions_for_missing_entries=False)
        except Exception:  # no such repo file / no network: treated as absent
            return None

    index = local("model.safetensors.index.json")
    if index:
        mapping = json.loads(Path(index).read_text()).get("weight_map", {})
        return {k: str(Path(index).parent / v) for k, v in mapping.items()}
    single = local("model.safetensors")
    if not single:
        return {}
    from safetensors import safe_open

    with safe_open(single, framework="pt") as f:
        return {k: single for k in f.keys()}


def _shape(files: dict[str, str], name: str) -> list[int] | None:
    if name not in files:
        return None
    from safetensors import safe_open

    with safe_open(files[name], framework="pt") as f:
        return list(f.get_slice(name).get_shape())


def find_reward_head(path: str, hf_config: Any) -> RewardHead:
    """The head of the checkpoint at ``path`` (a local folder or a Hub id) whose config is ``hf_config``."""
    archs = list(getattr(hf_config, "architectures", None) or [])
    arch = archs[0] if archs else ""
    files = weight_files(path)
    classifier = _is_classifier(arch)
    if not classifier:  # a causal LM or OpenRLHF's model (its `architectures` is its own class, `RewardModel`)
        for kind, weight, _ in _head_keys(hf_config):
            shape = _shape(files, weight)
            if shape is not None:
                return RewardHead(kind, int(shape[0]), arch)
    score = _shape(files, "score.weight")
    if score is not None or (classifier and not files):
        outputs = score[0] if score is not None else int(getattr(hf_config, "num_labels", 1) or 1)
        return RewardHead("score", int(outputs), arch)
    if classifier:  # a classification checkpoint without a `score` layer pools its own way (BERT's `classifier`)
        return RewardHead("pooled", int(getattr(hf_config, "num_labels", 1) or 1), arch)
    return RewardHead("none", 0, arch)


def value_head_tensors(path: str, hf_config: Any = None) -> dict[str, Any]:
    """The value head a decoder was saved with (TRL's ``v_head.summary``, OpenRLHF's ``<value_head_prefix>``) as
    ``{"weight": [1, hidden], "bias": [1]}`` of the one linear layer that gives the library's own score from the
    last hidden state: a missing bias is 0, and OpenRLHF's reward normalisation (``normalize_reward`` with
    ``mean`` / ``std`` in ``hf_config``) is folded in, ``w / std`` and ``(b - mean) / std``. Empty when the
    checkpoint has none, or is a transformers classifier (``hf_config.architectures``; its ``score`` layer loads
    as it is). Read with safetensors (no code runs)."""
    import torch

    archs = list(getattr(hf_config, "architectures", None) or []) if hf_config is not None else []
    if archs and _is_classifier(archs[0]):
        return {}
    files = weight_files(path)
    from safetensors import safe_open

    # a bare `score` layer on a decoder that is no transformers classifier: OpenRLHF's current default prefix
    for _, weight, bias in _head_keys(hf_config) + [("value_head", "score.weight", "score.bias")]:
        if weight not in files:
            continue
        with safe_open(files[weight], framework="pt") as f:
            w = f.get_tensor(weight).float()
        b = torch.zeros(w.shape[0])
        if bias in files:
            with safe_open(files[bias], framework="pt") as f:
                b = f.get_tensor(bias).float()
        if hf_config is not None and getattr(hf_config, "normalize_reward", False):
            mean, std = float(getattr(hf_config, "mean", 0.0)), float(getattr(hf_config, "std", 1.0))
            w, b = w / std, (b - mean) / std
        return {"weight": w, "bias": b}
    return {}
