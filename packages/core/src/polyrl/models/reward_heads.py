"""Which scalar head a checkpoint carries, read from its files without building the model.

A discriminative reward model (and a critic loaded from a checkpoint) is a decoder whose head maps the hidden
state of a token to scores:

* ``score``: transformers' ``XForSequenceClassification`` / ``XForTokenClassification`` (``score.weight``,
  ``[num_labels, hidden]``), what reward models such as Skywork-Reward and polyrl's exported critics hold;
* ``v_head``: a causal LM saved with TRL's value head (``v_head.summary.weight``);
* ``value_head``: a causal LM saved with OpenRLHF's value head (``value_head.weight``);
* ``none``: a plain causal LM (a critic starts from a zero head; a reward model cannot be one).

An encoder classifier (BERT-style, pooling its first token through ``classifier``) is reported as
``pooled``: polyrl scores decoders at their last token and refuses it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: Tensor names of each causal-LM value-head format: (weight, bias).
VALUE_HEAD_KEYS: dict[str, tuple[str, str]] = {
    "v_head": ("v_head.summary.weight", "v_head.summary.bias"),
    "value_head": ("value_head.weight", "value_head.bias"),
}


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
    score = _shape(files, "score.weight")
    classifier = arch.endswith(("ForSequenceClassification", "ForTokenClassification"))
    if score is not None or (classifier and not files):
        outputs = score[0] if score is not None else int(getattr(hf_config, "num_labels", 1) or 1)
        return RewardHead("score", int(outputs), arch)
    if classifier:  # a classification checkpoint without a `score` layer pools its own way (BERT's `classifier`)
        return RewardHead("pooled", int(getattr(hf_config, "num_labels", 1) or 1), arch)
    for kind, (weight, _) in VALUE_HEAD_KEYS.items():
        shape = _shape(files, weight)
        if shape is not None:
            return RewardHead(kind, int(shape[0]), arch)
    return RewardHead("none", 0, arch)


def value_head_tensors(path: str) -> dict[str, Any]:
    """A causal LM's value head (TRL's ``v_head.summary``, OpenRLHF's ``value_head``) as ``{"weight": ...,
    "bias": ...}`` (bias only when saved); empty when the checkpoint has none. Read with safetensors (no code)."""
    files = weight_files(path)
    from safetensors import safe_open

    for weight, bias in VALUE_HEAD_KEYS.values():
        if weight in files:
            out = {}
            for key, name in (("weight", weight), ("bias", bias)):
                if name in files:
                    with safe_open(files[name], framework="pt") as f:
                        out[key] = f.get_tensor(name)
            return out
    return {}
