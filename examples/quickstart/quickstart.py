"""polyrl quickstart: warm up a tiny model with SFT, then train it with GRPO, on a CPU.

Everything is built here, with no download: a random-init Qwen2-style model with a
character tokenizer, and a synthetic arithmetic task ("23+9=" -> "32"). The run
goes through the real pieces a user runs: ``polyrl sft``, ``polyrl train`` with a
plugin manifest (the FSDP engine plugin; ``--rollout vllm`` adds the vLLM plugin),
``polyrl plot``. The last line printed is::

    accuracy before RL: 0.xx after RL: 0.yy

Usage: ``python examples/quickstart/quickstart.py [--rollout hf|vllm] [--run-dir DIR] [--layout native|verl]``
(``make quickstart`` runs it). ``--layout verl`` runs the GRPO step from ``grpo_verl.yaml``, the same run
written in verl's config layout (docs/from_verl.md). See docs/quickstart.md for a walk-through.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def polyrl(*args: str) -> None:
    """Run a ``polyrl`` CLI verb in a child process, as a user would from a shell."""
    cmd = [sys.executable, "-m", "polyrl", *args]
    print("$ polyrl " + " ".join(args), flush=True)
    subprocess.run(cmd, check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", default="runs/quickstart")
    parser.add_argument("--rollout", default="hf", choices=["hf", "vllm"])
    parser.add_argument("--layout", default="native", choices=["native", "verl"],
                        help="the GRPO config's layout: grpo.yaml (polyrl's) or grpo_verl.yaml (verl's)")
    parser.add_argument("--sft-steps", type=int, default=None, help="override the SFT step count")
    parser.add_argument("--rl-steps", type=int, default=None, help="override the GRPO step count")
    parser.add_argument("--max-operand", type=int, default=20, help="operands are drawn from 0..N")
    parser.add_argument("--sft", action="append", default=[], metavar="KEY=VALUE", help="extra override for polyrl sft")
    parser.add_argument("--rl", action="append", default=[], metavar="KEY=VALUE", help="extra override for polyrl train")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    from polyrl.data.synthetic import make_arithmetic_rows, write_jsonl
    from polyrl.models.tiny import make_tiny_model

    started = time.time()
    run = Path(args.run_dir).resolve()
    if run.exists():
        shutil.rmtree(run)
    run.mkdir(parents=True)

    # 1. A tiny model and the task, built in code.
    make_tiny_model(run / "base", size="mini", seed=0)
    rows = make_arithmetic_rows(2400, seed=0, max_operand=args.max_operand, ops="+")
    held_out = {r["prompt"][-1]["content"] for r in rows[:200]}
    val, train = rows[:200], [r for r in rows[200:] if r["prompt"][-1]["content"] not in held_out]
    write_jsonl(val, run / "val.jsonl")
    write_jsonl(train, run / "train.jsonl")
    sft_rows = [dict(r, response=str(r["reward_model"]["ground_truth"])) for r in train]
    write_jsonl(sft_rows, run / "sft.jsonl")

    # 2. Supervised warm start: a little, so the model is right sometimes and RL has a signal.
    sft_overrides = [
        f"model.path={run / 'base'}",
        f"data.train_files=[{run / 'sft.jsonl'}]",
        f"trainer.run_dir={run / 'sft'}",
    ] + ([f"trainer.total_steps={args.sft_steps}"] if args.sft_steps else []) + args.sft
    polyrl("sft", "--manifest", str(HERE / "polyrl.toml"), "--config", str(HERE / "sft.yaml"), *sft_overrides)

    # 3. GRPO from the warmed-up model, validating before and after.
    manifest = HERE / ("polyrl-vllm.toml" if args.rollout == "vllm" else "polyrl.toml")
    if args.layout == "verl":  # the same run, in verl's layout and names
        rl_overrides = [
            f"actor_rollout_ref.model.path={run / 'sft' / 'hf'}",
            f"data.train_files={run / 'train.jsonl'}",
            f"data.val_files={run / 'val.jsonl'}",
            f"trainer.default_local_dir={run / 'grpo'}",
            f"actor_rollout_ref.rollout.name={args.rollout}",
            "+trainer.progress_bar=false",
        ] + ([f"trainer.total_training_steps={args.rl_steps}"] if args.rl_steps else []) + args.rl
    else:
        rl_overrides = [
            f"model.path={run / 'sft' / 'hf'}",
            f"data.train_files=[{run / 'train.jsonl'}]",
            f"data.val_files=[{run / 'val.jsonl'}]",
            f"trainer.run_dir={run / 'grpo'}",
            f"rollout.name={args.rollout}",
        ] + ([f"trainer.total_steps={args.rl_steps}"] if args.rl_steps else []) + args.rl
    grpo = HERE / ("grpo_verl.yaml" if args.layout == "verl" else "grpo.yaml")
    polyrl("train", "--manifest", str(manifest), "--config", str(grpo), *rl_overrides)
    polyrl("plot", str(run / "grpo"))

    # 4. Held-out accuracy before and after RL, from the run's own validation metrics.
    key = "val/arithmetic/mean@4"  # sampled accuracy at temperature 1, 4 samples per held-out prompt
    vals = [json.loads(line) for line in (run / "grpo" / "metrics.jsonl").read_text().splitlines() if key in line]
    before, after = vals[0][key], vals[-1][key]
    print(f"curves: {run / 'grpo' / 'curves.png'}; took {time.time() - started:.0f}s")
    print(f"accuracy before RL: {before:.2f} after RL: {after:.2f}")


if __name__ == "__main__":
    main()
