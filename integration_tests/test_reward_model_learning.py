"""GRPO driven only by a reward model trained in the test lifts held-out accuracy; the same model trained on
shuffled labels does not. Both kinds: a sequence classifier, and a generative judge read by the ``score`` parser.

The task: the quickstart's arithmetic prompts (every single-digit sum ``a+b=``, 80 to train on, 20 held out) with
the recipes' learning tests' rule, answer in digits (the fraction of digits among the first 6 characters; it
labels the reward models' training data and measures ``acc``, weighted 0 in ``reward.combine``). The policy is
the random-init tiny model (held-out 0.04-0.06). The reward models are trained here from random init on 1,360
answers (8 per train prompt sampled from the policy, 3 numbers, an empty answer, a one-character one, 4 strings
of random byte tokens), each labelled by the rule: the classifier with BCE on its score (80 steps), the judge to
write ``Score: 1`` (a digit among the first 6 characters) or ``Score: 0`` (80 steps). GRPO: 30 steps of 4 prompts
x 4 samples, lr 1e-2, advantages not divided by the group's std (a reward model's continuous scores among
equally wrong answers are noise the std would blow up); held-out accuracy, 4 samples per prompt at temperature 1,
at steps 0, 10, 20, 30.

Measured (2 CPU cores, 2026-11, ``trainer.seed`` 1 / 2 / 3):

- classifier (ranks 0.98 of differently labelled answer pairs right; shuffled labels: 0.59):
  0.06 0.25 0.98 1.00 / 0.04 0.26 0.98 1.00 / 0.05 0.11 0.74 1.00;
  shuffled labels: 0.06 0.05 0.04 0.00 / 0.04 0.03 0.00 0.00 / 0.05 0.03 0.01 0.00;
- judge (its verdicts parse to the label on 0.98 of the answers; shuffled verdicts: 0.66, it learnt to always
  write ``Score: 0``, so the policy does not move): 0.06 0.36 0.80 0.86 / 0.04 0.31 0.89 0.96 / 0.05 0.20 0.65 0.79;
  shuffled verdicts: 0.06 flat / 0.04 flat / 0.05 flat.

Before the empty, one-character and random-byte answers were in the classifier's training data, GRPO found its
blind spots (an immediate EOS; 6 bytes that decode to no text) and held-out accuracy went to 0. Exact sums were tried first and are not what this shows: see
docs/reward_models.md, "What the tests show". The test runs seed 1 of each.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from polyrl.trainer.commands import train

#: The task's rule (the recipes' learning tests use it too): the fraction of digits among the first 6 characters
#: of the answer. It labels the reward model's training data and measures ``acc``; it never scores a GRPO sample.
DIGITS = (
    "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
    "    text = solution_str[:6]\n"
    "    frac = sum(c.isdigit() for c in text) / max(1, len(text)) if text else 0.0\n"
    "    return {'score': frac, 'acc': frac}\n"
)
RM_STEPS = 80
#: The judge's prompt (one user message through the judge's chat template); the judge answers ``Score: 1`` when
#: the answer holds a digit among its first 6 characters, else ``Score: 0``.
JUDGE_TEMPLATE = "Q {prompt} A {response}"
JUDGE_STEPS = 80
GRPO_STEPS = 30


def _digits(text: str) -> float:
    text = text[:6]
    return sum(c.isdigit() for c in text) / max(1, len(text)) if text else 0.0


def _addition_rows() -> tuple[list[dict], list[dict]]:
    """Every single-digit sum ``a+b=`` (the quickstart's arithmetic), shuffled: 80 to train on, 20 held out."""
    pairs = [(a, b) for a in range(10) for b in range(10)]
    random.Random(0).shuffle(pairs)
    rows = [{"prompt": [{"role": "user", "content": f"{a}+{b}="}], "data_source": "arithmetic",
             "reward_model": {"style": "rule", "ground_truth": str(a + b)},
             "extra_info": {"index": i, "a": a, "b": b, "op": "+"}} for i, (a, b) in enumerate(pairs)]
    return rows[:80], rows[80:]


#: The overrides that make the reward model a generative judge.
JUDGE = ("reward_model.kind=generative", f"reward_model.judge.template='{JUDGE_TEMPLATE}'",
         "reward_model.judge.parser=score", "reward_model.rollout.response_length=10")


def _rm_examples(policy_dir: Path, rows: list[dict], samples: int = 8) -> list[tuple[list[int], float]]:
    """(prompt + answer token ids, label) pairs to train a reward model on, ``samples + 9`` to a prompt: what the
    starting policy samples (the answers GRPO will ask the reward model to score), three answers in digits (the
    right sum and two other numbers), an empty answer, a one-character one and four strings of 6 random byte
    tokens, each labelled with the task's rule. Without the last ones GRPO found the reward model's blind spots:
    an empty answer, or 6 bytes that are no UTF-8 text, neither seen in training and both scored near the top."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from polyrl.models.tiny import SPECIAL_TOKENS

    tok = AutoTokenizer.from_pretrained(policy_dir)
    policy = AutoModelForCausalLM.from_pretrained(policy_dir)
    rng = random.Random(0)
    first = len(SPECIAL_TOKENS)  # the byte tokens follow the special ones
    torch.manual_seed(0)
    out: list[tuple[list[int], float]] = []
    for row in rows:
        prompt = list(tok.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True,
                                              return_dict=True)["input_ids"])
        with torch.no_grad():
            gen = policy.generate(torch.tensor([prompt] * samples), do_sample=True, temperature=1.0, top_k=0,
                                  max_new_tokens=6, pad_token_id=tok.pad_token_id)
        answers = [g[len(prompt):].tolist() for g in gen]
        answers = [a[: a.index(tok.eos_token_id) + 1] if tok.eos_token_id in a else a for a in answers]
        for text in (row["reward_model"]["ground_truth"], str(rng.randint(0, 99)), str(rng.randint(0, 999)), "",
                     rng.choice("abcxyz?!. ")):
            answers.append(tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id])
        answers += [[rng.randrange(first, policy.config.vocab_size) for _ in range(6)] for _ in range(4)]
        for answer in answers:
            out.append((prompt + answer, _digits(tok.decode(answer, skip_special_tokens=True))))
    return out


def _padded(seqs: list[list[int]], pad: int):
    """Right-padded ids and attention mask (a sequence classifier reads the last non-pad token)."""
    import torch

    ids = torch.full((len(seqs), max(map(len, seqs))), pad)
    attention = torch.zeros_like(ids)
    for i, x in enumerate(seqs):
        ids[i, : len(x)] = torch.tensor(x)
        attention[i, : len(x)] = 1
    return ids, attention


def _train_rm(rm_dir: Path, examples: list[tuple[list[int], float]], steps: int, *, shuffle_labels: bool) -> Path:
    """Train the sequence classifier at ``rm_dir`` in place (BCE of its one score at the last token against the
    label, batches of 128, AdamW). ``shuffle_labels``: the labels permuted across the examples first (the
    control: a reward model trained the same way on no signal)."""
    import torch
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(0)
    labels = torch.tensor([y for _, y in examples])
    if shuffle_labels:
        labels = labels[torch.randperm(len(labels))]
    model = AutoModelForSequenceClassification.from_pretrained(rm_dir)
    ids, attention = _padded([x for x, _ in examples], model.config.pad_token_id)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    for _ in range(steps):
        idx = torch.randperm(len(examples))[:128]
        logits = model(input_ids=ids[idx], attention_mask=attention[idx]).logits[:, 0]
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels[idx])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.save_pretrained(rm_dir)
    return rm_dir


def _rm_ranking(rm_dir: Path, examples: list[tuple[list[int], float]], per_prompt: int) -> float:
    """The fraction of pairs of answers to the same prompt with different labels that the reward model orders as
    the labels do (``examples`` come ``per_prompt`` to a prompt, as :func:`_rm_examples` makes them)."""
    import torch
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(rm_dir).eval()
    ids, attention = _padded([x for x, _ in examples], model.config.pad_token_id)
    with torch.no_grad():
        scores = model(input_ids=ids, attention_mask=attention).logits[:, 0].tolist()
    good = total = 0
    for start in range(0, len(examples), per_prompt):
        group = range(start, start + per_prompt)
        for i in group:
            for j in group:
                if examples[i][1] > examples[j][1]:
                    good += scores[i] > scores[j]
                    total += 1
    return good / max(1, total)


def _grpo(manifest: Path, policy: Path, rm: Path, files: dict[str, Path], run: Path, seed: int,
          extra: tuple[str, ...] = ()) -> list[float]:
    """GRPO scored by the reward model alone (the rule only measures ``acc``); held-out accuracy (4 samples per
    prompt at temperature 1) before training and every 10 steps."""
    train(manifest, [], [
        f"model.path={policy}", f"data.train_files=[{files['train']}]", f"data.val_files=[{files['val']}]",
        f"reward.function={files['rule']}:compute_score",
        "reward_model.enable=true", f"reward_model.model.path={rm}", "reward_model.micro_batch_size=64",
        "reward.combine.weights={rm: 1.0}",
        "data.train_batch_size=4", "data.max_prompt_length=32", "data.max_response_length=6",
        "actor.engine=fsdp", "actor.ppo_mini_batch_size=4", "actor.micro_batch_size=16", "actor.optim.lr=1e-2",
        "rollout.n=4", "rollout.val_temperature=1.0", "rollout.val_n=4", "algorithm.norm_adv_by_std_in_grpo=false",
        f"trainer.total_steps={GRPO_STEPS}", "trainer.test_freq=10", "trainer.val_before_train=true",
        "trainer.executor=local", "trainer.save_freq=0", "trainer.progress_bar=false", "trainer.logger=[jsonl]",
        f"trainer.run_dir={run}", f"trainer.seed={seed}", *extra])
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "critic/score/mean" in r]
    assert [r["step"] for r in steps] == list(range(1, GRPO_STEPS + 1))
    for r in steps:  # trained on the reward model's score alone (the rule is logged, weighted 0)
        assert r["reward/rm/failures"] == 0
        assert r["critic/score/mean"] == pytest.approx(r["reward/rm/mean"], abs=1e-5)
    return [r["val/arithmetic/mean@4"] for r in rows if "val/arithmetic/mean@4" in r]


@pytest.fixture(scope="module")
def task(tmp_path_factory) -> dict:
    """The random-init tiny policy, the task's files, and two reward models trained from the same random init on
    the same examples: one on their labels, one on the labels shuffled."""
    from polyrl.data.synthetic import write_jsonl
    from polyrl.models.tiny import make_tiny_model, make_tiny_reward_model

    root = tmp_path_factory.mktemp("rm_learning")
    train_rows, held_out = _addition_rows()
    (root / "digits.py").write_text(DIGITS)
    files = {"train": write_jsonl(train_rows, root / "train.jsonl"), "val": write_jsonl(held_out, root / "val.jsonl"),
             "rule": root / "digits.py"}
    policy = make_tiny_model(root / "policy", seed=0)
    examples = _rm_examples(policy, train_rows)
    per_prompt = len(examples) // len(train_rows)
    rms = {name: _train_rm(make_tiny_reward_model(root / name, seed=3), examples, RM_STEPS, shuffle_labels=shuffled)
           for name, shuffled in (("rm", False), ("shuffled_rm", True))}
    return {"files": files, "policy": policy, "examples": examples, "per_prompt": per_prompt, **rms}


def test_grpo_on_a_trained_reward_model_lifts_held_out_accuracy_and_a_shuffled_one_does_not(
        task, manifest_file, tmp_path):
    ranking = _rm_ranking(task["rm"], task["examples"], task["per_prompt"])
    assert ranking >= 0.9, ranking  # the reward model learnt to rank (measured: 0.98; shuffled labels: 0.59)
    real = _grpo(manifest_file, task["policy"], task["rm"], task["files"], tmp_path / "real", seed=1)
    control = _grpo(manifest_file, task["policy"], task["shuffled_rm"], task["files"], tmp_path / "control", seed=1)
    assert len(real) == len(control) == GRPO_STEPS // 10 + 1
    assert real[0] == control[0] < 0.2, (real, control)  # the same start: a random-init policy
    assert real[-1] >= 0.6 and real[-1] >= real[0] + 0.5, (real, control)
    assert control[-1] <= control[0] + 0.1, (real, control)


def _judge_examples(policy_dir: Path, examples: list[tuple[list[int], float]], rows: list[dict],
                    per_prompt: int) -> list[tuple[list[int], list[int], int]]:
    """The reward model's examples as the judge sees them: (judge prompt ids, verdict ids, label), the prompt
    filled in from the row's question and the answer's text as the reward-model role decodes it."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(policy_dir)
    out = []
    for k, (ids, _) in enumerate(examples):
        row = rows[k // per_prompt]
        prompt_len = len(tok.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True,
                                                 return_dict=True)["input_ids"])
        answer = tok.decode(ids[prompt_len:], skip_special_tokens=True)
        label = int(_digits(answer) > 0)
        message = JUDGE_TEMPLATE.format(prompt=row["prompt"][-1]["content"], response=answer)
        prompt = list(tok.apply_chat_template([{"role": "user", "content": message}], add_generation_prompt=True,
                                              tokenize=True, return_dict=True)["input_ids"])
        out.append((prompt, tok(f"Score: {label}", add_special_tokens=False)["input_ids"] + [tok.eos_token_id], label))
    return out


def _train_judge(judge_dir: Path, examples: list[tuple[list[int], list[int], int]], steps: int, *,
                 shuffle_labels: bool) -> Path:
    """Fine-tune the causal LM at ``judge_dir`` in place to write each example's verdict (loss on the verdict and
    EOS, batches of 128, AdamW); ``shuffle_labels``: the verdicts permuted across the examples first."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    verdicts = [v for _, v, _ in examples]
    if shuffle_labels:
        verdicts = [verdicts[i] for i in torch.randperm(len(verdicts)).tolist()]
    model = AutoModelForCausalLM.from_pretrained(judge_dir)
    seqs = [p + v for (p, _, _), v in zip(examples, verdicts)]
    ids, attention = _padded(seqs, model.config.pad_token_id)
    labels = torch.full_like(ids, -100)
    for i, ((p, _, _), v) in enumerate(zip(examples, verdicts)):
        labels[i, len(p): len(p) + len(v)] = torch.tensor(v)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    for _ in range(steps):
        idx = torch.randperm(len(seqs))[:128]
        loss = model(input_ids=ids[idx], attention_mask=attention[idx], labels=labels[idx]).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.save_pretrained(judge_dir)
    return judge_dir


def _judge_accuracy(judge_dir: Path, examples: list[tuple[list[int], list[int], int]]) -> float:
    """The fraction of examples whose greedy verdict the ``score`` parser reads as the example's label."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from polyrl.reward_models.parsers import parse_score_line

    tok = AutoTokenizer.from_pretrained(judge_dir)
    model = AutoModelForCausalLM.from_pretrained(judge_dir).eval()
    width = max(len(p) for p, _, _ in examples)
    ids = torch.tensor([[tok.pad_token_id] * (width - len(p)) + p for p, _, _ in examples])
    attention = (torch.arange(width)[None, :] >= torch.tensor([width - len(p) for p, _, _ in examples])[:, None]).long()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=attention, do_sample=False, max_new_tokens=10,
                             pad_token_id=tok.pad_token_id)
    verdicts = [tok.decode(o[width:], skip_special_tokens=True) for o in out]
    return sum(parse_score_line(v) == label for v, (_, _, label) in zip(verdicts, examples)) / len(examples)


def test_grpo_on_a_judge_fine_tuned_to_write_its_score_lifts_held_out_accuracy_and_a_shuffled_one_does_not(
        task, manifest_file, tmp_path):
    from polyrl.models.tiny import make_tiny_model

    root = tmp_path / "judges"
    examples = _judge_examples(task["policy"], task["examples"], _addition_rows()[0], task["per_prompt"])
    judge = _train_judge(make_tiny_model(root / "judge", seed=4), examples, JUDGE_STEPS, shuffle_labels=False)
    shuffled = _train_judge(make_tiny_model(root / "shuffled", seed=4), examples, JUDGE_STEPS, shuffle_labels=True)
    accuracy = _judge_accuracy(judge, examples)
    assert accuracy >= 0.9, accuracy  # its verdicts parse to the right score (measured: 0.98; shuffled: 0.66)
    real = _grpo(manifest_file, task["policy"], judge, task["files"], tmp_path / "real", seed=1, extra=JUDGE)
    control = _grpo(manifest_file, task["policy"], shuffled, task["files"], tmp_path / "control", seed=1,
                    extra=JUDGE)
    assert real[0] == control[0] < 0.2, (real, control)
    assert real[-1] >= 0.5 and real[-1] >= real[0] + 0.4, (real, control)
    assert control[-1] <= control[0] + 0.1, (real, control)
