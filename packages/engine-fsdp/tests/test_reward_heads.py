"""Reward models saved by other libraries, scored by the FSDP engine as ``reward_model`` (a value model read at
the sequence's last token): a causal LM with TRL's ``v_head`` (``AutoModelForCausalLMWithValueHead``) and
OpenRLHF's reward model (``get_llm_for_sequence_regression``: its ``value_head_prefix``, old ``value_head`` and
current ``score``, and its reward normalisation). The folders are written in the test in each library's format
(:func:`polyrl.models.tiny.make_tiny_value_head_model`); the expected scores are computed by hand from the saved
head's tensors and a ``transformers`` forward's last hidden state."""

from __future__ import annotations

import json

import pytest
import torch

SEQUENCES = [[9, 40, 41, 42, 1], [9, 50, 3], [9, 60, 61, 62, 63, 64, 65, 1], [9]]

FORMATS = {
    "trl": dict(library="trl"),
    "openrlhf-value_head": dict(library="openrlhf", value_head_prefix="value_head"),
    "openrlhf-score-normalized": dict(library="openrlhf", value_head_prefix="score", normalize=(0.75, 2.5)),
}


def _by_hand(path) -> list[float]:
    """Each sequence alone through ``transformers``: the saved head applied to its last token's final hidden
    state, as the library scores it (TRL: ``v_head.summary``; OpenRLHF: ``(head(h) - mean) / std``)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    config = json.loads((path / "config.json").read_text())
    state = load_file(str(path / "model.safetensors"))
    if "v_head.summary.weight" in state:
        w, b = state["v_head.summary.weight"], state["v_head.summary.bias"]
    else:
        w, b = state[f"{config['value_head_prefix']}.weight"], torch.zeros(1)
    mean, std = (config["mean"], config["std"]) if config.get("normalize_reward") else (0.0, 1.0)
    lm = AutoModelForCausalLM.from_pretrained(path).eval()  # the base model's tensors are the checkpoint's
    out = []
    with torch.no_grad():
        for seq in SEQUENCES:
            h = lm(input_ids=torch.tensor([seq]), output_hidden_states=True).hidden_states[-1][0, -1]
            out.append(((float(h @ w[0]) + float(b[0])) - mean) / std)
    return out


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_a_value_head_checkpoint_scores_what_its_library_computes(tmp_path, fmt):
    from transformers import AutoConfig

    from polyrl.config.roles import EngineRoleConfig, ModelConfig
    from polyrl.models.reward_heads import find_reward_head
    from polyrl.models.tiny import make_tiny_value_head_model
    from polyrl.reward_models.inputs import sequences_batch
    from polyrl_engine_fsdp.engine import FSDPEngine

    path = make_tiny_value_head_model(tmp_path / fmt, seed=3, **FORMATS[fmt])
    head = find_reward_head(str(path), AutoConfig.from_pretrained(path))
    assert (head.kind, head.outputs) == ("v_head" if fmt == "trl" else "value_head", 1)

    engine = FSDPEngine(EngineRoleConfig(model=ModelConfig(path=str(path)), micro_batch_size=2), role="reward_model",
                        model_type="value")
    got = engine.infer_batch(sequences_batch(SEQUENCES, pad_id=0))["values"][:, 0].tolist()
    want = _by_hand(path)
    assert len({round(x, 3) for x in want}) == len(want) and max(abs(x) for x in want) > 0.05
    assert got == pytest.approx(want, abs=1e-4)
