"""How long `polyrl train` takes to refuse a run that cannot score its data (issue 27: under 5 s, one line).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_startup_checks.py [--repeats 5]

Two mistakes that used to train at reward 0 and exit 0: rows with the ground truth under another column
(`answer` instead of `reward_model.ground_truth`) and a custom `data_source` with no `reward.function`.
Each is run from the command line as a user would (a fresh interpreter: imports, plugins, tokenizer, data),
with Ray as the executor (so a late check would start Ray and workers); the wall time to exit is measured and
the exit code and stderr checked. The median of `--repeats` runs is printed per mistake (wall time, and the
child's CPU time, which is what the wall time is on an idle machine), with the time of
`python -c "import polyrl.trainer.ppo"` (the interpreter and import cost every run pays) for reference.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _timed(cmd: list[str]) -> tuple[float, float, subprocess.CompletedProcess]:
    """Wall seconds, CPU seconds (user + system of the child: what the wall time is on an idle machine for
    this single-threaded start-up) and the finished process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, proc


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    from polyrl.models.tiny import make_tiny_model

    root = Path(tempfile.mkdtemp(prefix="polyrl-bench-startup-"))
    model = make_tiny_model(root / "model", size="tiny", seed=0)
    manifest = root / "polyrl.toml"
    manifest.write_text('[plugins]\nrequire = ["polyrl-engine-fsdp"]\n')
    prompt = [{"role": "user", "content": "1+2="}]
    cases = {
        "ground truth under another column": {"prompt": prompt, "data_source": "arithmetic", "answer": "3"},
        "custom data_source, no reward.function": {"prompt": prompt, "data_source": "my_task",
                                                   "reward_model": {"ground_truth": "3"}},
    }
    base = [sys.executable, "-m", "polyrl", "train", "--manifest", str(manifest), f"model.path={model}",
            "data.train_batch_size=4", "data.max_prompt_length=32", "data.max_response_length=6",
            "actor.ppo_mini_batch_size=2", "rollout.n=4", f"trainer.run_dir={root / 'run'}"]
    imports = [_timed([sys.executable, "-c", "import polyrl.trainer.ppo"]) for _ in range(args.repeats)]
    print(f"python -c 'import polyrl.trainer.ppo': median wall {statistics.median(t[0] for t in imports):.2f} s, "
          f"CPU {statistics.median(t[1] for t in imports):.2f} s")
    for name, row in cases.items():
        data = root / f"{abs(hash(name))}.jsonl"
        data.write_text("".join(json.dumps(row) + "\n" for _ in range(64)))
        walls, cpus = [], []
        for _ in range(args.repeats):
            wall, cpu, proc = _timed([*base, f"data.train_files=[{data}]"])
            lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
            assert proc.returncode == 2 and len(lines) == 1, proc.stderr
            assert not (root / "run").exists()
            walls.append(wall)
            cpus.append(cpu)
        print(f"{name}: exit 2, one line; median wall {statistics.median(walls):.2f} s (min {min(walls):.2f}), "
              f"CPU {statistics.median(cpus):.2f} s: {lines[0][:100]}...")


if __name__ == "__main__":
    main()
