"""The ``reward_model`` role end to end with the FSDP engine and the hf rollout: a discriminative reward model
(a tiny sequence classifier) scoring a GRPO run, mixed with the rule reward; its scores against a plain
``transformers`` forward of the same sequences, with a tokenizer that differs from the policy's (re-templated);
a generative judge whose verdicts parse to nothing; and a reward model whose head does not output one score."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pytest
import torch

from polyrl.errors import ConfigError
from polyrl.trainer.commands import train


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory) -> Path:
    """A random-init tiny sequence classifier with the policy's (char) tokenizer."""
    from polyrl.models.tiny import make_tiny_reward_model

    return make_tiny_reward_model(tmp_path_factory.mktemp("rm") / "rm", size="tiny", seed=3)


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _policy_batch(tok, prompts: list, responses: list[str]):
    """A generated batch as the trainer hands it to the reward model: each prompt's chat tokens (left-padded) and
    its response's tokens with EOS (right-padded), the rows' chat messages in ``raw_prompt``."""
    from polyrl.batch import make_batch

    p_ids = [tok.apply_chat_template(p, add_generation_prompt=True, tokenize=True) for p in prompts]
    p_ids = [list(x["input_ids"] if hasattr(x, "keys") else x) for x in p_ids]
    r_ids = [tok(r, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for r in responses]
    pw, rw, pad = max(map(len, p_ids)), max(map(len, r_ids)), tok.pad_token_id
    prompt_t = torch.tensor([[pad] * (pw - len(p)) + p for p in p_ids])
    resp_t = torch.tensor([r + [pad] * (rw - len(r)) for r in r_ids])
    mask = torch.cat([torch.tensor([[0] * (pw - len(p)) + [1] * len(p) for p in p_ids]),
                      torch.tensor([[1] * len(r) + [0] * (rw - len(r)) for r in r_ids])], dim=1)
    return make_batch({"prompts": prompt_t, "responses": resp_t, "attention_mask": mask,
                       "response_mask": mask[:, pw:]},
                      {"raw_prompt": [json.dumps(p) for p in prompts], "data_source": ["arithmetic"] * len(prompts),
                       "ground_truth": [""] * len(prompts)})


def test_a_reward_model_mixed_with_the_rule_scores_a_grpo_run(base_overrides, manifest_file, tmp_path, reward_model):
    train(manifest_file, [], base_overrides + [
        "trainer.executor=local", "trainer.test_freq=0", "reward_model.enable=true",
        f"reward_model.model.path={reward_model}", "reward_model.micro_batch_size=4",
        "reward.combine.weights={rule: 1.0, rm: 0.5}"])
    steps = [r for r in _metrics(tmp_path / "run") if "critic/score/mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        for name in ("rule", "rm"):
            for stat in ("mean", "std", "min", "max", "failures"):
                assert math.isfinite(r[f"reward/{name}/{stat}"]), (name, stat)
        assert r["reward/rm/std"] > 0 and r["reward/rm/failures"] == 0  # the model scores each sample its own way
        # the trained score is the weighted sum of the two components
        assert r["critic/score/mean"] == pytest.approx(r["reward/rule/mean"] + 0.5 * r["reward/rm/mean"], abs=1e-5)
        assert r["actor/grad_norm"] > 0 and "acc/mean" in r


def test_reward_model_scores_match_a_transformers_forward_with_another_tokenizer(manifest_file, tmp_path,
                                                                                   tiny_model):
    """The reward model's tokenizer is not the policy's: each sample is decoded, re-templated with the reward
    model's chat template and re-tokenized, then scored at its last token by the FSDP engine; the scores must be
    those of ``AutoModelForSequenceClassification`` on the same text."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from polyrl import plugins
    from polyrl.config.loader import load_config
    from polyrl.config.schema import PolyrlConfig
    from polyrl.manifest import Manifest
    from polyrl.models.tiny import build_bpe_tokenizer, make_tiny_reward_model
    from polyrl.reward_models.scorer import RewardModelScorer, check_reward_model, reward_model_spec
    from polyrl.trainer.role_groups import build_role_groups

    texts = [f"What is {a}+{b}? {a + b}" for a in range(10) for b in range(10)] * 3
    rm_tok = build_bpe_tokenizer(texts, vocab_size=300)
    rm_tok.chat_template = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}")
    rm_path = make_tiny_reward_model(tmp_path / "rm_bpe", tokenizer=rm_tok, seed=5)
    manifest = Manifest.load(manifest_file)
    pm = plugins.activate(manifest)
    config = load_config(PolyrlConfig, [], [
        f"model.path={tiny_model}", "trainer.executor=local", "actor.engine=fsdp", "reward_model.enable=true",
        f"reward_model.model.path={rm_path}", "reward_model.micro_batch_size=2", "data.max_prompt_length=32",
        "data.max_response_length=8"], plugins=pm)
    policy_tok = AutoTokenizer.from_pretrained(tiny_model)
    rm_tokenizer = check_reward_model(config, pm, policy_tok)
    scorer = RewardModelScorer(config, policy_tokenizer=policy_tok, rm_tokenizer=rm_tokenizer, plugins=pm,
                               group=lambda: groups.reward_model)
    assert scorer.retemplate

    prompts = [[{"role": "user", "content": f"What is {a}+{b}?"}] for a, b in ((1, 2), (7, 5), (9, 9))]
    responses = ["3", "12 and more", "1"]
    batch = _policy_batch(policy_tok, prompts, responses)

    groups = build_role_groups(config, manifest=manifest, use_ref=False, use_critic=False, run_dir=tmp_path / "run",
                               extra_roles=[reward_model_spec(config)])
    try:
        got = scorer(batch).scores
    finally:
        groups.shutdown()

    model = AutoModelForSequenceClassification.from_pretrained(rm_path).eval()
    rm_tok = AutoTokenizer.from_pretrained(rm_path)  # as saved with the checkpoint
    want = []
    with torch.no_grad():
        for prompt, response in zip(prompts, responses):
            text = rm_tok.apply_chat_template(prompt + [{"role": "assistant", "content": response}], tokenize=False)
            ids = torch.tensor([rm_tok(text, add_special_tokens=False)["input_ids"]])
            want.append(float(model(input_ids=ids).logits[0, 0]))
    assert got == pytest.approx(want, abs=1e-4)
    assert len(set(round(w, 4) for w in want)) == 3  # three different samples, three different scores


def test_a_judge_whose_verdicts_hold_no_score_gives_the_fallback_with_one_warning(
        base_overrides, manifest_file, tmp_path, tiny_model, caplog):
    """The judge is the untrained tiny policy: its verdicts are noise, the ``score`` parser finds nothing."""
    with caplog.at_level(logging.WARNING, logger="polyrl"):
        train(manifest_file, [], base_overrides + [
            "trainer.executor=local", "trainer.test_freq=0", "trainer.total_steps=1", "reward_model.enable=true",
            "reward_model.kind=generative", f"reward_model.model.path={tiny_model}",
            "reward_model.judge.fallback_score=-1.0", "reward_model.rollout.response_length=8"])
    (step,) = [r for r in _metrics(tmp_path / "run") if "critic/score/mean" in r]
    assert step["reward/rm/failures"] == 16  # 4 prompts x 4 samples, none parsed
    assert step["critic/score/mean"] == -1.0 and step["reward/rm/mean"] == -1.0
    warnings = [r.getMessage() for r in caplog.records if "judge parser" in r.getMessage()]
    assert len(warnings) == 1 and "judge parser 'score' found no score in 16 of 16" in warnings[0]


def test_a_reward_model_whose_head_gives_two_scores_is_refused_before_workers_start(
        base_overrides, manifest_file, tmp_path):
    from polyrl.models.tiny import make_tiny_reward_model

    two = make_tiny_reward_model(tmp_path / "rm2", num_labels=2)
    with pytest.raises(ConfigError) as err:
        train(manifest_file, [], base_overrides + ["trainer.executor=local", "reward_model.enable=true",
                                                   f"reward_model.model.path={two}"])
    assert "\n" not in str(err.value)
    assert "outputs 2 scores per token; a reward model must output one score (num_labels=1)" in str(err.value)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_reward_model_scores_a_data_source_no_reward_function_knows(base_overrides, manifest_file, tmp_path,
                                                                      reward_model, arithmetic_files):
    """Chat-style data (no rule for its ``data_source``) trains on the reward model alone: the start-up reward
    check does not refuse it, and the score is the reward model's."""
    from polyrl.data.synthetic import write_jsonl

    rows = [json.loads(line) for line in arithmetic_files["train"].read_text().splitlines()]
    chat = write_jsonl([dict(r, data_source="my_chat") for r in rows], tmp_path / "chat.jsonl")
    overrides = [o for o in base_overrides if not o.startswith(("data.train_files", "data.val_files", "reward.function"))]
    train(manifest_file, [], overrides + [
        f"data.train_files=[{chat}]", "trainer.executor=local", "trainer.total_steps=1", "trainer.test_freq=0",
        "trainer.val_before_train=false", "reward_model.enable=true", f"reward_model.model.path={reward_model}"])
    (step,) = [r for r in _metrics(tmp_path / "run") if "critic/score/mean" in r]
    assert step["critic/score/mean"] == pytest.approx(step["reward/rm/mean"], abs=1e-5) and step["reward/rm/std"] > 0
    assert "reward/rule/mean" not in step  # no rule scores this data source


def test_an_unreachable_sandbox_fusion_url_is_one_line_at_start_up(base_overrides, manifest_file, tmp_path):
    import socket

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there
    with pytest.raises(ConfigError) as err:
        train(manifest_file, [], base_overrides + [
            "trainer.executor=local", f"reward.sandbox_fusion.url=http://127.0.0.1:{port}/run_code",
            "reward.sandbox_fusion.retries=0"])
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"reward.sandbox_fusion.url=http://127.0.0.1:{port}/run_code: cannot connect")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()



def test_a_reward_model_scores_each_sample_the_same_colocated_and_in_a_pool_of_its_own(
        manifest_file, tmp_path, tiny_model, reward_model):
    """The same reward model scoring the same batch in two placements: colocated (one group holding actor,
    rollout and reward model, the reward model offloaded between calls; the local executor, so in this process)
    and on Ray in a pool of its own of two workers (FSDP over a gloo group: the rows are split over two
    data-parallel ranks, 7 rows padded to 8, and travel through Ray). Micro-batches are packed by a token budget
    (``use_dynamic_bsz``), so rows of several widths share them. Per sample, in both row orders and on a second
    call, both placements must give the scores of a plain ``transformers`` forward, and each other's."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from polyrl import plugins
    from polyrl.config.loader import load_config
    from polyrl.config.schema import PolyrlConfig
    from polyrl.manifest import Manifest
    from polyrl.reward_models.scorer import RewardModelScorer, check_reward_model, reward_model_spec
    from polyrl.trainer.role_groups import build_role_groups

    manifest = Manifest.load(manifest_file)
    pm = plugins.activate(manifest)
    common = [f"model.path={tiny_model}", "reward_model.enable=true", f"reward_model.model.path={reward_model}",
              "reward_model.use_dynamic_bsz=true", "reward_model.max_token_len_per_gpu=64",
              "data.max_prompt_length=32", "data.max_response_length=16"]
    placements = {"colocated": ["trainer.executor=local"],
                  "own pool": ["trainer.executor=ray", "trainer.n_workers=1", "trainer.ray_num_cpus=3",
                               "trainer.placement={actor: main, rollout: main, reward_model: rm}",
                               "trainer.pools={rm: 2}"]}
    tok = AutoTokenizer.from_pretrained(tiny_model)
    prompts = [[{"role": "user", "content": f"What is {a}+{b}?"}] for a, b in ((1, 2), (7, 5), (9, 9), (0, 0),
                                                                                (4, 8), (3, 3), (6, 1))]
    responses = ["3", "12 and more", "1", "", "twelve, I think", "6", "7" * 12]
    batch = _policy_batch(tok, prompts, responses)
    backwards = torch.arange(len(prompts) - 1, -1, -1)

    got: dict[str, list[float]] = {}
    for name, placement in placements.items():
        config = load_config(PolyrlConfig, [], common + placement, plugins=pm)
        rm_tok = check_reward_model(config, pm, tok)
        groups = build_role_groups(config, manifest=manifest, use_ref=False, use_critic=False,
                                   run_dir=tmp_path / name.replace(" ", "_"), extra_roles=[reward_model_spec(config)])
        try:
            scorer = RewardModelScorer(config, policy_tokenizer=tok, rm_tokenizer=rm_tok, plugins=pm,
                                       group=lambda g=groups: g.reward_model)
            layout = (groups.reward_model.world_size, groups.reward_model is groups.actor)
            assert layout == ((1, True) if name == "colocated" else (2, False)), (name, layout)
            got[name] = scorer(batch).scores
            got[name + " backwards"] = scorer(batch[backwards]).scores[::-1]
            got[name + " again"] = scorer(batch).scores  # colocated: after an offload and a reload
        finally:
            groups.shutdown()

    model = AutoModelForSequenceClassification.from_pretrained(reward_model).eval()
    with torch.no_grad():
        want = [float(model(input_ids=torch.tensor([ids])).logits[0, 0]) for ids in scorer.inputs.sequences(batch)]
    assert len({round(w, 4) for w in want}) == len(want)  # every sample its own score: a mix-up would show
    for name, scores in got.items():
        assert scores == pytest.approx(want, abs=1e-5), name
    assert got["own pool"] == pytest.approx(got["colocated"], abs=1e-6)
