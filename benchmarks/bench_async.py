"""Asynchronous training throughput: steps/s of ``trainer.async_mode`` sync, one_step_off_policy and fully_async.

The same model, data, reward and batch for each mode, in one run, with split placement: one actor worker and
one rollout worker (one process per core on this machine's two cores). Each mode runs ``--warmup`` untimed
steps, then ``--steps`` timed ones; steps/s is taken from the wall-clock times of the metrics lines (so the
waits between phases count). Held-out accuracy (sampled at temperature 1, mean@4) is measured after the last
step, and the mean train score of the last 3 steps is reported beside it.

Each mode runs once per ``--seeds`` value (``trainer.seed``: the sampling seeds; the model is the same) and the
table gives the means: 12 steps of RL on this random-init model are chaotic enough that one seed can put any
mode several steps ahead of another (docs/benchmarks.md).

Tasks (``--task``): ``digits`` (default) is the arithmetic prompts of the quickstart with a reward for answering
with digits, on a random-init model (it learns in a few steps; the quickstart's exact-answer reward needs a
supervised warm-up first); ``quickstart`` is the quickstart itself (``examples/quickstart/grpo.yaml`` from its
SFT warm start: exact answers, 32 prompts x 8 samples, lr 1e-4, 200 held-out prompts), where learning is
smooth. Seeds are paired: ``fully_async`` samples a batch-sized chunk with the seed ``sync`` gives the step that
trains it (as ``one_step_off_policy`` does), so the modes' first steps sample the same responses. The modes
alternate their order from seed to seed. See docs/benchmarks.md and docs/async.md.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_async.py [--task digits|quickstart] [--steps 10] \\
        [--warmup 2] [--seeds 1 2 3 4 5] [--modes sync fully_async] [--test-freq N]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

MODES = ("sync", "one_step_off_policy", "fully_async")
QUICKSTART = Path(__file__).resolve().parent.parent / "examples" / "quickstart"
REWARD = (
    "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
    "    text = solution_str[:6]\n"
    "    frac = sum(c.isdigit() for c in text) / max(1, len(text)) if text else 0.0\n"
    "    return {'score': frac, 'acc': float(frac >= 0.5)}\n"
)


def task_overrides(root: Path, model: Path, args: argparse.Namespace) -> list[str]:
    """What the task sets: ``digits`` (a random-init model, a reward for answering with digits, lr ``--lr``) or
    ``quickstart`` (the quickstart's SFT-started model and GRPO config: exact answers, lr 1e-4, 32 x 8 samples of
    8 tokens, two mini-batches per step, 200 held-out prompts)."""
    if args.task == "quickstart":
        return ["--config", str(QUICKSTART / "grpo.yaml"), f"model.path={model}",
                f"data.train_files=[{root / 'train.jsonl'}]", f"data.val_files=[{root / 'val.jsonl'}]"]
    return [
        f"model.path={model}", f"data.train_files=[{root / 'train.jsonl'}]", f"data.val_files=[{root / 'val.jsonl'}]",
        f"reward.function={root / 'reward.py'}:compute_score", f"data.train_batch_size={args.prompts}",
        "data.max_prompt_length=32", f"data.max_response_length={args.response_length}", "actor.engine=fsdp",
        f"actor.ppo_mini_batch_size={args.prompts}", f"actor.micro_batch_size={args.prompts * args.n}",
        f"actor.optim.lr={args.lr}", f"rollout.n={args.n}", f"rollout.max_batch_size={args.prompts * args.n}",
        "rollout.val_n=4", "rollout.val_temperature=1.0",
    ]


def run_mode(mode: str, root: Path, model: Path, args: argparse.Namespace, seed: int = 1) -> dict:
    """One ``polyrl train`` run in ``mode``; steps/s over the timed steps, per-phase means, final accuracy."""
    run = root / f"run-{mode}-seed{seed}"
    if run.exists():
        shutil.rmtree(run)
    total = args.warmup + args.steps
    overrides = [
        *task_overrides(root, model, args),
        f"trainer.seed={seed}", "trainer.executor=ray", "trainer.placement=split", "trainer.n_workers=1",
        "trainer.rollout_workers=1", "trainer.ray_num_cpus=2", f"trainer.total_steps={total}",
        f"trainer.test_freq={args.test_freq or total}", "trainer.val_before_train=false", "trainer.save_freq=0",
        "trainer.logger=[jsonl]", "trainer.progress_bar=false", "trainer.report_freq=0", f"trainer.run_dir={run}",
        f"trainer.async_mode={mode}", *args.polyrl_args,
    ]
    subprocess.run([sys.executable, "-m", "polyrl", "train", "--manifest", str(root / "polyrl.toml"), *overrides],
                   check=True, stdout=subprocess.DEVNULL)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "timing/step" in r]
    timed = steps[args.warmup:]
    # wall clock from the end of the last warm-up step to the end of the last step, validations excluded
    validations = sum(r.get("timing/validate", 0.0) for r in timed)
    seconds = timed[-1]["time"] - steps[args.warmup - 1]["time"] - validations if args.warmup else sum(
        r["timing/step"] for r in timed)
    keys = ("gen", "old_log_prob", "update_actor", "weight_sync", "step")
    phases = {k: sum(r.get(f"timing/{k}", 0.0) for r in timed) / len(timed) for k in keys}
    acc_key = "val/arithmetic/mean@4"
    acc = steps[-1].get(acc_key, float("nan"))
    curve = [(r["step"], r[acc_key]) for r in steps if acc_key in r]
    stale_max = max((r.get("async/staleness_max", 0.0) for r in timed), default=0.0)
    stale_mean = sum(r.get("async/staleness_mean", 0.0) for r in timed) / len(timed)
    return {"steps_per_s": len(timed) / seconds, "phases": phases, "accuracy": acc, "curve": curve,
            "staleness_max": stale_max, "staleness_mean": stale_mean, "score_first": steps[0]["critic/score/mean"],
            "scores": [r["critic/score/mean"] for r in steps],
            "score_last3": sum(r["critic/score/mean"] for r in steps[-3:]) / len(steps[-3:])}


def mean_over_seeds(runs: list[dict]) -> dict:
    """The seeds' mean of every number (phases too); per-seed accuracies and scores kept as lists."""
    out: dict = {k: sum(r[k] for r in runs) / len(runs) for k in ("steps_per_s", "accuracy", "score_last3")}
    out["staleness_max"] = max(r["staleness_max"] for r in runs)
    out["staleness_mean"] = sum(r["staleness_mean"] for r in runs) / len(runs)
    out["phases"] = {k: sum(r["phases"][k] for r in runs) / len(runs) for k in runs[0]["phases"]}
    out["per_seed"] = runs
    return out


def prepare(root: Path, args: argparse.Namespace) -> Path:
    """The task's model and data under ``root``; returns the model folder."""
    from polyrl.data.synthetic import make_arithmetic_rows, write_jsonl
    from polyrl.models.tiny import make_tiny_model

    (root / "polyrl.toml").write_text('[plugins]\nrequire = ["polyrl-engine-fsdp>=0.1,<0.2"]\n')
    if args.task == "quickstart":  # the quickstart's SFT warm start, built as bench_time_to_accuracy builds it
        if (root / "sft" / "hf").exists():  # built by an earlier run in this --out folder
            return root / "sft" / "hf"
        spec = importlib.util.spec_from_file_location("bench_tta", Path(__file__).with_name("bench_time_to_accuracy.py"))
        assert spec is not None and spec.loader is not None
        tta = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(tta)
        return tta.prepare(root)
    model = make_tiny_model(root / args.size, size=args.size, seed=0)
    rows = make_arithmetic_rows(600, seed=0, max_operand=99, ops="+-")
    write_jsonl(rows[:568], root / "train.jsonl")
    write_jsonl(rows[568:], root / "val.jsonl")
    (root / "reward.py").write_text(REWARD)
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="digits", choices=["digits", "quickstart"])
    parser.add_argument("--size", default="mini", choices=["tiny", "mini", "small"])
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--test-freq", type=int, default=0, help="validate every N steps (0: at the end only)")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step (digits task)")
    parser.add_argument("--n", type=int, default=4, help="samples per prompt (digits task)")
    parser.add_argument("--response-length", type=int, default=24, help="(digits task)")
    parser.add_argument("--lr", type=float, default=5e-3, help="(digits task)")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3, 4, 5],
                        help="trainer.seed values; means reported")
    parser.add_argument("--polyrl-args", nargs="*", default=[], help="extra `polyrl train` overrides (key=value)")
    parser.add_argument("--out", default=None, help="work folder (default: a new temporary one)")
    args = parser.parse_args()

    root = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="bench-async-"))
    root.mkdir(parents=True, exist_ok=True)
    model = prepare(root, args)
    print(f"task {args.task}, {args.steps} timed steps after {args.warmup}, seeds {args.seeds} (means); modes "
          f"alternate their order each seed; load average {os.getloadavg()}", flush=True)
    runs: dict[str, list[dict]] = {mode: [] for mode in args.modes}
    for i, seed in enumerate(args.seeds):
        for mode in (args.modes if i % 2 == 0 else list(reversed(args.modes))):
            r = run_mode(mode, root, model, args, seed)
            runs[mode].append(r)
            print(f"  seed {seed} {mode:20} {r['steps_per_s']:.3f} steps/s, accuracy {r['accuracy']:.3f}, staleness "
                  f"mean {r['staleness_mean']:.2f} max {r['staleness_max']:.0f}", flush=True)
    print(f"{'mode':20} {'steps/s':>8} {'x sync':>7} {'acc@end':>8} {'score':>6} {'stale':>9}  mean s/step by phase",
          flush=True)
    results = {}
    for mode in args.modes:
        r = results[mode] = mean_over_seeds(runs[mode])
        ratio = r["steps_per_s"] / results["sync"]["steps_per_s"] if "sync" in results else float("nan")
        phases = " ".join(f"{k} {v:.3f}" for k, v in r["phases"].items())
        print(f"{mode:20} {r['steps_per_s']:8.3f} {ratio:7.2f} {r['accuracy']:8.3f} {r['score_last3']:6.3f} "
              f"{r['staleness_mean']:4.2f}/{r['staleness_max']:.0f}  {phases}", flush=True)
        per_seed = " ".join(f"{x['accuracy']:.3f}" for x in r["per_seed"])
        print(f"{'':20} accuracy per seed: {per_seed}", flush=True)
    print(f"load average {os.getloadavg()}", flush=True)
    print(json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
