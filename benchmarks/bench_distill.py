"""On-policy distillation vs GRPO vs SFT on teacher samples: held-out accuracy against wall-clock and samples.

The quickstart's arithmetic (every single-digit sum ``a+b=``; 80 prompts to train on, 20 held out; exact
answers). A teacher is trained in this process (supervised, full batch, ``--teacher-steps``); the student starts
from the same training run stopped early (``--start-step``), so all three methods start from one checkpoint:

- ``distill``: ``polyrl train`` with ``trainer.name=distill`` (polyrl-recipes), ``loss_mode=forward_kl_topk``
  (the teacher's top-8), no task reward;
- ``grpo``: ``polyrl train`` with GRPO on the exact-answer reward;
- ``sft``: ``polyrl sft`` on responses the teacher samples (temperature 1) for the training prompts.

All three take the same optimizer (AdamW, ``--lr``, 3 warm-up steps, cosine decay) and the same work per step:
``--prompts`` prompts x ``--n`` samples (the student's for distill and GRPO, the teacher's for SFT), each used
``--epochs`` times in mini-batches of half the step. Held-out accuracy is greedy, on the 20 held-out prompts,
every ``--every`` steps (RL runs validate inside the run; each SFT point is its own ``polyrl sft`` run on the
teacher samples k steps would use, with the optimizer steps k steps make, its cosine over that length). Wall-clock is training time only (the sum of the steps'
``timing/step``, validation and start-up excluded), plus, for SFT, the teacher's sampling time for the examples
it has used. Samples are sampled responses used so far (the student's, or the teacher's for SFT).

Each method runs once per ``--seeds`` value (``trainer.seed``); the table gives means, the plot each seed's curve.
See docs/benchmarks.md and docs/recipes.md.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_distill.py [--steps 15] [--seeds 1 2 3] [--out runs/bench_distill]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

METHODS = ("distill", "grpo", "sft")


def addition_rows() -> tuple[list[dict], list[dict]]:
    """Every single-digit sum, shuffled: 80 to train on, 20 held out."""
    pairs = [(a, b) for a in range(10) for b in range(10)]
    random.Random(0).shuffle(pairs)
    rows = [{"prompt": [{"role": "user", "content": f"{a}+{b}="}], "data_source": "arithmetic",
             "reward_model": {"style": "rule", "ground_truth": str(a + b)},
             "extra_info": {"index": i, "a": a, "b": b, "op": "+"}} for i, (a, b) in enumerate(pairs)]
    return rows[:80], rows[80:]


def train_teacher(base: Path, rows: list[dict], out: Path, steps: int, start_step: int) -> tuple[Path, Path]:
    """Full-batch supervised training of ``base`` on the rows' answers; returns (teacher, student start)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base)
    seqs = []
    for row in rows:
        prompt = tok.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True,
                                         return_dict=True)["input_ids"]
        seqs.append((prompt, tok(row["reward_model"]["ground_truth"], add_special_tokens=False)["input_ids"]
                     + [tok.eos_token_id]))
    width = max(len(p) + len(a) for p, a in seqs)
    ids = torch.full((len(seqs), width), tok.pad_token_id)
    labels = torch.full((len(seqs), width), -100)
    attention = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, (p, a) in enumerate(seqs):
        ids[i, : len(p) + len(a)] = torch.tensor(p + a)
        attention[i, : len(p) + len(a)] = 1
        labels[i, len(p) : len(p) + len(a)] = torch.tensor(a)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    for step in range(1, steps + 1):
        loss = model(input_ids=ids, attention_mask=attention, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step in (start_step, steps):
            folder = out / ("teacher" if step == steps else "start")
            model.save_pretrained(folder)
            tok.save_pretrained(folder)
    return out / "teacher", out / "start"


def greedy_accuracy(model_dir: Path, rows: list[dict]) -> float:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    right = 0
    for row in rows:
        ids = tok.apply_chat_template(row["prompt"], add_generation_prompt=True, return_tensors="pt",
                                      return_dict=True)["input_ids"]
        with torch.no_grad():
            out = model.generate(ids, do_sample=False, max_new_tokens=4, pad_token_id=tok.pad_token_id)
        right += tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip() == row["reward_model"]["ground_truth"]
    return right / len(rows)


def teacher_samples(teacher: Path, rows: list[dict], count: int, seed: int) -> tuple[list[dict], float]:
    """``count`` rows with a ``response`` the teacher sampled at temperature 1 (the training prompts in turn), and
    the seconds the sampling took."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(teacher)
    model = AutoModelForCausalLM.from_pretrained(teacher)
    torch.manual_seed(seed)
    out: list[dict] = []
    start = time.perf_counter()
    prompts = [rows[i % len(rows)] for i in range(count)]
    for chunk in range(0, count, 80):
        part = prompts[chunk : chunk + 80]
        enc = tok.apply_chat_template([r["prompt"] for r in part], add_generation_prompt=True, return_tensors="pt",
                                      return_dict=True, padding=True)
        with torch.no_grad():
            gen = model.generate(**enc, do_sample=True, temperature=1.0, top_k=0, max_new_tokens=4,
                                 pad_token_id=tok.pad_token_id)
        for row, seq in zip(part, gen[:, enc["input_ids"].shape[1]:]):
            out.append(dict(row, response=tok.decode(seq, skip_special_tokens=True)))
    return out, time.perf_counter() - start


def optimizer_keys(args: argparse.Namespace, start: Path, seed: int) -> list[str]:
    """The keys every method shares: the start, the optimizer and its schedule, the run's plumbing."""
    return [
        f"model.path={start}", "data.max_prompt_length=32", "data.max_response_length=4", f"actor.optim.lr={args.lr}",
        "actor.optim.lr_warmup_steps=3", "actor.optim.lr_scheduler_type=cosine", f"trainer.seed={seed}",
        "trainer.save_freq=0", "trainer.progress_bar=false", "trainer.logger=[jsonl]", "trainer.executor=local",
    ]


def rl_curve(method: str, args: argparse.Namespace, root: Path, start: Path, teacher: Path, seed: int) -> list[dict]:
    run = root / f"{method}-seed{seed}"
    extra = ["trainer.name=distill", f"trainer.distill.teacher.model.path={teacher}",
             "trainer.distill.loss_mode=forward_kl_topk", "trainer.distill.topk=8",
             "trainer.distill.use_task_rewards=false"] if method == "distill" else []
    overrides = optimizer_keys(args, start, seed) + [
        f"data.train_files=[{root / 'train.jsonl'}]", f"data.val_files=[{root / 'val.jsonl'}]",
        f"data.train_batch_size={args.prompts}", f"actor.ppo_mini_batch_size={args.prompts // 2}",
        f"actor.micro_batch_size={args.prompts * args.n}", f"actor.ppo_epochs={args.epochs}", f"rollout.n={args.n}",
        f"rollout.max_batch_size={args.prompts * args.n}", f"trainer.total_steps={args.steps}",
        f"trainer.test_freq={args.every}", "trainer.val_before_train=true", f"trainer.run_dir={run}", *extra]
    subprocess.run([sys.executable, "-m", "polyrl", "train", "--manifest", str(root / "polyrl.toml"), *overrides],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    points, seconds = [], 0.0
    for r in rows:
        seconds += r.get("timing/step", 0.0)
        if "val/arithmetic/mean@1" in r:
            points.append({"step": r["step"], "seconds": seconds, "samples": r["step"] * args.prompts * args.n,
                           "accuracy": r["val/arithmetic/mean@1"]})
    return points


def sft_curve(args: argparse.Namespace, root: Path, start: Path, teacher: Path, held_out: list[dict],
              train: list[dict], seed: int) -> list[dict]:
    per_step = args.prompts * args.n
    data, sample_seconds = teacher_samples(teacher, train, per_step * args.steps, seed)
    points = [{"step": 0, "seconds": 0.0, "samples": 0, "accuracy": greedy_accuracy(start, held_out)}]
    for k in range(args.every, args.steps + 1, args.every):
        run = root / f"sft-seed{seed}-k{k}"
        used = data[: per_step * k]
        (root / f"sft-{seed}-{k}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in used))
        # the optimizer steps of k RL steps: `epochs` passes over k steps' samples, in mini-batches of half a step
        overrides = optimizer_keys(args, start, seed) + [
            f"data.train_files=[{root / f'sft-{seed}-{k}.jsonl'}]", f"data.train_batch_size={per_step // 2}",
            f"actor.micro_batch_size={per_step // 2}", f"trainer.total_steps={2 * args.epochs * k}",
            "data.shuffle=true", f"data.seed={seed}", f"trainer.run_dir={run}"]
        subprocess.run([sys.executable, "-m", "polyrl", "sft", "--manifest", str(root / "polyrl.toml"), *overrides],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
        seconds = sum(r.get("timing/step", 0.0) for r in rows) + sample_seconds * k / args.steps
        points.append({"step": k, "seconds": seconds, "samples": per_step * k,
                       "accuracy": greedy_accuracy(run / "hf", held_out)})
    return points


def plot(curves: dict[str, list[list[dict]]], teacher_acc: float, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    colours = {"distill": "tab:blue", "grpo": "tab:red", "sft": "tab:green"}
    for ax, x in zip(axes, ("seconds", "samples")):
        for method, runs in curves.items():
            for i, points in enumerate(runs):
                ax.plot([p[x] for p in points], [p["accuracy"] for p in points], marker="o", color=colours[method],
                        alpha=0.8, label=method if i == 0 else None)
        ax.axhline(teacher_acc, color="black", linestyle="--", label="teacher")
        ax.set_xlabel("training seconds" if x == "seconds" else "sampled responses")
        ax.set_ylabel("held-out accuracy (greedy)")
        ax.set_ylim(-0.05, 1.05)
        ax.legend()
    fig.suptitle("on-policy distillation vs GRPO vs SFT on teacher samples (same start)")
    fig.tight_layout()
    path = out / "bench_distill.png"
    fig.savefig(path, dpi=110)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/bench_distill")
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=80)
    parser.add_argument("--n", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--teacher-steps", type=int, default=100)
    parser.add_argument("--start-step", type=int, default=40)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    args = parser.parse_args()

    from polyrl.data.synthetic import write_jsonl
    from polyrl.models.tiny import make_tiny_model

    root = Path(args.out).resolve()
    root.mkdir(parents=True, exist_ok=True)
    (root / "polyrl.toml").write_text('[plugins]\nrequire = ["polyrl-engine-fsdp", "polyrl-recipes"]\n')
    train, held_out = addition_rows()
    write_jsonl(train, root / "train.jsonl")
    write_jsonl(held_out, root / "val.jsonl")
    base = make_tiny_model(root / "base", size="tiny", seed=0)
    teacher, start = train_teacher(base, train, root, args.teacher_steps, args.start_step)
    teacher_acc = greedy_accuracy(teacher, held_out)
    print(f"teacher held-out accuracy {teacher_acc:.2f}; start {greedy_accuracy(start, held_out):.2f}", flush=True)
    curves: dict[str, list[list[dict]]] = {m: [] for m in args.methods}
    for seed in args.seeds:
        for method in args.methods:
            points = (sft_curve(args, root, start, teacher, held_out, train, seed) if method == "sft"
                      else rl_curve(method, args, root, start, teacher, seed))
            curves[method].append(points)
            print(f"seed {seed} {method:8s} " + "  ".join(
                f"step {p['step']:2d}: {p['accuracy']:.2f} ({p['seconds']:.1f}s, {p['samples']} samples)"
                for p in points), flush=True)
    print("\nmeans over seeds (held-out accuracy / training seconds at each validation step):")
    for method, runs in curves.items():
        cells = []
        for i, point in enumerate(runs[0]):
            acc = sum(r[i]["accuracy"] for r in runs) / len(runs)
            sec = sum(r[i]["seconds"] for r in runs) / len(runs)
            cells.append(f"step {point['step']:2d} {acc:.2f}/{sec:.1f}s")
        print(f"  {method:8s} " + "  ".join(cells))
    (root / "curves.json").write_text(json.dumps({"teacher_accuracy": teacher_acc, "curves": curves}, indent=1))
    print(f"plot: {plot(curves, teacher_acc, root)}")


if __name__ == "__main__":
    main()
