"""``reward_model.engine=megatron``: the reward model on megatron-core (on CPU behind
``polyrl_engine_megatron.cpu_emulation``), its value head read at the sequence's last token, scores what the
fsdp engine and a plain ``transformers`` forward score from the same checkpoint: a sequence classifier through
the whole ``reward_model`` role (config, start-up checks, the worker's ``compute_rm_score``), and decoders saved
with TRL's ``v_head`` and OpenRLHF's normalised ``score`` head through the engine."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from engine_dist import make_engine  # noqa: E402

SEQUENCES = [[9, 40, 41, 42, 1], [9, 50, 3], [9, 60, 61, 62, 63, 64, 65, 1], [9]]


def _transformers_scores(rm_path: Path, sequences: list[list[int]]) -> list[float]:
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(rm_path).eval()
    with torch.no_grad():
        return [float(model(input_ids=torch.tensor([s])).logits[0, 0]) for s in sequences]


def test_a_megatron_reward_model_scores_like_the_fsdp_one_and_transformers(tmp_path):
    from transformers import AutoTokenizer

    from polyrl import plugins
    from polyrl.batch import make_batch
    from polyrl.config.loader import load_config
    from polyrl.config.schema import PolyrlConfig
    from polyrl.manifest import Manifest
    from polyrl.models.tiny import make_tiny_model, make_tiny_reward_model
    from polyrl.reward_models.scorer import RewardModelScorer, check_reward_model, reward_model_spec
    from polyrl.trainer.role_groups import build_role_groups

    policy = make_tiny_model(tmp_path / "policy", seed=0)
    rm_path = make_tiny_reward_model(tmp_path / "rm", seed=3)
    manifest_file = tmp_path / "polyrl.toml"
    manifest_file.write_text('[plugins]\nrequire = ["polyrl-engine-fsdp", "polyrl-engine-megatron"]\n')
    manifest = Manifest.load(manifest_file)
    pm = plugins.activate(manifest)
    tok = AutoTokenizer.from_pretrained(policy)
    prompts = ["What is 1+2?", "What is 7+5?", "What is 9+9?"]
    responses = ["3", "12 and more", ""]
    p_ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    r_ids = [tok(r, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for r in responses]
    pw, rw, pad = max(map(len, p_ids)), max(map(len, r_ids)), tok.pad_token_id
    mask = torch.cat([torch.tensor([[0] * (pw - len(p)) + [1] * len(p) for p in p_ids]),
                      torch.tensor([[1] * len(r) + [0] * (rw - len(r)) for r in r_ids])], dim=1)
    batch = make_batch({"prompts": torch.tensor([[pad] * (pw - len(p)) + p for p in p_ids]),
                        "responses": torch.tensor([r + [pad] * (rw - len(r)) for r in r_ids]),
                        "attention_mask": mask, "response_mask": mask[:, pw:]},
                       {"raw_prompt": [json.dumps(p) for p in prompts], "data_source": ["arithmetic"] * 3})

    got = {}
    for engine in ("fsdp", "megatron"):
        config = load_config(PolyrlConfig, [], [
            f"model.path={policy}", "trainer.executor=local", "reward_model.enable=true",
            f"reward_model.model.path={rm_path}", f"reward_model.engine={engine}", "reward_model.micro_batch_size=2",
            "data.max_prompt_length=32", "data.max_response_length=16"], plugins=pm)
        assert config.reward_model.engine == engine
        rm_tok = check_reward_model(config, pm, tok)
        groups = build_role_groups(config, manifest=manifest, use_ref=False, use_critic=False,
                                   run_dir=tmp_path / engine, extra_roles=[reward_model_spec(config)])
        try:
            built = type(groups.reward_model.worker.role_engine("reward_model")).__name__
            assert built == {"fsdp": "FSDPEngine", "megatron": "MegatronEngine"}[engine]
            scorer = RewardModelScorer(config, policy_tokenizer=tok, rm_tokenizer=rm_tok, plugins=pm,
                                       group=lambda g=groups: g.reward_model)
            got[engine] = scorer(batch).scores
        finally:
            groups.shutdown()
    want = _transformers_scores(rm_path, scorer.inputs.sequences(batch))
    assert len({round(w, 4) for w in want}) == 3
    assert got["fsdp"] == pytest.approx(want, abs=1e-5)
    assert got["megatron"] == pytest.approx(want, abs=1e-5)


@pytest.mark.parametrize("fmt", ["trl", "openrlhf"])
def test_a_megatron_reward_model_loads_a_trl_or_openrlhf_value_head(tmp_path, fmt):
    """The saved head, not a zero one: megatron's scores are the fsdp engine's (itself checked against a hand
    computation in engine-fsdp's test_reward_heads.py), OpenRLHF's ``(r - mean) / std`` included."""
    from polyrl.config.roles import EngineRoleConfig, ModelConfig
    from polyrl.models.tiny import make_tiny_value_head_model
    from polyrl.platforms import CPUPlatform
    from polyrl.reward_models.inputs import sequences_batch
    from polyrl_engine_fsdp.engine import FSDPEngine

    kw = dict(library="trl") if fmt == "trl" else dict(library="openrlhf", value_head_prefix="score",
                                                       normalize=(0.75, 2.5))
    path = make_tiny_value_head_model(tmp_path / fmt, seed=3, **kw)
    batch = sequences_batch(SEQUENCES, pad_id=0)
    mega = make_engine(str(path), role="reward_model", model_type="value").infer_batch(batch)["values"][:, 0]
    fsdp = FSDPEngine(EngineRoleConfig(model=ModelConfig(path=str(path))), role="reward_model", model_type="value",
                      platform=CPUPlatform()).infer_batch(batch)["values"][:, 0]
    assert fsdp.abs().min() > 0.05 and len({round(x, 3) for x in fsdp.tolist()}) == len(SEQUENCES)
    assert torch.allclose(mega, fsdp, atol=1e-5), (mega, fsdp)
