"""Profile one GRPO step of polyrl on the real model (issue 48): the ``gsm8k`` workload of
``bench_grpo_vs_trl.py`` (SmolLM2-135M-Instruct, GSM8K prompts through its chat template, completions that stop at
``<|im_end|>``), one process of ``--threads`` threads, torch.profiler on step ``--warmup + 1``, then
``polyrl profile``'s summary and the step's driver phases.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/profile_real_step.py --prompts 4 --samples 4 --completion 128
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_grpo_vs_trl as bench  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--completion", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=1, help="profiled steps after the warm-up")
    parser.add_argument("--precision", default="bfloat16", choices=sorted(bench.PRECISION_ARGS))
    parser.add_argument("--no-profile", action="store_true", help="only the driver phases (no torch.profiler)")
    parser.add_argument("--out", type=Path, default=None, help="run folder (default: a temporary one)")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("overrides", nargs="*", help="extra `polyrl train` overrides (key=value)")
    args = parser.parse_args()
    bench._set_batch(args.prompts, args.samples, args.completion)
    model_dir = bench.real_model("smollm2-135m")
    root = args.out or Path(tempfile.mkdtemp(prefix="profile-real-"))
    data, prompt_tokens = bench.prompt_file(bench.make_rows("gsm8k"), model_dir, root / "gsm8k.jsonl")
    steps = list(range(args.warmup + 1, args.warmup + args.steps + 1))
    extra = [] if args.no_profile else [f"trainer.profile.steps=[{','.join(map(str, steps))}]"]
    result = bench.run_polyrl(model_dir, data, args.warmup, args.steps, root / "polyrl", 1,
                              [*extra, *args.overrides], args.precision, args.threads, "cpu", "gsm8k")
    print(json.dumps({"prompt_tokens_mean": prompt_tokens, **result}, indent=1))
    if not args.no_profile:
        subprocess.run([sys.executable, "-m", "polyrl", "profile", str(root / "polyrl" / "run"), "--top",
                        str(args.top)], check=True, env=dict(os.environ))
    print("run folder:", root)


if __name__ == "__main__":
    main()
