"""GiGPO against GRPO on the grid-world, over seeds: success-rate curves of the tiny model (CPU, minutes).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_gigpo_vs_grpo.py --out /tmp/gigpo-vs-grpo
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_gigpo_vs_grpo.py --seeds 1 --steps 5   # a smoke run

The task is the built-in ``gridworld`` (the player starts top-left, the goal is bottom-right; reward 1 at the
goal and nothing else: a sparse reward, paid only at the end of a 6-move walk at best). The tiny built-in model
(random weights, a character tokenizer) cannot write ``<action>right</action>``, so a wrapper environment reads
its first character as the move (its code mod 4: up, right, down, left); everything else is the real
``stepwise`` loop, the real trainer and the real estimators. Each run trains ``--steps`` steps of
``--prompts`` rows x ``rollout.n`` episodes; GiGPO and GRPO alternate within each seed (same data order, same
sampling seeds), so the comparison is paired. Writes ``curves.json`` (success rate per step, per seed and
estimator), ``curves.csv``, ``summary.md`` (the table docs/environments.md shows) and ``curves.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

ENV_PLUGIN = '''
from polyrl import hookimpl
from polyrl.environments.gridworld import GridWorld

MOVES = ("up", "right", "down", "left")


class CharGridWorld(GridWorld):
    """The grid-world, its move read from the first character of the model's text (code mod 4)."""

    def step(self, action):
        return super().step(MOVES[ord(action[0]) % 4])


@hookimpl
def register_environments(register):
    register("char_gridworld", lambda config: CharGridWorld(int(config.get("size", 4)), int(config.get("holes", 0))))
'''


def run(model: Path, root: Path, estimator: str, seed: int, args: argparse.Namespace) -> list[float]:
    from polyrl.trainer.commands import train

    run_dir = root / f"{estimator}-seed{seed}"
    train(root / "polyrl.toml", [], [
        f"model.path={model}", f"data.train_files=[{root / 'train.jsonl'}]",
        f"data.train_batch_size={args.prompts}", "data.max_prompt_length=64", "data.max_response_length=2",
        "actor.engine=fsdp", f"actor.ppo_mini_batch_size={args.prompts}", "actor.micro_batch_size=256",
        f"actor.optim.lr={args.lr}", "actor.optim.weight_decay=0.0", f"rollout.n={args.n}",
        f"algorithm.adv_estimator={estimator}", f"algorithm.gamma={args.gamma}", "trainer.executor=local",
        f"trainer.total_steps={args.steps}", "trainer.progress_bar=false", "trainer.logger=[jsonl]",
        "trainer.val_before_train=false", f"trainer.seed={seed}", f"data.seed={seed}", f"trainer.run_dir={run_dir}"])
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["env/success_rate"] for r in metrics if "env/success_rate" in r]


def first_at(curve: list[float], level: float) -> int | None:
    return next((i + 1 for i, x in enumerate(curve) if x >= level), None)


def summarise(curves: dict[str, dict[str, list[float]]], steps: int) -> str:
    third = max(1, steps // 3)
    spans = [(0, third), (third, 2 * third), (2 * third, steps)]
    head = " | ".join(f"mean, steps {a + 1}-{b}" for a, b in spans)
    lines = [f"| seed | estimator | first step at >= 0.5 | {head} |", "|---" * (3 + len(spans)) + "|"]
    for seed in sorted(curves, key=int):
        for est in ("gigpo", "grpo"):
            c = curves[seed][est]
            cells = " | ".join(f"{statistics.mean(c[a:b]):.2f}" for a, b in spans)
            lines.append(f"| {seed} | {est} | {first_at(c, 0.5) or '-'} | {cells} |")
    for est in ("gigpo", "grpo"):
        per_seed = [curves[s][est] for s in curves]
        cells = " | ".join(f"{statistics.mean(statistics.mean(c[a:b]) for c in per_seed):.2f}" for a, b in spans)
        lines.append(f"| mean | {est} | | {cells} |")
    return "\n".join(lines) + "\n"


def plot(curves: dict[str, dict[str, list[float]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=100)
    colours = {"gigpo": "tab:blue", "grpo": "tab:orange"}
    for seed in sorted(curves, key=int):
        for est, c in curves[seed].items():
            ax.plot(range(1, len(c) + 1), c, color=colours[est], alpha=0.35, linewidth=1)
    for est, colour in colours.items():
        per_seed = [curves[s][est] for s in curves]
        mean = [statistics.mean(v) for v in zip(*per_seed)]
        ax.plot(range(1, len(mean) + 1), mean, color=colour, linewidth=2.2, label=f"{est} (mean of {len(per_seed)} seeds)")
    ax.set_xlabel("training step")
    ax.set_ylabel("success rate")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title("grid-world 4x4, tiny model: GiGPO vs GRPO")
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("/tmp/polyrl-gigpo-vs-grpo"))
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--prompts", type=int, default=4, help="rows a step (data.train_batch_size)")
    parser.add_argument("--n", type=int, default=4, help="episodes a row (rollout.n): the episode group")
    parser.add_argument("--size", type=int, default=4)
    parser.add_argument("--holes", type=int, default=0)
    parser.add_argument("--max-steps", type=int, default=10, help="moves an episode may take")
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--gamma", type=float, default=0.95)
    args = parser.parse_args()

    from polyrl.data.synthetic import write_jsonl
    from polyrl.models.tiny import make_tiny_model

    root = args.out
    root.mkdir(parents=True, exist_ok=True)
    (root / "char_gridworld_env.py").write_text(ENV_PLUGIN)
    sys.path.insert(0, str(root))
    os.environ["PYTHONPATH"] = os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])
    (root / "polyrl.toml").write_text('[plugins]\nrequire = ["polyrl-engine-fsdp>=0.1,<0.2"]\n'
                                      'modules = ["char_gridworld_env"]\n')
    task = [{"role": "user", "content": "Walk to G."}]
    rows = [{"prompt": task, "data_source": "env/char_gridworld", "agent_name": "stepwise",
             "extra_info": {"env": "char_gridworld", "env_kwargs": {"size": args.size, "holes": args.holes},
                            "seed": i, "action_pattern": "", "history_k": 0, "max_steps": args.max_steps}}
            for i in range(64)]
    write_jsonl(rows, root / "train.jsonl")
    model = make_tiny_model(root / "model", size="tiny", seed=0)

    curves: dict[str, dict[str, list[float]]] = {}
    timing = {}
    for seed in args.seeds:
        order = ("gigpo", "grpo") if seed % 2 else ("grpo", "gigpo")  # alternate which goes first
        for est in order:
            start = time.perf_counter()
            curves.setdefault(str(seed), {})[est] = run(model, root, est, seed, args)
            timing[f"{est}-seed{seed}"] = round(time.perf_counter() - start, 1)
            print(f"seed {seed} {est}: {timing[f'{est}-seed{seed}']} s, success {curves[str(seed)][est]}", flush=True)
    (root / "curves.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                  "curves": curves, "seconds": timing}, indent=1))
    with (root / "curves.csv").open("w") as f:
        f.write("seed,estimator,step,success_rate\n")
        for seed, per in curves.items():
            for est, c in per.items():
                f.writelines(f"{seed},{est},{i + 1},{x}\n" for i, x in enumerate(c))
    summary = summarise(curves, args.steps)
    (root / "summary.md").write_text(summary)
    print(summary)
    plot(curves, root / "curves.png")
    print(f"wrote {root / 'curves.json'}, curves.csv, summary.md, curves.png")


if __name__ == "__main__":
    main()
