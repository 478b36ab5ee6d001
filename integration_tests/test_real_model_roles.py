"""The real pretrained SmolLM2-135M-Instruct (polyrl.testing's ``real_model_dir``) in the roles besides the policy: a
reward model on its backbone scoring samples through the ``reward_model`` role, and the teacher of an on-policy
distillation run."""

from __future__ import annotations

import json
import math

import pytest
import torch


def _chat_batch(tok, prompts: list, responses: list[str]):
    """A generated batch as the trainer hands it to the reward model: chat-templated prompts (left-padded), responses
    ending with the end-of-turn token (right-padded), the rows' messages in ``raw_prompt``."""
    from polyrl.batch import make_batch

    p_ids = [tok.apply_chat_template(p, add_generation_prompt=True, tokenize=True) for p in prompts]
    p_ids = [list(x["input_ids"] if hasattr(x, "keys") else x) for x in p_ids]
    r_ids = [tok(r, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for r in responses]
    pw, rw, pad = max(map(len, p_ids)), max(map(len, r_ids)), tok.pad_token_id
    mask = torch.cat([torch.tensor([[0] * (pw - len(p)) + [1] * len(p) for p in p_ids]),
                      torch.tensor([[1] * len(r) + [0] * (rw - len(r)) for r in r_ids])], dim=1)
    return make_batch({"prompts": torch.tensor([[pad] * (pw - len(p)) + p for p in p_ids]),
                       "responses": torch.tensor([r + [pad] * (rw - len(r)) for r in r_ids]),
                       "attention_mask": mask, "response_mask": mask[:, pw:]},
                      {"raw_prompt": [json.dumps(p) for p in prompts], "data_source": ["real"] * len(prompts),
                       "ground_truth": [""] * len(prompts)})


@pytest.mark.timeout(300)  # about 30 s on 2 quiet cores
def test_a_reward_model_on_the_real_backbone_scores_through_the_role(real_model_dir, tmp_path):
    """A sequence classifier initialised from the real model (its 30 pretrained layers, a fresh one-score head)
    scores chat samples through the ``reward_model`` role (the FSDP engine in a local worker group); the scores
    are those of the transformers model's backbone and score head on the same tokens (the chat prompt and the answer
    up to its ``<|im_end|>``), at the last token."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from polyrl import plugins
    from polyrl.config.loader import load_config
    from polyrl.config.schema import PolyrlConfig
    from polyrl.manifest import Manifest
    from polyrl.reward_models.scorer import RewardModelScorer, check_reward_model, reward_model_spec
    from polyrl.trainer.role_groups import build_role_groups

    torch.manual_seed(0)
    rm = AutoModelForSequenceClassification.from_pretrained(real_model_dir, num_labels=1)
    tok = AutoTokenizer.from_pretrained(real_model_dir)
    rm.config.pad_token_id = tok.pad_token_id
    backbone = rm.model.layers[29].mlp.down_proj.weight.detach().clone()
    rm_path = tmp_path / "smollm2-rm"
    rm.save_pretrained(rm_path)
    tok.save_pretrained(rm_path)
    (tmp_path / "polyrl.toml").write_text('[plugins]\nrequire = ["polyrl-engine-fsdp>=0.1,<0.2"]\n')
    manifest = Manifest.load(tmp_path / "polyrl.toml")
    pm = plugins.activate(manifest)
    config = load_config(PolyrlConfig, [], [
        f"model.path={real_model_dir}", "trainer.executor=local", "actor.engine=fsdp", "reward_model.enable=true",
        f"reward_model.model.path={rm_path}", "reward_model.micro_batch_size=2", "data.max_prompt_length=48",
        "data.max_response_length=16"], plugins=pm)
    rm_tokenizer = check_reward_model(config, pm, tok)
    scorer = RewardModelScorer(config, policy_tokenizer=tok, rm_tokenizer=rm_tokenizer, plugins=pm,
                               group=lambda: groups.reward_model)
    prompts = [[{"role": "user", "content": "What is 7+8? Answer with the number only."}]] * 2 + \
              [[{"role": "user", "content": "Name a primary colour."}]]
    responses = ["7 + 8 = 15", "The answer is 16.", "Red is a primary colour."]
    batch = _chat_batch(tok, prompts, responses)
    groups = build_role_groups(config, manifest=manifest, use_ref=False, use_critic=False, run_dir=tmp_path / "run",
                               extra_roles=[reward_model_spec(config)])
    try:
        got = scorer(batch).scores
    finally:
        groups.shutdown()

    model = AutoModelForSequenceClassification.from_pretrained(rm_path).eval()
    assert torch.equal(model.model.layers[29].mlp.down_proj.weight, backbone)  # the pretrained backbone, kept
    # polyrl (as verl) scores the sample's last token, its <|im_end|>. transformers' own pooling in
    # LlamaForSequenceClassification looks for the last token that is not the pad token, and this model's pad token
    # is <|im_end|>: it scores the token before it (docs/real_models.md). So the reference is the backbone's last
    # hidden state through the score head.
    want = []
    with torch.no_grad():  # the reward model shares the policy's tokenizer: it scores the sample's own tokens
        for row in range(3):
            ids = torch.cat([batch["prompts"][row], batch["responses"][row]])[batch["attention_mask"][row].bool()]
            assert tok.decode(ids).endswith(responses[row] + "<|im_end|>")
            want.append(float(model.score(model.model(input_ids=ids[None]).last_hidden_state[0, -1])[0]))
    assert got == pytest.approx(want, abs=1e-4)
    assert len({round(w, 3) for w in want}) == 3  # three samples, three scores


@pytest.mark.timeout(300)  # about 40 s on 2 quiet cores
def test_the_real_model_teaches_a_small_student(real_model_dir, tmp_path):
    """On-policy distillation (polyrl-recipes' ``distill`` trainer, ``forward_kl_topk``: the teacher's top 16 tokens at
    each position of the student's own samples) with the real model as the teacher and a small random Llama with the
    real model's tokenizer as the student, on one chat prompt: every step's loss is finite and it falls over 10
    steps. (With the per-token reverse KL, ``k3`` backpropagated or ``k1`` as the policy-gradient advantage, a
    random student over 49,152 tokens stayed at a KL of about 5 for 10 steps: one sampled token a position is too
    little signal at this size; the top-k loss is dense.)"""
    pytest.importorskip("polyrl_recipes")
    from transformers import AutoTokenizer

    from polyrl.models.tiny import make_tiny_model
    from polyrl.trainer.commands import train

    tok = AutoTokenizer.from_pretrained(real_model_dir)
    student = make_tiny_model(tmp_path / "student", arch="llama", size="tiny", tokenizer=tok, seed=0)
    row = {"prompt": [{"role": "user", "content": "What is 7+8? Answer with the number only."}],
           "data_source": "real", "reward_model": {"ground_truth": "15"}}
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps(row) for _ in range(8)) + "\n")
    (tmp_path / "reward.py").write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                                        "    return float(ground_truth in solution_str)\n")
    (tmp_path / "polyrl.toml").write_text(
        '[plugins]\nrequire = ["polyrl-engine-fsdp>=0.1,<0.2", "polyrl-recipes>=0.1,<0.2"]\n')
    run = tmp_path / "run"
    train(tmp_path / "polyrl.toml", [], [
        f"model.path={student}", f"reward.function={tmp_path / 'reward.py'}:compute_score",
        f"data.train_files=[{tmp_path / 'train.jsonl'}]", "data.train_batch_size=2", "data.max_prompt_length=48",
        "data.max_response_length=8", "actor.ppo_mini_batch_size=2", "actor.micro_batch_size=8",
        "actor.optim.lr=1e-2", "rollout.n=4", "trainer.total_steps=10", "trainer.progress_bar=false",
        "trainer.logger=[jsonl]", f"trainer.run_dir={run}", "trainer.executor=local", "trainer.test_freq=0",
        "trainer.val_before_train=false", "trainer.save_freq=0", "trainer.seed=1",
        "trainer.name=distill", f"trainer.distill.teacher.model.path={real_model_dir}",
        "trainer.distill.teacher.micro_batch_size=8", "trainer.distill.loss_mode=forward_kl_topk",
        "trainer.distill.topk=16",
        "trainer.distill.use_task_rewards=false"])
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    kl = [r["distill/reverse_kl"] for r in steps if "distill/reverse_kl" in r]
    losses = [r["distill/loss"] for r in steps if "distill/loss" in r]
    assert len(kl) == 10 and len(losses) == 10
    assert all(math.isfinite(v) for v in kl + losses)
    print("reverse KL per step:", [round(v, 2) for v in kl], "loss", [round(v, 3) for v in losses])
    # measured (seed 1): 4.41 -> 2.22, the mean of the first three steps and of the last three
    assert sum(losses[-3:]) / 3 < 0.7 * sum(losses[:3]) / 3, losses
