"""Asynchronous training throughput: steps/s of ``trainer.async_mode`` sync, one_step_off_policy and fully_async.

The same model, data, reward and batch for each mode, in one run, with split placement: one actor worker and
one rollout worker (one process per core on this machine's two cores). Each mode runs ``--warmup`` untimed
steps, then ``--steps`` timed ones; steps/s is taken from the wall-clock times of the metrics lines (so the
waits between phases count). Held-out accuracy (sampled at temperature 1, mean@4) is measured after the last
step, and the mean train score of the last 3 steps is reported beside it.

Each mode runs once per ``--seeds`` value (``trainer.seed``: the sampling seeds; the model is the same) and the
table gives the means: 12 steps of RL on this random-init model are chaotic enough that one seed can put any
mode several steps ahead of another (docs/benchmarks.md).

The task is the arithmetic prompts of the quickstart with a reward for answering with digits (a random-init
model learns it in a few steps; the quickstart's exact-answer reward needs a supervised warm-up first).
See docs/benchmarks.md and docs/async.md.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_async.py [--size mini] [--steps 10] [--warmup 2] [--seeds 1 2 3 4 5]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

MODES = ("sync", "one_step_off_policy", "fully_async")
REWARD = (
    "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
    "    text = solution_str[:6]\n"
    "    frac = sum(c.isdigit() for c in text) / max(1, len(text)) if text else 0.0\n"
    "    return {'score': frac, 'acc': float(frac >= 0.5)}\n"
)


def run_mode(mode: str, root: Path, model: Path, args: argparse.Namespace, seed: int = 1) -> dict:
    """One ``polyrl train`` run in ``mode``; steps/s over the timed steps, per-phase means, final accuracy."""
    run = root / f"run-{mode}-seed{seed}"
    total = args.warmup + args.steps
    overrides = [
        f"model.path={model}", f"data.train_files=[{root / 'train.jsonl'}]", f"data.val_files=[{root / 'val.jsonl'}]",
        f"reward.function={root / 'reward.py'}:compute_score", f"data.train_batch_size={args.prompts}",
        "data.max_prompt_length=32", f"data.max_response_length={args.response_length}", "actor.engine=fsdp",
        f"actor.ppo_mini_batch_size={args.prompts}", f"actor.micro_batch_size={args.prompts * args.n}",
        f"actor.optim.lr={args.lr}", f"rollout.n={args.n}", f"rollout.max_batch_size={args.prompts * args.n}",
        "rollout.val_n=4", "rollout.val_temperature=1.0", f"trainer.seed={seed}", "trainer.executor=ray", "trainer.placement=split", "trainer.n_workers=1",
        "trainer.rollout_workers=1", "trainer.ray_num_cpus=2", f"trainer.total_steps={total}",
        f"trainer.test_freq={total}", "trainer.val_before_train=false", "trainer.save_freq=0",
        "trainer.logger=[jsonl]", "trainer.progress_bar=false", f"trainer.run_dir={run}",
        f"trainer.async_mode={mode}", *args.polyrl_args,
    ]
    subprocess.run([sys.executable, "-m", "polyrl", "train", "--manifest", str(root / "polyrl.toml"), *overrides],
                   check=True, stdout=subprocess.DEVNULL)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "timing/step" in r]
    timed = steps[args.warmup:]
    # wall clock from the end of the last warm-up step to the end of the last step (validation excluded)
    last_val = timed[-1].get("timing/validate", 0.0)
    seconds = timed[-1]["time"] - steps[args.warmup - 1]["time"] - last_val if args.warmup else sum(
        r["timing/step"] for r in timed)
    keys = ("gen", "old_log_prob", "update_actor", "weight_sync", "step")
    phases = {k: sum(r.get(f"timing/{k}", 0.0) for r in timed) / len(timed) for k in keys}
    acc = next((v for k, v in steps[-1].items() if k.startswith("val/") and "mean@4" in k), float("nan"))
    stale = max((r.get("async/staleness_max", 0.0) for r in timed), default=0.0)
    return {"steps_per_s": len(timed) / seconds, "phases": phases, "accuracy": acc, "staleness_max": stale,
            "score_first": steps[0]["critic/score/mean"],
            "score_last3": sum(r["critic/score/mean"] for r in steps[-3:]) / len(steps[-3:])}


def mean_over_seeds(runs: list[dict]) -> dict:
    """The seeds' mean of every number (phases too); per-seed accuracies and scores kept as lists."""
    out: dict = {k: sum(r[k] for r in runs) / len(runs) for k in ("steps_per_s", "accuracy", "score_last3")}
    out["staleness_max"] = max(r["staleness_max"] for r in runs)
    out["phases"] = {k: sum(r["phases"][k] for r in runs) / len(runs) for k in runs[0]["phases"]}
    out["per_seed"] = runs
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="mini", choices=["tiny", "mini", "small"])
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step")
    parser.add_argument("--n", type=int, default=4, help="samples per prompt")
    parser.add_argument("--response-length", type=int, default=24)
    parser.add_argument("--lr", type=float, default=5e-3)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3, 4, 5],
                        help="trainer.seed values; means reported")
    parser.add_argument("--polyrl-args", nargs="*", default=[], help="extra `polyrl train` overrides (key=value)")
    args = parser.parse_args()

    from polyrl.data.synthetic import make_arithmetic_rows, write_jsonl
    from polyrl.models.tiny import make_tiny_model

    root = Path(tempfile.mkdtemp(prefix="bench-async-"))
    model = make_tiny_model(root / args.size, size=args.size, seed=0)
    rows = make_arithmetic_rows(600, seed=0, max_operand=99, ops="+-")
    write_jsonl(rows[:568], root / "train.jsonl")
    write_jsonl(rows[568:], root / "val.jsonl")
    (root / "reward.py").write_text(REWARD)
    (root / "polyrl.toml").write_text('[plugins]\nrequire = ["polyrl-engine-fsdp>=0.1,<0.2"]\n')
    print(f"model {args.size}, {args.prompts} prompts x {args.n} samples, {args.response_length} response tokens, "
          f"{args.steps} timed steps after {args.warmup}, seeds {args.seeds} (means)", flush=True)
    print(f"{'mode':20} {'steps/s':>8} {'x sync':>7} {'acc@end':>8} {'score':>6} {'stale':>6}  mean s/step by phase",
          flush=True)
    results = {}
    for mode in args.modes:
        r = results[mode] = mean_over_seeds([run_mode(mode, root, model, args, seed) for seed in args.seeds])
        ratio = r["steps_per_s"] / results["sync"]["steps_per_s"] if "sync" in results else float("nan")
        phases = " ".join(f"{k} {v:.3f}" for k, v in r["phases"].items())
        print(f"{mode:20} {r['steps_per_s']:8.3f} {ratio:7.2f} {r['accuracy']:8.3f} {r['score_last3']:6.3f} "
              f"{r['staleness_max']:6.0f}  {phases}", flush=True)
    print(json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
