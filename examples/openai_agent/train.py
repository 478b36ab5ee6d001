"""Train an unchanged OpenAI-API agent program with GRPO on a CPU: ``calculator_agent.py`` through polyrl's
``openai_agent`` loop.

Everything is built here, with no download: a random-init tiny model with a character tokenizer and rows asking
for ``a+b*c``. The run is what a user runs: ``polyrl train`` with ``agent.default_loop=openai_agent`` and
``agent.openai_agent.run=<this folder>/calculator_agent.py:run``. Each sample runs the program once; its chat
completions are sampled by the rollout through a local endpoint and trained token for token; the program's
return value is the sample's reward. The tiny model never learns arithmetic in a few steps; this shows the
wiring (metrics ``agent/model_calls/total``, ``agent/tool_reward/mean``, ``agent/program_*``).

Usage: ``python examples/openai_agent/train.py [--run-dir DIR] [--steps N]``. See docs/agents.md, "Agent programs".
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def make_rows(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        a, b, c = rng.randint(1, 9), rng.randint(1, 9), rng.randint(1, 9)
        rows.append({"prompt": [{"role": "system", "content": "Use the calculator."},
                                {"role": "user", "content": f"{a}+{b}*{c}=?"}],
                     "data_source": "openai_agent", "extra_info": {"index": i, "answer": a + b * c}})
    return rows


def overrides(model: Path, data: Path, run_dir: Path, steps: int) -> list[str]:
    """The ``polyrl train`` overrides of this example (the integration test runs the same)."""
    return [f"model.path={model}", f"data.train_files=[{data}]", "data.train_batch_size=2",
            "data.max_prompt_length=96", "data.max_response_length=160", "actor.engine=fsdp",
            "actor.ppo_mini_batch_size=2", "actor.micro_batch_size=8", "actor.optim.lr=1e-3", "rollout.n=4",
            "agent.default_loop=openai_agent", f"agent.openai_agent.run={HERE / 'calculator_agent.py'}:run",
            "agent.openai_agent.timeout_s=60", "trainer.executor=local", "trainer.val_before_train=false",
            f"trainer.total_steps={steps}", "trainer.logger=[jsonl]", "trainer.progress_bar=false",
            f"trainer.run_dir={run_dir}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", default="runs/openai-agent")
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    from polyrl.data.synthetic import write_jsonl
    from polyrl.models.tiny import make_tiny_model

    run_dir = Path(args.run_dir).resolve()
    work = run_dir.parent / (run_dir.name + "-inputs")
    work.mkdir(parents=True, exist_ok=True)
    model = make_tiny_model(work / "tiny", size="tiny", seed=0)
    write_jsonl(make_rows(64), work / "train.jsonl")
    cmd = [sys.executable, "-m", "polyrl", "train", "--manifest", str(HERE / "polyrl.toml"),
           *overrides(model, work / "train.jsonl", run_dir, args.steps)]
    print("$ polyrl " + " ".join(cmd[3:]), flush=True)
    subprocess.run(cmd, check=True)
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if "agent/model_calls/total" in row:
            print(f"step {row.get('step', '?')}: reward {row['agent/tool_reward/mean']:.3f}, "
                  f"model calls {row['agent/model_calls/total']:.0f}, "
                  f"failed programs {sum(v for k, v in row.items() if k.startswith('agent/program_')):.0f}")


if __name__ == "__main__":
    main()
