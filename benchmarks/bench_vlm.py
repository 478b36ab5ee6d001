"""Vision-language GRPO step time: polyrl vs TRL's GRPOTrainer on the same tiny VLM and data, at equal cores.

Both sides train the same random-init tiny Qwen2-VL (:func:`polyrl.models.tiny_vlm.make_tiny_vlm`) with its
processor, on the same rows of the shapes task (:func:`polyrl.data.synthetic.make_shape_rows`: one image and
one question per prompt), with the same prompts per step, samples per prompt, completion length, learning
rate and precision (float32), on this machine's CPU, for ``--steps`` GRPO steps after ``--warmup`` untimed
ones, in the same run of this script.

Equal cores: for each ``--workers`` count W, polyrl runs W data-parallel workers (1: the ``local`` executor,
one process) and TRL runs under ``torchrun --nproc_per_node W`` (gloo DDP, one core each, 1/W of the batch).
Reported per side: seconds per step, split into generation and the rest (log-probs, loss, backward,
optimizer, weight sync), completion tokens per second, and the ratios. See docs/benchmarks.md.

TRL is the baseline, not a polyrl dependency: install it beside the venv without touching it
(``pip install --no-deps --target /tmp/trl trl``) and put it on ``PYTHONPATH``. TRL gets polyrl's processor
object (:func:`polyrl.data.multimodal.load_processor`): without torchvision transformers cannot build
Qwen2-VL's processor itself.

    OMP_NUM_THREADS=1 PYTHONPATH=/tmp/trl .venv/bin/python benchmarks/bench_vlm.py [--workers 1 2] [--steps 5]
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
COMPLETION = 16


def make_data(root: Path) -> Path:
    from polyrl.data.synthetic import make_shape_rows, write_jsonl

    return write_jsonl(make_shape_rows(256, root / "images", seed=0), root / "shapes.jsonl")


def run_trl(model_dir: Path, data: Path, warmup: int, steps: int, out: Path, procs: int) -> dict:
    """TRL's GRPOTrainer under ``torchrun --nproc_per_node procs``; rank 0's timings."""
    out.mkdir(parents=True, exist_ok=True)
    result = out / "trl.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={procs}", __file__,
           "--trl-child", json.dumps([str(model_dir), str(data), warmup, steps, str(out), str(result)])]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env=dict(os.environ, OMP_NUM_THREADS="1"))
    return json.loads(result.read_text())


def trl_child(model_dir: Path, data: Path, warmup: int, steps: int, out: Path, result: Path) -> None:
    """One torchrun process of TRL's GRPOTrainer (``use_vllm=False``) on the image rows: TRL puts each row's image
    before its question, as polyrl's rows have it (``<image>`` first)."""
    import torch
    import transformers.generation.utils as generation
    from datasets import Dataset
    from PIL import Image
    from transformers import AutoModelForImageTextToText, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from polyrl.data.multimodal import load_processor

    rows = [json.loads(line) for line in data.read_text().splitlines()]
    ds = Dataset.from_list([{
        "prompt": [{"role": "user", "content": r["prompt"][0]["content"].replace("<image>", "")}],
        "image": Image.open(r["images"][0]).convert("RGB"),
        "answer": str(r["reward_model"]["ground_truth"])} for r in rows])

    def reward(completions, answer, **kw):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        texts = [t if isinstance(t, str) else " ".join(p.get("text", "") for p in t) for t in texts]
        return [1.0 if t.strip().lower() == a else 0.0 for t, a in zip(texts, answer)]

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

    world = int(os.environ.get("WORLD_SIZE", "1"))
    processor = load_processor(str(model_dir))
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    cfg = GRPOConfig(
        output_dir=str(out), per_device_train_batch_size=PROMPTS_PER_STEP * N // world, num_generations=N,
        ddp_backend="gloo" if world > 1 else None, gradient_accumulation_steps=1, max_completion_length=COMPLETION,
        max_steps=warmup + steps, learning_rate=1e-4, logging_steps=1, report_to="none", use_cpu=True, bf16=False,
        fp16=False, save_strategy="no", temperature=1.0, beta=0.0, dataloader_num_workers=0, use_vllm=False,
        gradient_checkpointing=False,  # TRL's default is on; off like polyrl's (faster)
    )
    timer = Timer()
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=cfg, train_dataset=ds, processing_class=processor,
                          callbacks=[timer])
    generation.GenerationMixin.generate = timed_generate
    try:
        trainer.train()
    finally:
        generation.GenerationMixin.generate = generate
    times, lengths, gens = timer.times[warmup:], timer.lengths[warmup:], gen_seconds[warmup:]
    seconds = sum(times)
    if int(os.environ.get("RANK", "0")) == 0:
        result.write_text(json.dumps({
            "tokens": sum(length * PROMPTS_PER_STEP * N for length in lengths), "seconds": seconds,
            "steps": len(times), "mean_length": sum(lengths) / max(1, len(lengths)),
            "gen": sum(gens) / max(1, len(times))}))


def run_polyrl(model_dir: Path, data: Path, warmup: int, steps: int, out: Path, workers: int) -> dict:
    """``polyrl train`` (FSDP engine, hf rollout) with the same batch; step time from its metrics."""
    out.mkdir(parents=True, exist_ok=True)
    manifest = out / "polyrl.toml"
    manifest.write_text('[plugins]\nrequire = ["polyrl-engine-fsdp>=0.1,<0.2"]\n')
    executor = ["trainer.executor=local"] if workers == 1 else ["trainer.executor=ray", f"trainer.n_workers={workers}",
                                                                 f"trainer.ray_num_cpus={workers}"]
    overrides = [
        f"model.path={model_dir}", f"data.train_files=[{data}]", f"data.train_batch_size={PROMPTS_PER_STEP}",
        "data.max_prompt_length=64", f"data.max_response_length={COMPLETION}",
        f"actor.ppo_mini_batch_size={PROMPTS_PER_STEP}", f"actor.micro_batch_size={PROMPTS_PER_STEP * N}",
        "actor.fsdp.fsdp_size=1",  # the model fits on every rank: a full copy each, as for any small model
        "actor.optim.lr=1e-4", f"rollout.n={N}", f"rollout.max_batch_size={PROMPTS_PER_STEP * N}",
        f"trainer.total_steps={warmup + steps}", "trainer.logger=[jsonl]", "trainer.progress_bar=false",
        "trainer.save_freq=0", "trainer.val_before_train=false", f"trainer.run_dir={out / 'run'}", *executor,
    ]
    subprocess.run([sys.executable, "-m", "polyrl", "train", "--manifest", str(manifest), *overrides], check=True,
                   stdout=subprocess.DEVNULL)
    rows = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "timing/step" in r][warmup:]
    return {"tokens": sum(r["response_length/mean"] * PROMPTS_PER_STEP * N for r in rows),
            "seconds": sum(r["timing/step"] for r in rows), "steps": len(rows),
            "mean_length": sum(r["response_length/mean"] for r in rows) / len(rows),
            "gen": sum(r["timing/gen"] for r in rows) / len(rows)}


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--trl-child":
        model_dir, data, warmup, steps, out, result = json.loads(sys.argv[2])
        trl_child(Path(model_dir), Path(data), warmup, steps, Path(out), Path(result))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="tiny", choices=["tiny", "mini"])
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first, on both sides")
    parser.add_argument("--steps", type=int, default=5, help="timed steps")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2],
                        help="cores per side: polyrl workers (1 = local executor) and TRL torchrun processes")
    args = parser.parse_args()
    from polyrl.models.tiny_vlm import make_tiny_vlm

    root = Path(tempfile.mkdtemp(prefix="bench-vlm-"))
    model_dir = make_tiny_vlm(root / "model", size=args.size, seed=0, max_pixels=56 * 56)
    data = make_data(root)
    report = []
    for cores in args.workers:
        trl = run_trl(model_dir, data, args.warmup, args.steps, root / f"trl-{cores}", cores)
        ours = run_polyrl(model_dir, data, args.warmup, args.steps, root / f"polyrl-{cores}", cores)
        row = {"size": args.size, "cores": cores}
        for name, side in (("trl", trl), ("polyrl", ours)):
            step = side["seconds"] / side["steps"]
            row[name] = {"step_s": step, "gen_s": side["gen"], "rest_s": step - side["gen"],
                         "tok_s": side["tokens"] / side["seconds"], "mean_length": side["mean_length"]}
        row["step_ratio"] = row["trl"]["step_s"] / row["polyrl"]["step_s"]
        row["tok_s_ratio"] = row["polyrl"]["tok_s"] / row["trl"]["tok_s"]
        report.append(row)
        print(f"{args.size} VLM, {cores} core(s): step TRL {row['trl']['step_s']:.2f} s, polyrl "
              f"{row['polyrl']['step_s']:.2f} s (polyrl {row['step_ratio']:.2f}x faster); tokens/s TRL "
              f"{row['trl']['tok_s']:.0f}, polyrl {row['polyrl']['tok_s']:.0f} ({row['tok_s_ratio']:.2f}x); "
              f"gen/rest s TRL {row['trl']['gen_s']:.2f}/{row['trl']['rest_s']:.2f}, polyrl "
              f"{row['polyrl']['gen_s']:.2f}/{row['polyrl']['rest_s']:.2f}", flush=True)
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
