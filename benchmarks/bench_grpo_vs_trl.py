"""GRPO training throughput: polyrl vs TRL's GRPOTrainer, same models, prompts and batch, one run.

Both sides train the same random-init model (``tiny`` and ``small`` from
``polyrl.models.tiny``) with the same tokenizer, prompts (synthetic arithmetic),
samples per prompt, completion length and batch, on this machine's CPU, for
``--steps`` GRPO steps after one warm-up step. Reported: completion tokens per
second of step time for each, and the ratio polyrl / TRL. See docs/benchmarks.md.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_grpo_vs_trl.py [--sizes tiny small] [--steps 3]
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


def run_trl(model_dir: Path, data: Path, steps: int, out: Path) -> dict:
    """TRL GRPOTrainer (use_vllm=False) on CPU; returns completion tokens and step seconds."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    rows = [json.loads(line) for line in data.read_text().splitlines()]
    ds = Dataset.from_list([{"prompt": r["prompt"], "answer": str(r["reward_model"]["ground_truth"])} for r in rows])

    def reward(completions, answer, **kw):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [1.0 if t.strip().startswith(a) else 0.0 for t, a in zip(texts, answer)]

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
        gradient_accumulation_steps=1, max_completion_length=COMPLETION, max_steps=steps + 1,
        learning_rate=1e-4, logging_steps=1, report_to="none", use_cpu=True, bf16=False, fp16=False,
        save_strategy="no", temperature=1.0, beta=0.0, dataloader_num_workers=0, use_vllm=False,
    )
    timer = Timer()
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=cfg, train_dataset=ds, processing_class=tok,
                          callbacks=[timer])
    trainer.train()
    times, lengths = timer.times[1:], timer.lengths[1:]
    tokens = sum(length * PROMPTS_PER_STEP * N for length in lengths)
    return {"tokens": tokens, "seconds": sum(times), "steps": len(times)}


def run_polyrl(model_dir: Path, data: Path, steps: int, out: Path, workers: int, extra: list[str]) -> dict:
    """`polyrl train` (FSDP engine, hf rollout) with the same batch; step time from its metrics."""
    manifest = out / "polyrl.toml"
    out.mkdir(parents=True, exist_ok=True)
    manifest.write_text('[plugins]\nrequire = ["polyrl-engine-fsdp>=0.1,<0.2"]\n')
    executor = ["trainer.executor=local"] if workers == 1 else ["trainer.executor=ray", f"trainer.n_workers={workers}"]
    overrides = [
        f"model.path={model_dir}", f"data.train_files=[{data}]", f"data.train_batch_size={PROMPTS_PER_STEP}",
        "data.max_prompt_length=64", f"data.max_response_length={COMPLETION}", "actor.engine=fsdp",
        f"actor.ppo_mini_batch_size={PROMPTS_PER_STEP}", f"actor.micro_batch_size={PROMPTS_PER_STEP * N}",
        "actor.optim.lr=1e-4", f"rollout.n={N}", f"rollout.max_batch_size={PROMPTS_PER_STEP * N}",
        f"trainer.total_steps={steps + 1}", "trainer.logger=[jsonl]", "trainer.progress_bar=false",
        f"trainer.run_dir={out / 'run'}", *executor, *extra,
    ]
    subprocess.run([sys.executable, "-m", "polyrl", "train", "--manifest", str(manifest), *overrides], check=True,
                   stdout=subprocess.DEVNULL)
    rows = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "timing/step" in r][1:]
    tokens = sum(r["response_length/mean"] * PROMPTS_PER_STEP * N for r in rows)
    phases = sorted({k for r in rows for k in r if k.startswith("timing/") and k != "timing/step"})
    print("  polyrl seconds per step: " + ", ".join(
        f"{k[7:]} {sum(r.get(k, 0.0) for r in rows) / len(rows):.2f}" for k in phases), flush=True)
    return {"tokens": tokens, "seconds": sum(r["timing/step"] for r in rows), "steps": len(rows)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["tiny", "small"])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2, help="polyrl data-parallel workers (1 = local executor)")
    parser.add_argument("--polyrl-args", nargs="*", default=[], help="extra `polyrl train` overrides (key=value)")
    parser.add_argument("--no-trl", action="store_true", help="run polyrl only (no ratio)")
    args = parser.parse_args()
    from polyrl.data.synthetic import make_arithmetic_rows, write_jsonl
    from polyrl.models.tiny import make_tiny_model

    root = Path(tempfile.mkdtemp(prefix="bench-trl-"))
    data = root / "prompts.jsonl"
    write_jsonl(make_arithmetic_rows(512, seed=0, max_operand=99, ops="+-"), data)
    print(f"{'model':8} {'params':>8} {'TRL tok/s':>10} {'polyrl tok/s':>13} {'ratio':>6}")
    for size in args.sizes:
        model_dir = make_tiny_model(root / size, size=size, seed=0)
        import torch
        from transformers import AutoModelForCausalLM

        params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(model_dir).parameters())
        del torch
        ours = run_polyrl(model_dir, data, args.steps, root / f"polyrl-{size}", args.workers, args.polyrl_args)
        p_rate = ours["tokens"] / ours["seconds"]
        if args.no_trl:
            print(f"{size:8} {params / 1e6:7.1f}M {'-':>10} {p_rate:13.1f} {'-':>6}", flush=True)
            continue
        trl = run_trl(model_dir, data, args.steps, root / f"trl-{size}")
        t_rate = trl["tokens"] / trl["seconds"]
        print(f"{size:8} {params / 1e6:7.1f}M {t_rate:10.1f} {p_rate:13.1f} {p_rate / t_rate:6.2f}", flush=True)


if __name__ == "__main__":
    main()
