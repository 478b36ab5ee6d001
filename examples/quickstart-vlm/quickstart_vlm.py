"""polyrl vision-language quickstart: a tiny Qwen2-VL learns to read coloured shapes, with SFT then GRPO, on a CPU.

Everything is built here, with no download: a random-init Qwen2-VL-architecture model
(``polyrl.models.tiny_vlm``: a vision tower with Qwen's patch 14 / merge 2 geometry, a character tokenizer with
Qwen-VL's vision tokens, an image processor config), and the shapes task (``polyrl.data.synthetic``): a 56 x 56
PNG of one red, green, blue or yellow circle, square or triangle drawn with PIL, and the question "What colour
is the shape?". Only the image holds the answer. The run goes through what a user runs:
``polyrl sft``, ``polyrl train`` (GRPO, the hf rollout generating from the images), ``polyrl plot``. The last
line printed is::

    accuracy before RL: 0.xx after RL: 0.yy

Usage: ``python examples/quickstart-vlm/quickstart_vlm.py [--run-dir DIR] [--arch qwen2_vl|qwen2_5_vl]`` (``make quickstart-vlm``).
See docs/vlm.md.
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
    print("$ polyrl " + " ".join(args), flush=True)
    subprocess.run([sys.executable, "-m", "polyrl", *args], check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", default="runs/quickstart-vlm")
    parser.add_argument("--arch", default="qwen2_vl", choices=["qwen2_vl", "qwen2_5_vl"])
    parser.add_argument("--sft-steps", type=int, default=None, help="override the SFT step count")
    parser.add_argument("--rl-steps", type=int, default=None, help="override the GRPO step count")
    parser.add_argument("--sft", action="append", default=[], metavar="KEY=VALUE", help="extra override for polyrl sft")
    parser.add_argument("--rl", action="append", default=[], metavar="KEY=VALUE", help="extra override for polyrl train")
    args = parser.parse_args()
    for key, value in (("OMP_NUM_THREADS", "1"), ("RAY_AUTH_MODE", "disabled"), ("TOKENIZERS_PARALLELISM", "false")):
        os.environ.setdefault(key, value)

    from polyrl.data.synthetic import make_shape_rows, write_jsonl
    from polyrl.models.tiny_vlm import make_tiny_vlm

    started = time.time()
    run = Path(args.run_dir).resolve()
    if run.exists():
        shutil.rmtree(run)
    run.mkdir(parents=True)

    # 1. A tiny Qwen2-VL (images resized to at most 56 x 56: 4 image tokens each) and the task, built in code.
    make_tiny_vlm(run / "base", arch=args.arch, max_pixels=56 * 56, seed=0)
    task = dict(questions=("colour",))  # red, green, blue or yellow; a circle, square or triangle
    val = make_shape_rows(128, run / "images" / "val", seed=1, **task)
    train = make_shape_rows(512, run / "images" / "train", seed=0, **task)
    write_jsonl(val, run / "val.jsonl")
    write_jsonl(train, run / "train.jsonl")
    write_jsonl([dict(r, response=r["reward_model"]["ground_truth"]) for r in train], run / "sft.jsonl")

    # 2. Supervised warm start: a little, so the model answers with a colour word and is right about half the time.
    polyrl("sft", "--manifest", str(HERE / "polyrl.toml"), "--config", str(HERE / "sft.yaml"),
           f"model.path={run / 'base'}", f"data.train_files=[{run / 'sft.jsonl'}]", f"trainer.run_dir={run / 'sft'}",
           *([f"trainer.total_steps={args.sft_steps}"] if args.sft_steps else []), *args.sft)

    # 3. GRPO from the warmed-up model, validating on held-out images before and after.
    polyrl("train", "--manifest", str(HERE / "polyrl.toml"), "--config", str(HERE / "grpo.yaml"),
           f"model.path={run / 'sft' / 'hf'}", f"data.train_files=[{run / 'train.jsonl'}]",
           f"data.val_files=[{run / 'val.jsonl'}]", f"trainer.run_dir={run / 'grpo'}",
           *([f"trainer.total_steps={args.rl_steps}"] if args.rl_steps else []), *args.rl)
    polyrl("plot", str(run / "grpo"))

    # 4. Held-out accuracy (sampled, 4 per prompt) before and after RL, from the validation metrics.
    key = "val/shapes/mean@4"
    vals = [json.loads(line) for line in (run / "grpo" / "metrics.jsonl").read_text().splitlines() if key in line]
    print(f"curves: {run / 'grpo' / 'curves.png'}; took {time.time() - started:.0f}s")
    print(f"accuracy before RL: {vals[0][key]:.2f} after RL: {vals[-1][key]:.2f}")


if __name__ == "__main__":
    main()
