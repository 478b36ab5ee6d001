"""The quickstart's arithmetic task with reward models trained in code (helpers of ``test_reward_model_e2e.py``).

* **Warm start** (:func:`warm_start`): the tiny policy is fine-tuned with ``polyrl sft`` on answers of which half
  carry one stray digit after the right answer (``7+5=`` -> ``12`` or ``124``), so the warm policy knows the sums
  but is undecided whether to stop after them: it is right about a third of the time, and RL has a signal that
  carries over to prompts it never trains on (stopping after the answer is one behaviour for every prompt).
* **Reward model** (:func:`train_reward_model`): a sequence classifier initialised from the warm policy, trained
  with a pairwise (Bradley-Terry) loss to put the right answer above wrong ones: a stray digit, a near miss
  (``c +- 1, 2``), a random number, an answer cut off without its end token, junk. Its labels may be shuffled
  (``shuffle=True``: each pair's order a coin flip), the control that cannot rank.
* **Judge** (:func:`train_judge`): a causal LM initialised from the warm policy, fine-tuned to answer the judge
  template (the prompt, the row's reference answer and the response) with ``Score: 1`` for a right answer and
  ``Score: 0`` for a wrong one (shuffled: a coin flip).

Prompts: every sum of two operands from 0 to 9. The data set holds out the prompts of its first 64 rows
(validation); the warm start sees every prompt, the reward model, the judge and RL only the others.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch

#: Wrong answers the reward model and the judge learn to rank below the right one.
WRONG_KINDS = ("stray_digit", "near", "random", "cut", "junk")


def make_task(root: Path) -> dict[str, Any]:
    """Write the train / validation / SFT rows under ``root``; returns their paths and rows."""
    from polyrl.data.synthetic import make_arithmetic_rows, write_jsonl

    rows = make_arithmetic_rows(600, seed=0, max_operand=9, ops="+")
    held_out = {r["prompt"][-1]["content"] for r in rows[:64]}
    val = rows[:64]
    train = [r for r in rows[64:] if r["prompt"][-1]["content"] not in held_out]
    rng = random.Random(1)
    sft = [dict(r, response=answer(r) + (str(rng.randint(0, 9)) if rng.random() < 0.5 else "")) for r in rows]
    return {"train": write_jsonl(train, root / "train.jsonl"), "val": write_jsonl(val, root / "val.jsonl"),
            "sft": write_jsonl(sft, root / "sft.jsonl"), "train_rows": train, "val_rows": val}


def answer(row: dict) -> str:
    """The right answer of a row."""
    return str(row["reward_model"]["ground_truth"])


def wrong_answers(row: dict, rng: random.Random) -> dict[str, str]:
    """One wrong answer of each kind; ``|cut`` marks one without the end token."""
    c = int(answer(row))
    near = c + rng.choice([-2, -1, 1, 2])
    rand = rng.randint(0, 18)
    return {
        "stray_digit": f"{c}{rng.randint(0, 9)}",
        "near": str(near if near >= 0 else c + 1),
        "random": str(rand if rand != c else c + 3),
        "cut": f"{c}{rng.choice('0123456789+=')}{rng.choice('0123456789')}|cut",
        "junk": "".join(chr(rng.randint(33, 126)) for _ in range(rng.randint(1, 3))) + "|cut",
    }


def encode(tokenizer: Any, row: dict, response: str) -> list[int]:
    """The policy's tokens of ``row``'s prompt followed by ``response`` (and the end token unless ``|cut``)."""
    ids = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    cut = response.endswith("|cut")
    body = tokenizer(response.removesuffix("|cut"), add_special_tokens=False)["input_ids"]
    return ids + list(body) + ([] if cut else [tokenizer.eos_token_id])


def _scores(model: Any, tokenizer: Any, sequences: list[list[int]]) -> torch.Tensor:
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), tokenizer.pad_token_id)
    mask = torch.zeros(len(sequences), width, dtype=torch.long)
    for i, s in enumerate(sequences):
        ids[i, width - len(s):] = torch.tensor(s)
        mask[i, width - len(s):] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return model(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, 0]


def train_reward_model(policy: Path, out: Path, rows: list[dict], *, shuffle: bool = False, steps: int = 300,
                       lr: float = 3e-4, batch: int = 16, seed: int = 0) -> Path:
    """A sequence-classifier reward model from the warm ``policy``, trained on ``rows`` (see the module docstring)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    torch.manual_seed(seed)
    rng = random.Random(seed)
    tokenizer = AutoTokenizer.from_pretrained(policy)
    model = AutoModelForSequenceClassification.from_pretrained(policy, num_labels=1)
    model.config.pad_token_id = tokenizer.pad_token_id
    pairs = []
    for row in {r["prompt"][-1]["content"]: r for r in rows}.values():
        right = encode(tokenizer, row, answer(row))
        for _ in range(2):
            pairs += [(right, encode(tokenizer, row, w)) for w in wrong_answers(row, rng).values()]
        c = int(answer(row))
        pairs += [(right, encode(tokenizer, row, str(c + d))) for d in (-2, -1, 1, 2) if c + d >= 0]
    if shuffle:
        pairs = [(a, b) if rng.random() < 0.5 else (b, a) for a, b in pairs]
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    for _ in range(steps):
        chosen = rng.sample(pairs, batch)
        s = _scores(model, tokenizer, [a for a, _ in chosen] + [b for _, b in chosen])
        loss = -torch.nn.functional.logsigmoid(s[:batch] - s[batch:]).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@torch.no_grad()
def ranking_accuracy(reward_model: Path, rows: list[dict], *, seed: int = 1) -> dict[str, float]:
    """How often the reward model scores a row's right answer above each kind of wrong one (and ``all``)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(reward_model)
    model = AutoModelForSequenceClassification.from_pretrained(reward_model).eval()
    rng = random.Random(seed)
    wins: dict[str, list[float]] = {k: [] for k in WRONG_KINDS}
    for row in rows:
        wrong = wrong_answers(row, rng)
        s = _scores(model, tokenizer, [encode(tokenizer, row, answer(row))]
                    + [encode(tokenizer, row, w) for w in wrong.values()])
        for kind, value in zip(wrong, s[1:].tolist()):
            wins[kind].append(float(s[0] > value))
    out = {k: sum(v) / len(v) for k, v in wins.items()}
    out["all"] = sum(sum(v) for v in wins.values()) / sum(len(v) for v in wins.values())
    return out


#: The judge compares the answer with the row's reference answer (``reward_model.judge.template``).
JUDGE_TEMPLATE = "{prompt} ref {ground_truth} ans {response}"


def judge_prompt(tokenizer: Any, row: dict, response: str) -> list[int]:
    """What the judge sees for ``response`` (:data:`JUDGE_TEMPLATE` through the chat template), as the run builds it."""
    message = JUDGE_TEMPLATE.format(prompt=row["prompt"][-1]["content"], ground_truth=answer(row),
                                    response=response.removesuffix("|cut"))
    ids = tokenizer.apply_chat_template([{"role": "user", "content": message}], add_generation_prompt=True,
                                        tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def train_judge(policy: Path, out: Path, rows: list[dict], *, shuffle: bool = False, steps: int = 300,
                lr: float = 3e-4, batch: int = 32, seed: int = 0) -> Path:
    """A generative judge from the warm ``policy``: fine-tuned to answer ``Score: 1`` after a right answer and
    ``Score: 0`` after a wrong one (labels a coin flip with ``shuffle``)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    rng = random.Random(seed)
    tokenizer = AutoTokenizer.from_pretrained(policy)
    model = AutoModelForCausalLM.from_pretrained(policy)
    examples = []
    for row in {r["prompt"][-1]["content"]: r for r in rows}.values():
        c = int(answer(row))
        wrong = [w for w in wrong_answers(row, rng).values()] + [str(c + d) for d in (-1, 1) if c + d >= 0]
        responses = [(answer(row), 1)] * len(wrong) + [(w, 0) for w in wrong]  # as many right as wrong
        for response, label in responses:
            label = rng.randint(0, 1) if shuffle else label
            prompt = judge_prompt(tokenizer, row, response)
            target = tokenizer(f"Score: {label}", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            examples.append((prompt, list(target)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    for _ in range(steps):
        chosen = rng.sample(examples, batch)
        width = max(len(p) + len(t) for p, t in chosen)
        ids = torch.full((batch, width), tokenizer.pad_token_id)
        labels = torch.full((batch, width), -100)
        mask = torch.zeros(batch, width, dtype=torch.long)
        for i, (p, t) in enumerate(chosen):
            seq = p + t
            ids[i, : len(seq)] = torch.tensor(seq)
            mask[i, : len(seq)] = 1
            labels[i, len(p): len(seq)] = torch.tensor(t)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
