"""GRPO training throughput: polyrl vs TRL's GRPOTrainer, same models, prompts and batch, one run.

Both sides train the same random-init model (``tiny`` and ``small`` from
``polyrl.models.tiny``) with the same tokenizer, prompts, samples per prompt,
completion length, batch, learning rate and precision (float32), on this machine's
CPU, for ``--steps`` GRPO steps after ``--warmup`` steps that are not timed.
Workloads: ``short`` (synthetic arithmetic, ~9-token prompts) and ``long`` (the same
questions after a fixed few-shot preamble, 200-token prompts, as in GSM8K-style prompting).
polyrl runs with each of ``--workers`` data-parallel workers (2: both cores; 1: one
process on one core, as TRL's trainer). Reported: completion tokens per second of step
time for each, the ratio polyrl / TRL, and where each side's step time goes. See docs/benchmarks.md for the method.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_grpo_vs_trl.py [--sizes tiny small] \\
        [--workloads short long] [--warmup 2] [--steps 5] [--workers 2 1]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

PROMPTS_PER_STEP = 8
N = 4
COMPLETION = 32
#: The ``long`` workload's system message: worked examples ahead of every question.
PREAMBLE = ("Answer with the number only. Examples: 12+7=19. 40-15=25. 8+8=16. 91-19=72. 33+44=77. "
            "60-7=53. 25+25=50. 99-98=1. 14+68=82. 70-35=35. 5+94=99. 81-27=54. 47+12=59. 66-60=6. "
            "Now the question:")


def make_rows(workload: str) -> list[dict]:
    from polyrl.data.synthetic import make_arithmetic_rows

    rows = make_arithmetic_rows(512, seed=0, max_operand=99, ops="+-")
    if workload == "long":
        rows = [dict(r, prompt=[{"role": "system", "content": PREAMBLE}, *r["prompt"]]) for r in rows]
    return rows


def run_trl(model_dir: Path, data: Path, warmup: int, steps: int, out: Path) -> dict:
    """TRL GRPOTrainer (use_vllm=False) on CPU in this process; completion tokens and step seconds."""
    import torch
    import transformers.generation.utils as generation
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    rows = [json.loads(line) for line in data.read_text().splitlines()]
    ds = Dataset.from_list([{"prompt": r["prompt"], "answer": str(r["reward_model"]["ground_truth"])} for r in rows])

    def reward(completions, answer, **kw):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [1.0 if t.strip().startswith(a) else 0.0 for t, a in zip(texts, answer)]

    gen_seconds: list[float] = []
    generate = generation.GenerationMixin.generate

    def timed_generate(self, *args, **kwargs):  # TRL generates through transformers' generate
        start = time.perf_counter()
        try:
            return generate(self, *args, **kwargs)
        finally:
            gen_seconds.append(time.perf_counter() - start)

    class Timer(TrainerCallback):
        def __init__(self):
            self.times, self.lengths = [], []

        def on_step_begin(self, args, state, control, **kw):
            self.t = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            self.times.append(time.perf_counter() - self.t)

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "completions/mean_length" in logs:
                self.lengths.append(logs["completions/mean_length"])

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    cfg = GRPOConfig(
        output_dir=str(out), per_device_train_batch_size=PROMPTS_PER_STEP * N, num_generations=N,
        gradient_accumulation_steps=1, max_completion_length=COMPLETION, max_steps=warmup + steps,
        learning_rate=1e-4, logging_steps=1, report_to="none", use_cpu=True, bf16=False, fp16=False,
        save_strategy="no", temperature=1.0, beta=0.0, dataloader_num_workers=0, use_vllm=False,
        # TRL turns activation checkpointing on by default; off here, like polyrl's default (faster)
        gradient_checkpointing=False,
    )
    timer = Timer()
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=cfg, train_dataset=ds, processing_class=tok,
                          callbacks=[timer])
    generation.GenerationMixin.generate = timed_generate
    try:
        trainer.train()
    finally:
        generation.GenerationMixin.generate = generate
    times, lengths, gens = timer.times[warmup:], timer.lengths[warmup:], gen_seconds[warmup:]
    seconds = sum(times)
    return {"tokens": sum(length * PROMPTS_PER_STEP * N for length in lengths), "seconds": seconds,
            "phases": {"gen": sum(gens) / len(times), "rest": (seconds - sum(gens)) / len(times)}}


def run_polyrl(model_dir: Path, data: Path, warmup: int, steps: int, out: Path, workers: int,
               extra: list[str]) -> dict:
    """`polyrl train` (FSDP engine, hf rollout) with the same batch; step time from its metrics."""
    manifest = out / "polyrl.toml"
    out.mkdir(parents=True, exist_ok=True)
    manifest.write_text('[plugins]\nrequire = ["polyrl-engine-fsdp>=0.1,<0.2"]\n')
    executor = ["trainer.executor=local"] if workers == 1 else ["trainer.executor=ray", f"trainer.n_workers={workers}"]
    overrides = [
        f"model.path={model_dir}", f"data.train_files=[{data}]", f"data.train_batch_size={PROMPTS_PER_STEP}",
        "data.max_prompt_length=256", f"data.max_response_length={COMPLETION}", "actor.engine=fsdp",
        f"actor.ppo_mini_batch_size={PROMPTS_PER_STEP}", f"actor.micro_batch_size={PROMPTS_PER_STEP * N}",
        # the model fits on every rank: a full copy each (no parameter all-gathers), as for any small model
        "actor.fsdp.fsdp_size=1",
        "actor.optim.lr=1e-4", f"rollout.n={N}", f"rollout.max_batch_size={PROMPTS_PER_STEP * N}",
        f"trainer.total_steps={warmup + steps}", "trainer.logger=[jsonl]", "trainer.progress_bar=false",
        f"trainer.run_dir={out / 'run'}", *executor, *extra,
    ]
    subprocess.run([sys.executable, "-m", "polyrl", "train", "--manifest", str(manifest), *overrides], check=True,
                   stdout=subprocess.DEVNULL)
    rows = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "timing/step" in r][warmup:]
    tokens = sum(r["response_length/mean"] * PROMPTS_PER_STEP * N for r in rows)
    keys = sorted({k for r in rows for k in r if k.startswith("timing/") and k != "timing/step"})
    phases = {k[len("timing/"):]: sum(r.get(k, 0.0) for r in rows) / len(rows) for k in keys}
    return {"tokens": tokens, "seconds": sum(r["timing/step"] for r in rows),
            "phases": {k: v for k, v in phases.items() if v >= 0.005}}


def _phases(result: dict) -> str:
    return " ".join(f"{k} {v:.2f}" for k, v in result["phases"].items())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["tiny", "small"])
    parser.add_argument("--workloads", nargs="+", default=["short", "long"], choices=["short", "long"])
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first, on both sides")
    parser.add_argument("--steps", type=int, default=5, help="timed steps")
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 1],
                        help="polyrl data-parallel worker counts to run (1 = local executor, TRL's one process)")
    parser.add_argument("--polyrl-args", nargs="*", default=[], help="extra `polyrl train` overrides (key=value)")
    parser.add_argument("--no-trl", action="store_true", help="run polyrl only (no ratio)")
    args = parser.parse_args()
    from safetensors import safe_open

    from polyrl.data.synthetic import write_jsonl
    from polyrl.models.tiny import make_tiny_model

    root = Path(tempfile.mkdtemp(prefix="bench-trl-"))
    print(f"{'workload':8} {'model':6} {'params':>7} {'TRL tok/s':>10} {'workers':>7} {'polyrl tok/s':>13} "
          f"{'ratio':>6}", flush=True)
    for workload in args.workloads:
        data = write_jsonl(make_rows(workload), root / f"{workload}.jsonl")
        for size in args.sizes:
            model_dir = root / size
            if not model_dir.exists():
                make_tiny_model(model_dir, size=size, seed=0)
            with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
                params = sum(_numel(f.get_slice(k).get_shape()) for k in f.keys())
            tag = f"{workload}-{size}"
            trl = None if args.no_trl else run_trl(model_dir, data, args.warmup, args.steps, root / f"trl-{tag}")
            t_rate = trl["tokens"] / trl["seconds"] if trl else None
            if trl:
                print(f"    TRL s/step: {_phases(trl)}", flush=True)
            for workers in args.workers:
                ours = run_polyrl(model_dir, data, args.warmup, args.steps, root / f"polyrl-{tag}-{workers}", workers,
                                  args.polyrl_args)
                p_rate = ours["tokens"] / ours["seconds"]
                ratio = f"{p_rate / t_rate:6.2f}" if t_rate else f"{'-':>6}"
                trl_col = f"{t_rate:10.1f}" if t_rate else f"{'-':>10}"
                print(f"{workload:8} {size:6} {params / 1e6:6.1f}M {trl_col} {workers:7d} {p_rate:13.1f} {ratio}",
                      flush=True)
                print(f"    polyrl ({workers} worker{'s' if workers > 1 else ''}) s/step: {_phases(ours)}", flush=True)


def _numel(shape: list[int]) -> int:
    total = 1
    for d in shape:
        total *= d
    return total


if __name__ == "__main__":
    main()
