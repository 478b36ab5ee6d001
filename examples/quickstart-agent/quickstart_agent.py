"""polyrl agent quickstart: a tiny model learns to use a calculator, with SFT then multi-turn GRPO, on a CPU.

The task (``polyrl.agent_loops.arithmetic_task``): multiply two 3-digit numbers, which a tiny model
cannot do in its head; it can call the ``calculator`` tool (hermes format, ``<tool_call>{...}</tool_call>``)
and copy the result into its answer. Everything is built here, with no download: a random-init model
with a character tokenizer whose chat template has a ``tool`` role. The run goes through what a user
runs: ``polyrl sft`` on tool-use transcripts, ``polyrl train`` with the ``tool_agent`` loop, ``polyrl plot``.
The last lines printed are::

    accuracy before RL: 0.xx after RL: 0.yy
    tool use before RL: 0.xx after RL: 0.yy

Usage: ``python examples/quickstart-agent/quickstart_agent.py [--run-dir DIR]`` (``make quickstart-agent``).
See docs/agents.md.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def polyrl(*args: str) -> None:
    """Run a ``polyrl`` CLI verb in a child process, as a user would from a shell."""
    print("$ polyrl " + " ".join(args), flush=True)
    subprocess.run([sys.executable, "-m", "polyrl", *args], check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", default="runs/quickstart-agent")
    parser.add_argument("--model-size", default="tiny", choices=["tiny", "mini", "small"])
    parser.add_argument("--sft-steps", type=int, default=None, help="override the SFT step count")
    parser.add_argument("--rl-steps", type=int, default=None, help="override the GRPO step count")
    parser.add_argument("--tool-share", type=float, default=0.5, help="share of SFT transcripts that use the tool")
    parser.add_argument("--sft", action="append", default=[], metavar="KEY=VALUE", help="extra override for polyrl sft")
    parser.add_argument("--rl", action="append", default=[], metavar="KEY=VALUE", help="extra override for polyrl train")
    args = parser.parse_args()
    for key, value in (("OMP_NUM_THREADS", "1"), ("RAY_AUTH_MODE", "disabled"), ("TOKENIZERS_PARALLELISM", "false")):
        os.environ.setdefault(key, value)

    from polyrl.agent_loops.arithmetic_task import make_tool_arithmetic_rows, sft_response_text
    from polyrl.data.synthetic import write_jsonl
    from polyrl.models.tiny import build_char_tokenizer, make_tiny_model

    started = time.time()
    run = Path(args.run_dir).resolve()
    if run.exists():
        shutil.rmtree(run)
    run.mkdir(parents=True)

    # 1. A tiny model (its chat template renders {"role": "tool"} messages as <|tool|>...) and the task.
    tokenizer = build_char_tokenizer()
    make_tiny_model(run / "base", size=args.model_size, tokenizer=tokenizer, seed=0)
    rows = make_tool_arithmetic_rows(6000, seed=0, digits=3)
    val, train = rows[:64], rows[64:]
    write_jsonl(val, run / "val.jsonl")
    write_jsonl(train[:2000], run / "train.jsonl")
    rng = random.Random(0)
    sft_rows = [dict(r, response=sft_response_text(r, tokenizer, use_tool=rng.random() < args.tool_share))
                for r in train[2000:]]
    write_jsonl(sft_rows, run / "sft.jsonl")

    # 2. Supervised warm start on transcripts: the call format, and copying the tool's answer.
    polyrl("sft", "--manifest", str(HERE / "polyrl.toml"), "--config", str(HERE / "sft.yaml"),
           f"model.path={run / 'base'}", f"data.train_files=[{run / 'sft.jsonl'}]", f"trainer.run_dir={run / 'sft'}",
           *([f"trainer.total_steps={args.sft_steps}"] if args.sft_steps else []), *args.sft)

    # 3. GRPO with the tool_agent loop and the calculator, validating before and after.
    polyrl("train", "--manifest", str(HERE / "polyrl.toml"), "--config", str(HERE / "grpo.yaml"),
           f"model.path={run / 'sft' / 'hf'}", f"data.train_files=[{run / 'train.jsonl'}]",
           f"data.val_files=[{run / 'val.jsonl'}]", f"trainer.run_dir={run / 'grpo'}",
           *([f"trainer.total_steps={args.rl_steps}"] if args.rl_steps else []), *args.rl)
    polyrl("plot", str(run / "grpo"))

    # 4. Held-out accuracy (sampled, 4 per prompt) and tool use before and after RL, from the validation metrics.
    acc_key, tool_key = "val/tool_arithmetic/mean@4", "val/agent/tool_use_rate"
    vals = [json.loads(line) for line in (run / "grpo" / "metrics.jsonl").read_text().splitlines() if acc_key in line]
    first, last = vals[0], vals[-1]
    print(f"curves: {run / 'grpo' / 'curves.png'}; took {time.time() - started:.0f}s")
    print(f"accuracy before RL: {first[acc_key]:.2f} after RL: {last[acc_key]:.2f}")
    print(f"tool use before RL: {first.get(tool_key, 0.0):.2f} after RL: {last.get(tool_key, 0.0):.2f}")


if __name__ == "__main__":
    main()
