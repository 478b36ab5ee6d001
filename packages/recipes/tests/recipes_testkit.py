"""Helpers of the recipes' tests: the rewards of the quickstart task and reading a run's metrics."""

from __future__ import annotations

import json
from pathlib import Path

#: The quickstart's arithmetic prompts with a reward for answering in digits (the fraction of digits among the
#: first 6 characters of the answer), which a random-init tiny model learns in a few steps (the quickstart's
#: exact-answer reward needs an SFT warm-up first). ``acc`` is the same fraction.
DIGITS_REWARD = (
    "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
    "    text = solution_str[:6]\n"
    "    frac = sum(c.isdigit() for c in text) / max(1, len(text)) if text else 0.0\n"
    "    return {'score': frac, 'acc': frac}\n"
)
#: The control: a score with no signal (a hash of the answer), its ``acc`` still the digit fraction.
CONTROL_REWARD = (
    "import zlib\n"
    "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
    "    text = solution_str[:6]\n"
    "    frac = sum(c.isdigit() for c in text) / max(1, len(text)) if text else 0.0\n"
    "    return {'score': float(zlib.crc32(solution_str.encode()) % 2), 'acc': frac}\n"
)


def train_rows(run: Path) -> list[dict]:
    """The metrics lines of the training steps of a run directory."""
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in lines if "actor/grad_norm" in r or "critic/vf_loss" in r]


def permuted_copy(model_dir: Path, out: Path, seed: int = 0) -> Path:
    """The model at ``model_dir`` with its vocabulary renumbered: the same token strings under permuted ids, and
    the embedding and output rows permuted to match, so it computes exactly the same function of text."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

    from polyrl.models.tiny import CHAT_TEMPLATE, SPECIAL_TOKENS

    tok = AutoTokenizer.from_pretrained(model_dir)
    vocab = tok.get_vocab()
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    rows = model.get_input_embeddings().weight.shape[0]
    # old id -> new id over the model's rows; a tokenizer entry past them (Qwen2's <|endoftext|>) keeps its id
    perm = torch.randperm(rows, generator=torch.Generator().manual_seed(seed))
    new_vocab = {t: int(perm[i]) if i < rows else i for t, i in vocab.items()}
    inner = Tokenizer(models.BPE(vocab=new_vocab, merges=[]))
    inner.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    inner.decoder = decoders.ByteLevel()
    inner.add_special_tokens(SPECIAL_TOKENS)
    fast = PreTrainedTokenizerFast(tokenizer_object=inner, pad_token=tok.pad_token, eos_token=tok.eos_token,
                                   padding_side="left")
    fast.chat_template = CHAT_TEMPLATE
    with torch.no_grad():
        for layer in (model.get_input_embeddings(), model.get_output_embeddings()):
            rows = layer.weight.data.clone()
            layer.weight.data[perm] = rows
    model.config.pad_token_id, model.config.eos_token_id = fast.pad_token_id, fast.eos_token_id
    model.save_pretrained(out)
    fast.save_pretrained(out)
    return out


def addition_rows() -> tuple[list[dict], list[dict]]:
    """Every single-digit sum ``a+b=`` (100 prompts, the quickstart's arithmetic), shuffled: 80 to train on and 20
    held out."""
    import random

    pairs = [(a, b) for a in range(10) for b in range(10)]
    random.Random(0).shuffle(pairs)
    rows = [{"prompt": [{"role": "user", "content": f"{a}+{b}="}], "data_source": "arithmetic",
             "reward_model": {"style": "rule", "ground_truth": str(a + b)},
             "extra_info": {"index": i, "a": a, "b": b, "op": "+"}} for i, (a, b) in enumerate(pairs)]
    return rows[:80], rows[80:]


def train_teacher(model_dir: Path, rows: list[dict], out: Path, *, steps: int, keep: tuple[int, ...] = (),
                  lr: float = 3e-3) -> dict[int, Path]:
    """Supervised training of the causal LM at ``model_dir`` on the rows' answers (full batch, AdamW, loss on the
    answer and EOS), in this process; the model after ``steps`` steps goes to ``out/final`` and after each step of
    ``keep`` to ``out/step_<n>``. Returns ``{step: folder}``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    seqs = []
    for row in rows:
        prompt = tok.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True,
                                         return_dict=True)["input_ids"]
        answer = tok(row["reward_model"]["ground_truth"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        seqs.append((prompt, answer))
    width = max(len(p) + len(a) for p, a in seqs)
    ids = torch.full((len(seqs), width), tok.pad_token_id)
    labels = torch.full((len(seqs), width), -100)
    attention = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, (p, a) in enumerate(seqs):
        ids[i, : len(p) + len(a)] = torch.tensor(p + a)
        attention[i, : len(p) + len(a)] = 1
        labels[i, len(p) : len(p) + len(a)] = torch.tensor(a)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    saved: dict[int, Path] = {}
    for step in range(1, steps + 1):
        loss = model(input_ids=ids, attention_mask=attention, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step in keep or step == steps:
            folder = out / ("final" if step == steps else f"step_{step}")
            model.save_pretrained(folder)
            tok.save_pretrained(folder)
            saved[step] = folder
    return saved


def greedy_accuracy(model_dir: Path, rows: list[dict], max_new_tokens: int = 4) -> float:
    """Exact-answer accuracy of greedy decoding with transformers (what validation at temperature 0 measures)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    right = 0
    for row in rows:
        ids = tok.apply_chat_template(row["prompt"], add_generation_prompt=True, return_tensors="pt",
                                      return_dict=True)["input_ids"]
        with torch.no_grad():
            out = model.generate(ids, do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=tok.pad_token_id)
        right += tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip() == row["reward_model"]["ground_truth"]
    return right / len(rows)
