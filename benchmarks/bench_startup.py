"""Time to the first step: ``polyrl train`` with the local executor, with Ray, and TRL's GRPOTrainer.

Each variant is a fresh process started the way a user starts it, timed from the launch until its first
training step has finished (polyrl: the ``step 1:`` console line; TRL: a callback at the end of its first
step). The run is the quickstart's GRPO run (examples/quickstart/grpo.yaml: the ``mini`` model, 32 prompts x
8 samples, 8-token answers) cut to one step, without the validation before training; ``ray`` is that config
as it is (two Ray workers), ``local`` the same with ``trainer.executor=local``. TRL trains the same model on
the same prompts with the same batch (256 completions of up to 8 tokens) in one process. The variants run in
turn (``--repeats`` rounds, the order rotating each round) and the medians are compared:
``ray / local`` (target: at most 2) and ``local / TRL`` (target: below 1).

TRL is the baseline, not a polyrl dependency: point ``--trl-python`` at an interpreter that has it, e.g. a
venv made with ``pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu`` then
``pip install trl`` (TRL's side imports nothing from polyrl). Without it the TRL rows are skipped.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_startup.py [--repeats 5] [--trl-python /path/to/python]
        [--variants local ray trl]

Also ``--export``: ``polyrl export`` of the ray run's checkpoint (2 ranks), timed as it runs by default (in one
process, no Ray: the checkpoint fits one) and with ``trainer.executor=ray`` (the run's two Ray workers, what
export always did before). Results: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "examples" / "quickstart"
MARK = "BENCH_FIRST_STEP_DONE"


def prepare(root: Path) -> dict[str, Path]:
    """The quickstart's model (``mini``, random init) and arithmetic data, built in code."""
    from polyrl.data.synthetic import make_arithmetic_rows, write_jsonl
    from polyrl.models.tiny import make_tiny_model

    model = make_tiny_model(root / "base", size="mini", seed=0)
    rows = make_arithmetic_rows(800, seed=0, max_operand=20, ops="+")
    write_jsonl(rows, root / "train.jsonl")
    return {"model": Path(model), "train": root / "train.jsonl"}


def _time_until(cmd: list[str], marker: str, env: dict[str, str] | None = None, timeout: float = 600) -> float:
    """Seconds from launching ``cmd`` until a line of its stderr/stdout contains ``marker`` (then it may finish)."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    seen: float | None = None
    tail: list[str] = []
    assert proc.stdout is not None
    for line in proc.stdout:
        tail = (tail + [line])[-40:]
        if seen is None and marker in line:
            seen = time.perf_counter() - start
        if time.perf_counter() - start > timeout:
            proc.kill()
            break
    code = proc.wait()
    if seen is None or code != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])}... exited {code} before '{marker}':\n{''.join(tail)}")
    return seen


def run_polyrl(files: dict[str, Path], run_dir: Path, executor: str) -> float:
    """``polyrl train`` with the quickstart's GRPO config, one step, no validation before it."""
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [sys.executable, "-m", "polyrl", "train", "--manifest", str(QUICKSTART / "polyrl.toml"),
           "--config", str(QUICKSTART / "grpo.yaml"), f"model.path={files['model']}",
           f"data.train_files=[{files['train']}]", f"trainer.run_dir={run_dir}", "trainer.total_steps=1",
           "trainer.val_before_train=false", "trainer.progress_bar=false", "trainer.save_freq=1",
           f"trainer.executor={executor}"]
    return _time_until(cmd, "step 1:")


def run_trl(files: dict[str, Path], out: Path, python: str) -> float:
    shutil.rmtree(out, ignore_errors=True)
    cmd = [python, __file__, "--trl-child", json.dumps([str(files["model"]), str(files["train"]), str(out)])]
    env = dict(os.environ, PYTHONPATH="")  # TRL's own environment: nothing of polyrl's venv
    return _time_until(cmd, MARK, env=env)


def trl_child(model_dir: str, data: str, out: str) -> None:
    """TRL's GRPOTrainer, the quickstart's batch (32 prompts x 8 completions of up to 8 tokens), one step."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    rows = [json.loads(line) for line in Path(data).read_text().splitlines()]
    ds = Dataset.from_list([{"prompt": r["prompt"], "answer": str(r["reward_model"]["ground_truth"])} for r in rows])

    def reward(completions, answer, **kw):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [1.0 if t.strip().startswith(a) else 0.0 for t, a in zip(texts, answer)]

    class FirstStep(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if state.global_step == 1:
                print(MARK, flush=True)

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    cfg = GRPOConfig(
        output_dir=out, per_device_train_batch_size=32 * 8, num_generations=8, gradient_accumulation_steps=1,
        max_completion_length=8, max_steps=1, learning_rate=1e-4, logging_steps=1, report_to="none", use_cpu=True,
        bf16=False, fp16=False, save_strategy="no", temperature=1.0, beta=0.0, dataloader_num_workers=0,
        use_vllm=False, gradient_checkpointing=False,
    )
    GRPOTrainer(model=model, reward_funcs=reward, args=cfg, train_dataset=ds, processing_class=tok,
                callbacks=[FirstStep()]).train()


def run_export(run_dir: Path, out: Path, *extra: str) -> float:
    """``polyrl export`` of the newest checkpoint of ``run_dir``, launch to exit (``extra``: overrides)."""
    shutil.rmtree(out, ignore_errors=True)
    ckpt = sorted((run_dir / "checkpoints").glob("step_*"))[-1]
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "polyrl", "export", str(ckpt), "--to", str(out), *extra], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--variants", nargs="+", default=["local", "ray", "trl"], choices=["local", "ray", "trl"])
    parser.add_argument("--trl-python", default="", help="a Python with TRL installed (default: this one, if it has TRL)")
    parser.add_argument("--export", action="store_true", help="also time `polyrl export` of the ray run's checkpoint")
    parser.add_argument("--trl-child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trl_child:
        trl_child(*json.loads(args.trl_child))
        return

    variants = list(args.variants)
    trl_python = args.trl_python
    if "trl" in variants and not trl_python:
        probe = subprocess.run([sys.executable, "-c", "import trl"], capture_output=True)
        trl_python = sys.executable if probe.returncode == 0 else ""
    if "trl" in variants and not trl_python:
        print("TRL not importable here and no --trl-python: the trl variant is skipped", file=sys.stderr)
        variants.remove("trl")

    root = Path(tempfile.mkdtemp(prefix="bench-startup-"))
    try:
        files = prepare(root)
        times: dict[str, list[float]] = {v: [] for v in variants}
        exports: list[float] = []
        ray_exports: list[float] = []
        for r in range(args.repeats):
            order = variants[r % len(variants):] + variants[: r % len(variants)]
            for v in order:
                seconds = run_trl(files, root / "trl", trl_python) if v == "trl" else run_polyrl(files, root / v, v)
                times[v].append(seconds)
                print(f"round {r + 1}: {v:5s} first step after {seconds:.2f}s", flush=True)
            if args.export and "ray" in variants:
                # in this process (the checkpoint of 2 ranks fits one), then the run's 2 Ray workers as before
                exports.append(run_export(root / "ray", root / "export"))
                ray_exports.append(run_export(root / "ray", root / "export-ray", "trainer.executor=ray"))
                print(f"round {r + 1}: export {exports[-1]:.2f}s (with the run's Ray workers: {ray_exports[-1]:.2f}s)",
                      flush=True)
        med = {v: statistics.median(t) for v, t in times.items()}
        print("\nmedian seconds to the first step (launch -> step 1 done):")
        for v in variants:
            print(f"  {v:5s} {med[v]:6.2f}   (runs: {', '.join(f'{t:.2f}' for t in times[v])})")
        if "ray" in med and "local" in med:
            print(f"  ray / local = {med['ray'] / med['local']:.2f} (target <= 2)")
        if "trl" in med and "local" in med:
            print(f"  local / TRL = {med['local'] / med['trl']:.2f} (target < 1)")
        if exports:
            print(f"  polyrl export (median of {len(exports)}): {statistics.median(exports):.2f}s in one process, "
                  f"{statistics.median(ray_exports):.2f}s with the run's Ray workers")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
