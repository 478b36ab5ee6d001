"""Flow-GRPO, Flow-GRPO-Fast, MixGRPO, DanceGRPO and DiffusionNFT head to head on the tiny model.

    python benchmarks/bench_diffusion_algos.py --steps 25 --seeds 0 1 2 3 4 --target 0.7 --out runs/bench_diffusion_algos

Every algorithm trains the same tiny SD3-family pipeline (random init, built in code) on the same offline
reward (``brightness``: mean pixel value in [0, 1]) with the same prompts, batch (4 prompts x 4 images),
optimiser and learning rate, through ``polyrl train`` (``trainer.name=flow_grpo``, ``executor=local``: one
process, so the wall clock measures the algorithm, not Ray). For each algorithm and seed it records the
mean reward of each step's images against the training wall-clock seconds (the sum of ``timing/step``) and
against the images generated so far; it writes ``results.json``, ``reward_curves.png`` (mean over seeds,
min-max band) and prints a table with the seconds and images each needs to reach ``--target``.

What each row trains (``trainer.flow_grpo`` keys, docs/diffusion.md "Algorithms"):

* ``flow_grpo``: SDE on every sampler step but the last (an ODE step, as in the reference), all trained.
* ``flow_grpo_fast``: SDE on a window of 2 steps, ODE elsewhere, only the window trained.
* ``mix_grpo``: a 2-step SDE window that slides forward every 2 training steps (the recipe: every 25), shared
  initial noise per prompt group.
* ``dance_grpo``: shared initial noise per prompt group, DanceGRPO's constant eta 0.3, 60% of the steps trained.
* ``diffusion_nft``: the authors' defaults: ODE sampling by the old policy (soft-updated), forward-process loss on
  the clean images at 5 of the 6 schedule times, adaptive weighting, KL 1e-4 to the reference.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

PROMPTS = ["a photo of a cat", "a red house", "a dark sky", "a tree"]
BATCH, N = 4, 4  # prompts per step, images per prompt

#: algorithm -> its config overrides on top of the common ones
ALGORITHMS: dict[str, list[str]] = {
    "flow_grpo": ["trainer.flow_grpo.sde_window_size=0"],
    "flow_grpo_fast": ["trainer.flow_grpo.sde_window_size=2"],
    "mix_grpo": ["trainer.flow_grpo.mix_grpo.enable=true", "trainer.flow_grpo.mix_grpo.window_size=2",
                 "trainer.flow_grpo.mix_grpo.shift_interval=2"],
    "dance_grpo": ["trainer.flow_grpo.dance_grpo.enable=true"],
    "diffusion_nft": ["trainer.flow_grpo.algorithm=diffusion_nft"],
}


def common_overrides(model: Path, data: Path, run: Path, steps: int, seed: int, reward: str, lr: float) -> list[str]:
    """The settings every algorithm shares."""
    from polyrl_diffusion.quickstart import flow_grpo_overrides

    return [*flow_grpo_overrides(model, data, run, batch=BATCH, n=N, lr=lr, steps=steps, reward=reward),
            f"data.seed={seed}", f"trainer.seed={seed}", "trainer.resume=disable"]


def run_one(algo: str, seed: int, *, root: Path, model: Path, data: Path, steps: int, reward: str,
            lr: float) -> dict:
    """Train one algorithm with one seed; its per-step rewards, cumulative seconds and images."""
    from polyrl.trainer.commands import train

    run = root / f"{algo}-seed{seed}"
    started = time.perf_counter()
    train(root / "polyrl.toml", [], common_overrides(model, data, run, steps, seed, reward, lr) + ALGORITHMS[algo])
    wall = time.perf_counter() - started
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "critic/score/mean" in r]
    seconds, total = [], 0.0
    for r in rows:
        total += float(r["timing/step"])
        seconds.append(total)
    return {"algo": algo, "seed": seed, "reward": [float(r["critic/score/mean"]) for r in rows],
            "seconds": seconds, "images": [(i + 1) * BATCH * N for i in range(len(rows))], "wall_s": wall}


def first_reaching(values: list[float], axis: list[float], target: float) -> float | None:
    """The ``axis`` value of the first step whose reward is >= ``target`` (None: never)."""
    for v, x in zip(values, axis):
        if v >= target:
            return x
    return None


def summarise(results: list[dict], target: float) -> list[dict]:
    """Per algorithm: mean start/end reward, seconds per step, and seconds/images to reach ``target``."""
    table = []
    for algo in dict.fromkeys(r["algo"] for r in results):
        runs = [r for r in results if r["algo"] == algo]
        reach_s = [first_reaching(r["reward"], r["seconds"], target) for r in runs]
        reach_i = [first_reaching(r["reward"], r["images"], target) for r in runs]
        hit = [x for x in reach_s if x is not None]
        table.append({
            "algo": algo,
            "reward_first": statistics.mean(r["reward"][0] for r in runs),
            "reward_last3": statistics.mean(statistics.mean(r["reward"][-3:]) for r in runs),
            "s_per_step": statistics.mean(r["seconds"][-1] / len(r["seconds"]) for r in runs),
            "reached": f"{len(hit)}/{len(runs)}",
            "s_to_target": statistics.median(hit) if hit else None,
            "images_to_target": statistics.median([x for x in reach_i if x is not None]) if hit else None,
        })
    return table


def plot(results: list[dict], target: float, path: Path) -> None:
    """Reward vs seconds and vs images: mean over seeds with a min-max band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for algo in dict.fromkeys(r["algo"] for r in results):
        runs = [r for r in results if r["algo"] == algo]
        n = min(len(r["reward"]) for r in runs)
        rewards = np.array([r["reward"][:n] for r in runs])
        secs = np.mean([r["seconds"][:n] for r in runs], axis=0)
        for ax, x in ((axes[0], secs), (axes[1], np.array(runs[0]["images"][:n]))):
            (line,) = ax.plot(x, rewards.mean(0), label=algo)
            ax.fill_between(x, rewards.min(0), rewards.max(0), color=line.get_color(), alpha=0.15)
    for ax, label in ((axes[0], "training wall-clock seconds"), (axes[1], "images generated")):
        ax.axhline(target, color="gray", linestyle=":", linewidth=1)
        ax.set_xlabel(label)
        ax.set_ylabel("mean brightness reward of the step's images")
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle(f"tiny SD3-family model, brightness reward, {len({r['seed'] for r in results})} seeds (band: min-max)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/bench_diffusion_algos")
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--algos", nargs="+", default=list(ALGORITHMS), choices=list(ALGORITHMS))
    parser.add_argument("--target", type=float, default=0.6, help="the stated reward each algorithm must reach")
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args(argv)
    import logging

    logging.basicConfig(level=logging.WARNING)
    from polyrl_diffusion.models import make_tiny_pipeline

    root = Path(args.out).resolve()
    root.mkdir(parents=True, exist_ok=True)
    model = root / "model"
    if not (model / "model_index.json").exists():
        make_tiny_pipeline(model, family="sd3", seed=0)
    data = root / "train.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": p, "data_source": "brightness"}) for p in PROMPTS * 4))
    (root / "polyrl.toml").write_text('[plugins]\nrequire = ["polyrl-engine-fsdp", "polyrl-diffusion"]\n')
    results = []
    for seed in args.seeds:
        for algo in args.algos:
            result = run_one(algo, seed, root=root, model=model, data=data, steps=args.steps, reward="brightness",
                             lr=args.lr)
            results.append(result)
            print(f"{algo:15s} seed {seed}: reward {result['reward'][0]:.3f} -> {result['reward'][-1]:.3f} in "
                  f"{result['seconds'][-1]:.1f} s training ({result['wall_s']:.1f} s wall)", flush=True)
    table = summarise(results, args.target)
    (root / "results.json").write_text(json.dumps({"target": args.target, "runs": results, "table": table}, indent=1))
    plot(results, args.target, root / "reward_curves.png")
    print(f"\nreward target {args.target} (brightness); median over the seeds that reached it")
    print("| algorithm | reward step 1 | reward last 3 | s/step | reached | s to target | images to target |")
    print("|---|---|---|---|---|---|---|")
    for row in table:
        s = "-" if row["s_to_target"] is None else f"{row['s_to_target']:.1f}"
        i = "-" if row["images_to_target"] is None else f"{row['images_to_target']:.0f}"
        print(f"| {row['algo']} | {row['reward_first']:.3f} | {row['reward_last3']:.3f} | {row['s_per_step']:.2f} | "
              f"{row['reached']} | {s} | {i} |")
    print(f"\nwrote {root / 'results.json'} and {root / 'reward_curves.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
