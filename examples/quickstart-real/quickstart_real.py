"""polyrl real-model quickstart: GRPO on the pretrained SmolLM2-135M-Instruct, on GSM8K's calculations, on a CPU.

The model is the real one a user would run (Llama architecture, 134.5M parameters, its own 49,152-token BPE and
ChatML chat template ending turns with ``<|im_end|>``), fetched once into a cache folder (``make real-model``;
:func:`polyrl.models.real.ensure_real_model`). The problems are real too: GSM8K's reference solutions annotate
each calculation as ``<<48/2=24>>``; each integer one-operation calculation becomes a question asked through the
model's own chat template, "What is 48/2? Answer with the number only.", scored by verl's GSM8K scorer in its
``flexible`` mode (the last number of the response; ``reward.py``). Training questions come from GSM8K's train
split, held-out ones from its test split (a subset of each ships in ``data/``, MIT, with its provenance). Why this
task and not the word problems themselves: docs/real_models.md#the-real-model-quickstart.

The run goes through what a user runs: ``polyrl train`` (GRPO, the FSDP engine, the hf rollout) and
``polyrl plot``. The last line printed is::

    held-out accuracy before RL: 0.xx after RL: 0.yy

(sampled at temperature 1 as in training, 2 answers per held-out question). Usage: ``python examples/quickstart-real/quickstart_real.py
[--run-dir DIR] [--seed N] [--shuffle-rewards]`` (``make quickstart-real`` runs it). Greedy held-out accuracy
instead: ``--rl rollout.val_temperature=0 --rl rollout.val_n=1`` (the line then reports ``mean@1``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
DATA = HERE / "data"
#: the shipped GSM8K subsets (data/README.md): the first 600 train and first 150 test problems
TRAIN_FILE = DATA / "gsm8k_train_head600.jsonl"
TEST_FILE = DATA / "gsm8k_test_head150.jsonl"
#: a calculator annotation of a GSM8K reference solution with one operation on integers: ``<<48/2=24>>``
CALCULATION = re.compile(r"<<(\d+)\s*([-+*/])\s*(\d+)=(\d+)>>")
QUESTION = "What is {a}{op}{b}? Answer with the number only."


def calculation_rows(path: Path, split: str) -> list[dict]:
    """One row per distinct integer one-operation calculation in the GSM8K file ``path``, in file order."""
    rows, seen = [], set()
    for line_no, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        problem = json.loads(line)
        for a, op, b, result in CALCULATION.findall(problem["answer"]):
            if (a, op, b) in seen:
                continue
            seen.add((a, op, b))
            rows.append({
                "prompt": [{"role": "user", "content": QUESTION.format(a=a, op=op, b=b)}],
                "data_source": "openai/gsm8k",
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": result},
                "extra_info": {"split": split, "problem": line_no - 1, "calculation": f"{a}{op}{b}={result}"},
            })
    return rows


def polyrl(*args: str) -> None:
    """Run a ``polyrl`` CLI verb in a child process, as a user would from a shell."""
    print("$ polyrl " + " ".join(args), flush=True)
    subprocess.run([sys.executable, "-m", "polyrl", *args], check=True)


def real_model() -> Path:
    """The converted SmolLM2-135M-Instruct folder, fetched on first use (``make real-model``)."""
    from polyrl.models.real import ensure_real_model

    return ensure_real_model(say=lambda line: print(line, flush=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", default="runs/quickstart-real")
    parser.add_argument("--model", default=None, help="an HF folder instead of the fetched SmolLM2-135M-Instruct")
    parser.add_argument("--seed", type=int, default=0, help="trainer.seed: data order and sampling")
    parser.add_argument("--rl-steps", type=int, default=None, help="override the GRPO step count")
    parser.add_argument("--held-out", type=int, default=128, help="held-out questions (from GSM8K's test split)")
    parser.add_argument("--shuffle-rewards", action="store_true",
                        help="the control: each training question is rewarded against another question's answer")
    parser.add_argument("--rl", action="append", default=[], metavar="KEY=VALUE", help="extra override for polyrl train")
    args = parser.parse_args()
    for key, value in (("OMP_NUM_THREADS", "2"), ("RAY_AUTH_MODE", "disabled"), ("TOKENIZERS_PARALLELISM", "false")):
        os.environ.setdefault(key, value)

    from polyrl.data.synthetic import write_jsonl

    started = time.time()
    run = Path(args.run_dir).resolve()
    if run.exists():
        shutil.rmtree(run)
    run.mkdir(parents=True)
    model = Path(args.model).resolve() if args.model else real_model()

    # 1. The task: GSM8K's own calculations; held-out ones never asked in training.
    val = calculation_rows(TEST_FILE, "test")[: args.held_out]
    held_out = {r["extra_info"]["calculation"] for r in val}
    train = [r for r in calculation_rows(TRAIN_FILE, "train") if r["extra_info"]["calculation"] not in held_out]
    if args.shuffle_rewards:  # the control: the same run, rewarded against a random other question's answer
        answers = [r["reward_model"]["ground_truth"] for r in train]
        random.Random(args.seed).shuffle(answers)
        train = [dict(r, reward_model={"style": "rule", "ground_truth": a}) for r, a in zip(train, answers)]
    write_jsonl(val, run / "val.jsonl")
    write_jsonl(train, run / "train.jsonl")
    print(f"model: {model}; {len(train)} training and {len(val)} held-out questions", flush=True)

    # 2. GRPO on the pretrained model, validating before, halfway and after.
    polyrl("train", "--manifest", str(HERE / "polyrl.toml"), "--config", str(HERE / "grpo.yaml"),
           f"model.path={model}", f"data.train_files=[{run / 'train.jsonl'}]",
           f"data.val_files=[{run / 'val.jsonl'}]", f"trainer.run_dir={run / 'grpo'}",
           f"reward.function={HERE / 'reward.py'}:compute_score", f"trainer.seed={args.seed}",
           *([f"trainer.total_steps={args.rl_steps}"] if args.rl_steps else []), *args.rl)
    polyrl("plot", str(run / "grpo"))

    # 3. Held-out accuracy before and after RL, from the run's own validation metrics.
    rows = [json.loads(line) for line in (run / "grpo" / "metrics.jsonl").read_text().splitlines()]
    # mean@2 as shipped; mean@1 with `--rl rollout.val_n=1` (e.g. greedy: `--rl rollout.val_temperature=0`)
    key = max((k for r in rows for k in r if k.startswith("val/openai/gsm8k/mean@")),
              key=lambda k: int(k.rsplit("@", 1)[1]))
    vals = [r for r in rows if key in r]
    before, after = vals[0][key], vals[-1][key]
    print(f"curves: {run / 'grpo' / 'curves.png'}; took {time.time() - started:.0f}s")
    print(f"held-out accuracy before RL: {before:.2f} after RL: {after:.2f}")


if __name__ == "__main__":
    main()
