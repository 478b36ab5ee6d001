"""GRPO training throughput: polyrl vs TRL's GRPOTrainer at equal cores, same models, prompts and batch.

Both sides train the same random-init model (``tiny`` and ``small`` from
``polyrl.models.tiny``) with the same tokenizer, prompts, samples per prompt,
completion length, batch, learning rate and precision, on this machine's
CPU, for ``--steps`` GRPO steps after ``--warmup`` steps that are not timed.
Precision (``--precision``, each in turn): ``float32``, or ``bfloat16``, bf16 compute over
float32 weights on both sides (TRL's ``bf16=True``; polyrl's ``actor.fsdp.param_dtype=bfloat16``
and ``rollout.dtype=bfloat16``, verl's defaults); with both, the last lines put each side's
fastest precision against the other's.
Workloads: ``short`` (synthetic arithmetic, ~9-token prompts) and ``long`` (the same
questions after a fixed few-shot preamble, 200-token prompts, as in GSM8K-style prompting), and ``gsm8k``: real
GSM8K test problems through the model's chat template (a system line asks for the answer after ``####``),
completions that end at the model's end of turn, rewarded by the last number (both sides).
Sizes: ``polyrl.models.tiny``'s, ``qwen2.5-0.5b`` (below), and ``smollm2-135m``: the real pretrained
SmolLM2-135M-Instruct (``make real-model``; its 49,152-token BPE and ChatML template), for the ``gsm8k`` workload.
``--repeats R`` runs each setting R times, alternating which side goes first, and reports the median run of each
side; every run starts from an empty output directory. Each side's peak memory is the largest resident set of
its process tree, sampled every 0.2 s.

Equal cores: for each ``--workers`` count W, polyrl runs W data-parallel workers (1: the ``local``
executor, one process) and TRL runs under ``torchrun --nproc_per_node W`` (gloo DDP, each process one
core and 1/W of the batch); with ``--layouts processes threads`` each side also runs as one process of
W torch threads (polyrl's local executor, TRL without torchrun). Only these equal-core ratios are
reported, per phase (generation, and the rest of the step: log-probs, loss, backward, optimizer, weight
sync), with each phase's distance from this machine's limit: the update against measured matmul FLOP/s
(6 x parameters x tokens), decoding against
measured memory bandwidth and skinny-matmul FLOP/s (every decode step reads the weights once and does
2 x parameters x batch FLOPs). Per side it then prints decoding's fraction of its roofline, the update's
fraction of the matmul limit (polyrl: the ``update_actor`` phase; TRL: its step outside ``generate``) and
weight sync's share of a step; the final JSON line has them under each row's ``fractions``
(``decode_of_roofline``, ``update_of_matmul``, ``weight_sync_of_step``). See docs/benchmarks.md for the method.

On a GPU (``--device cuda``; benchmarks/gpu/run_gpu.sh runs it there): one process a side, bf16 on both, the
``qwen2.5-0.5b`` size (Qwen2.5-0.5B's shapes and 151936-token vocabulary, random weights: throughput only), a
batch set by ``--prompts --samples --completion``; the limits are the GPU's bf16 matmul FLOP/s (8192^3) and its
memory bandwidth, so the fractions read as the update's MFU and decoding's fraction of the HBM roofline.

TRL is the baseline, not a polyrl dependency: install it beside the venv without touching it, e.g.
``pip install --no-deps --target /tmp/trl trl`` and ``PYTHONPATH=/tmp/trl``.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_grpo_vs_trl.py [--sizes tiny small] \\
        [--workloads short long] [--warmup 2] [--steps 5] [--workers 2 1] [--precision float32 bfloat16] \\
        [--layouts processes threads] [--prompts 8 --samples 4 --completion 32] [--device cpu]
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
import threading
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

#: The batch (``--prompts``, ``--samples``, ``--completion``): prompts per step, samples per prompt, tokens per
#: completion; set once in :func:`main` (and in TRL's child processes from their arguments).
PROMPTS_PER_STEP = 8
N = 4
COMPLETION = 32
#: Model shapes beyond ``polyrl.models.tiny``'s sizes: ``make_tiny_model`` overrides and the tokenizer's vocabulary.
SIZES = {"qwen2.5-0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                              num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True,
                              rope_theta=1000000.0, max_position_embeddings=32768)}
#: polyrl's overrides per ``--precision`` (TRL's side: ``bf16=True``).
PRECISION_ARGS = {"float32": [], "bfloat16": ["actor.fsdp.param_dtype=bfloat16", "rollout.dtype=bfloat16"]}
#: The ``long`` workload's system message: worked examples ahead of every question.
PREAMBLE = ("Answer with the number only. Examples: 12+7=19. 40-15=25. 8+8=16. 91-19=72. 33+44=77. "
            "60-7=53. 25+25=50. 99-98=1. 14+68=82. 70-35=35. 5+94=99. 81-27=54. 47+12=59. 66-60=6. "
            "Now the question:")


#: The ``gsm8k`` workload's system message (both sides).
GSM8K_SYSTEM = "Solve the math problem step by step, briefly. End with the final answer as '#### <number>'."
#: GSM8K's test split; a benchmark, not a run: it may read the project's shared data (``--gsm8k-file``).
GSM8K_FILE = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k" / "test.jsonl"
#: Sizes that are real pretrained models rather than shapes built in code.
REAL_SIZES = ("smollm2-135m",)


def make_rows(workload: str, gsm8k_file: Path = GSM8K_FILE) -> list[dict]:
    """The workload's rows (polyrl's chat-format dataset rows: ``prompt`` messages, ``reward_model.ground_truth``)."""
    from polyrl.data.synthetic import make_arithmetic_rows

    if workload == "gsm8k":
        rows = []
        for line in gsm8k_file.read_text().splitlines():
            item = json.loads(line)
            answer = item["answer"].split("####")[-1].strip().replace(",", "")
            rows.append({"data_source": "openai/gsm8k", "reward_model": {"ground_truth": answer},
                         "prompt": [{"role": "system", "content": GSM8K_SYSTEM},
                                    {"role": "user", "content": item["question"]}]})
        return rows
    rows = make_arithmetic_rows(512, seed=0, max_operand=99, ops="+-")
    if workload == "long":
        rows = [dict(r, prompt=[{"role": "system", "content": PREAMBLE}, *r["prompt"]]) for r in rows]
    return rows


def run_trl(model_dir: Path, data: Path, warmup: int, steps: int, out: Path, procs: int,
            precision: str = "float32", threads: int = 1, device: str = "cpu", workload: str = "short") -> dict:
    """TRL's GRPOTrainer under ``torchrun --nproc_per_node procs`` (gloo DDP on CPU), ``threads`` torch threads
    each; rank 0's timings."""
    out.mkdir(parents=True, exist_ok=True)
    result = out / "trl.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={procs}", __file__,
           "--trl-child", json.dumps([str(model_dir), str(data), warmup, steps, str(out), str(result), precision,
                                        device, [PROMPTS_PER_STEP, N, COMPLETION], workload])]
    peak = run_measured(cmd, env=dict(os.environ, OMP_NUM_THREADS=str(threads)))
    return dict(json.loads(result.read_text()), peak_rss=peak)


def trl_child(model_dir: Path, data: Path, warmup: int, steps: int, out: Path, result: Path,
              precision: str = "float32", device: str = "cpu", workload: str = "short") -> None:
    """One torchrun process of TRL's GRPOTrainer (use_vllm=False): each process generates and trains
    ``1/world`` of the batch; rank 0 writes completion tokens, step seconds and generation seconds.
    ``precision="bfloat16"``: TRL's ``bf16=True`` (accelerate's autocast over float32 weights)."""
    import torch
    import transformers.generation.utils as generation
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from polyrl.rewards.functions import gsm8k_extract

    rows = [json.loads(line) for line in data.read_text().splitlines()]
    ds = Dataset.from_list([{"prompt": r["prompt"], "answer": str(r["reward_model"]["ground_truth"])} for r in rows])

    def reward(completions, answer, **kw):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        if workload == "gsm8k":  # the last number, the rule of polyrl's side (gsm8k_extract's flexible mode)
            return [1.0 if gsm8k_extract(t, "flexible") == a else 0.0 for t, a in zip(texts, answer)]
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

    world = int(os.environ.get("WORLD_SIZE", "1"))
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    cfg = GRPOConfig(
        output_dir=str(out), per_device_train_batch_size=PROMPTS_PER_STEP * N // world, num_generations=N,
        ddp_backend=("gloo" if device == "cpu" else "nccl") if world > 1 else None,
        ddp_find_unused_parameters=False,  # every parameter is used: no extra autograd traversal per step
        gradient_accumulation_steps=1, max_completion_length=COMPLETION, max_steps=warmup + steps,
        learning_rate=1e-4, logging_steps=1, report_to="none", use_cpu=device == "cpu", bf16=precision == "bfloat16",
        fp16=False,
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
    if int(os.environ.get("RANK", "0")) == 0:  # completions/mean_length is already averaged over processes
        result.write_text(json.dumps({
            "tokens": sum(length * PROMPTS_PER_STEP * N for length in lengths), "seconds": seconds,
            "mean_length": sum(lengths) / max(1, len(lengths)),
            "phases": {"gen": sum(gens) / len(times), "rest": (seconds - sum(gens)) / len(times)}}))


def run_polyrl(model_dir: Path, data: Path, warmup: int, steps: int, out: Path, workers: int,
               extra: list[str], precision: str = "float32", threads: int = 1, device: str = "cpu",
               workload: str = "short") -> dict:
    """`polyrl train` (FSDP engine, hf rollout) with the same batch, ``threads`` torch threads per worker; step
    time from its metrics.
    ``precision="bfloat16"``: verl's mixed precision (bf16 compute over float32 weights,
    ``actor.fsdp.param_dtype``) and a bf16 rollout copy (``rollout.dtype``)."""
    manifest = out / "polyrl.toml"
    out.mkdir(parents=True, exist_ok=True)
    manifest.write_text('[plugins]\nrequire = ["polyrl-engine-fsdp>=0.1,<0.2"]\n')
    if workload == "gsm8k":  # the last number, as TRL's side (polyrl's gsm8k default is verl's strict "#### N")
        (out / "reward.py").write_text(
            "from polyrl.rewards.functions import gsm8k_extract\n\n\n"
            "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
            "    return 1.0 if gsm8k_extract(solution_str, 'flexible') == str(ground_truth) else 0.0\n")
        extra = [f"reward.function={out / 'reward.py'}:compute_score", *extra]
    executor = ["trainer.executor=local"] if workers == 1 else ["trainer.executor=ray", f"trainer.n_workers={workers}"]
    overrides = [
        f"model.path={model_dir}", f"data.train_files=[{data}]", f"data.train_batch_size={PROMPTS_PER_STEP}",
        "data.max_prompt_length=256", f"data.max_response_length={COMPLETION}", "actor.engine=fsdp",
        f"actor.ppo_mini_batch_size={PROMPTS_PER_STEP}", f"actor.micro_batch_size={PROMPTS_PER_STEP * N}",
        # the model fits on every rank: a full copy each (no parameter all-gathers), as for any small model
        "actor.fsdp.fsdp_size=1",
        "actor.optim.lr=1e-4", f"rollout.n={N}", f"rollout.max_batch_size={PROMPTS_PER_STEP * N}",
        f"trainer.total_steps={warmup + steps}", "trainer.logger=[jsonl]", "trainer.progress_bar=false",
        f"trainer.run_dir={out / 'run'}", f"trainer.device={device}", *executor, *PRECISION_ARGS[precision], *extra,
    ]
    peak = run_measured([sys.executable, "-m", "polyrl", "train", "--manifest", str(manifest), *overrides],
                        env=dict(os.environ, OMP_NUM_THREADS=str(threads)))
    rows = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "timing/step" in r][warmup:]
    tokens = sum(r["response_length/mean"] * PROMPTS_PER_STEP * N for r in rows)
    keys = sorted({k for r in rows for k in r if k.startswith("timing/") and k != "timing/step"})
    phases = {k[len("timing/"):]: sum(r.get(k, 0.0) for r in rows) / len(rows) for k in keys}
    return {"tokens": tokens, "seconds": sum(r["timing/step"] for r in rows), "peak_rss": peak,
            "mean_length": sum(r["response_length/mean"] for r in rows) / max(1, len(rows)),
            "phases": {k: v for k, v in phases.items() if v >= 0.005}}


def run_measured(cmd: list[str], env: dict[str, str]) -> int:
    """Run ``cmd`` (output to /dev/null, an error if it fails) and return the peak resident set of its whole process
    tree in bytes, sampled every 0.2 s (Ray's workers and raylets included: what the side costs the machine)."""
    import psutil

    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, env=env)
    peak, done = 0, threading.Event()

    def sample() -> None:
        nonlocal peak
        root = psutil.Process(proc.pid)
        while not done.wait(0.2):
            try:
                tree = [root, *root.children(recursive=True)]
            except psutil.Error:
                return
            rss = 0
            for p in tree:
                try:
                    rss += p.memory_info().rss
                except psutil.Error:
                    pass
            peak = max(peak, rss)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        code = proc.wait()
    finally:
        done.set()
        sampler.join()
    if code:
        raise subprocess.CalledProcessError(code, cmd)
    return peak


def limit_shapes(device: str) -> dict:
    """What :func:`machine_limits` measures on ``device``: the wide and the skinny matmul ``(m, k, n, reps)`` and the
    float32 elements of the copy (CPU: one core, 256 MiB, far beyond the caches; GPU: 8192^3, a decode step's
    rows x 1024 x 4096, 1 GiB)."""
    if device == "cpu":
        return {"wide": (1024, 1024, 1024, 10), "skinny": (16, 512, 1536, 2000), "copy": (64 << 20, 5)}
    return {"wide": (8192, 8192, 8192, 10), "skinny": (PROMPTS_PER_STEP * N, 1024, 4096, 200), "copy": (1 << 28, 20)}


def machine_limits(precision: str = "float32", device: str = "cpu") -> dict[str, float]:
    """One core's (or the GPU's) measured limits: wide and skinny matmul FLOP/s in ``precision`` and memory
    bandwidth (bytes/s, read + write), at :func:`limit_shapes`."""
    import torch

    if device == "cpu":
        torch.set_num_threads(1)
    dtype = getattr(torch, precision)
    sync = torch.cuda.synchronize if device != "cpu" else (lambda: None)

    def timed(fn, reps: int) -> float:
        fn()
        sync()
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        sync()
        return (time.perf_counter() - start) / reps

    def flops(m: int, k: int, n: int, reps: int) -> float:
        a, b = torch.randn(m, k, dtype=dtype, device=device), torch.randn(k, n, dtype=dtype, device=device)
        return 2 * m * k * n / timed(lambda: a @ b, reps)

    def bandwidth(numel: int, reps: int) -> float:
        x = torch.empty(numel, device=device)
        y = torch.empty_like(x)
        return 2 * numel * 4 / timed(lambda: y.copy_(x), reps)

    shapes = limit_shapes(device)
    out = {"matmul_flops": flops(*shapes["wide"]), "skinny_flops": flops(*shapes["skinny"]),
           "bandwidth": bandwidth(*shapes["copy"])}
    if device != "cpu":
        torch.cuda.empty_cache()
    return out


def phase_floors(params: int, prompt_tokens: int, completion: float, cores: int, limits: dict,
                 weight_bytes: int = 4) -> dict[str, float]:
    """The least seconds per step this machine needs, with ``cores`` cores, for each phase of the workload.

    update: 6 x params x tokens (forward + backward) of every sample, at wide-matmul FLOP/s (the old-log-prob
    pass and the weight sync ride on top); decoding: each of ``completion`` decode steps reads the weights
    once per process and does 2 x params FLOPs per sequence at skinny-matmul FLOP/s, plus the prefill of the
    prompts at wide-matmul FLOP/s.
    """
    rows = PROMPTS_PER_STEP * N
    update = 6 * params * rows * (prompt_tokens + completion) / (cores * limits["matmul_flops"])
    per_step = max(params * weight_bytes / limits["bandwidth"], 2 * params * rows / cores / limits["skinny_flops"])
    prefill = 2 * params * rows * prompt_tokens / (cores * limits["matmul_flops"])
    return {"gen": completion * per_step + prefill, "rest": update}


def _split(result: dict) -> dict[str, float]:
    """Seconds per step in two phases both sides report: generation, and the rest of the step."""
    if "rest" in result["phases"]:
        return {"gen": result["phases"]["gen"], "rest": result["phases"]["rest"]}
    step = result["seconds"] / result["steps"]
    gen = result["phases"].get("gen", 0.0)
    return {"gen": gen, "rest": step - gen}


def fractions(result: dict, split: dict[str, float], floor: dict[str, float], update: dict[str, float]) -> dict[str, float]:
    """One side's distance from the limits: decoding's fraction of its roofline (the ``gen`` floor over the
    generation seconds), the update's fraction of the matmul limit (6 x parameters x tokens at wide-matmul FLOP/s
    over the update's seconds: polyrl's ``update_actor`` phase, TRL's step outside ``generate``) and weight sync's
    share of a step (0 for TRL, which trains the model it samples from)."""
    phases = result["phases"]
    step = result["seconds"] / result["steps"]
    update_s = phases.get("update_actor", split["rest"])
    return {"decode_of_roofline": floor["gen"] / max(split["gen"], 1e-9),
            "update_of_matmul": update["update"] / max(update_s, 1e-9),
            "weight_sync_of_step": phases.get("weight_sync", 0.0) / max(step, 1e-9)}


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--trl-child":
        model_dir, data, warmup, steps, out, result, precision, device, shape, workload = json.loads(sys.argv[2])
        _set_batch(*shape)
        trl_child(Path(model_dir), Path(data), warmup, steps, Path(out), Path(result), precision, device, workload)
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["tiny", "small"])
    parser.add_argument("--workloads", nargs="+", default=["short", "long"], choices=["short", "long", "gsm8k"])
    parser.add_argument("--gsm8k-file", type=Path, default=GSM8K_FILE, help="GSM8K's test.jsonl (the gsm8k workload)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs of each setting, alternating which side goes first; each side's median run counts")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first, on both sides")
    parser.add_argument("--steps", type=int, default=5, help="timed steps")
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 1],
                        help="cores per side: polyrl workers (1 = local executor) and TRL torchrun processes")
    parser.add_argument("--layouts", nargs="+", default=["processes"], choices=["processes", "threads"],
                        help="how a side uses C cores, each in turn: C processes of one thread (polyrl: C workers, "
                             "TRL: torchrun) or one process of C threads (polyrl: the local executor)")
    parser.add_argument("--trl-layouts", nargs="+", choices=["processes", "threads"], default=None,
                        help="the layouts TRL runs in (default: all of --layouts); polyrl runs in every one, and the "
                             "best-of-each line compares each side's fastest setting (e.g. TRL's torchrun side does "
                             "not fit a 24 GiB machine with the real model: --trl-layouts threads)")
    parser.add_argument("--polyrl-args", nargs="*", default=[], help="extra `polyrl train` overrides (key=value)")
    parser.add_argument("--precision", nargs="+", default=["float32"], choices=sorted(PRECISION_ARGS),
                        help="both sides, each in turn: float32, or bf16 compute over float32 weights (TRL's "
                             "bf16=True; polyrl's actor.fsdp.param_dtype=bfloat16 with a bf16 rollout, verl's "
                             "defaults); with several, also each side's best against the other's best")
    parser.add_argument("--keep-slow-precision", action="store_true",
                        help="run a 16-bit --precision even where this CPU multiplies it over 2x slower than float32 "
                             "(no AVX512-BF16 or AMX); by default it is skipped with a line saying so")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                        help="cuda: one process a side on the GPU (--workers 1, the processes layout)")
    parser.add_argument("--prompts", type=int, default=PROMPTS_PER_STEP, help="prompts per step")
    parser.add_argument("--samples", type=int, default=N, help="samples per prompt (GRPO's group)")
    parser.add_argument("--completion", type=int, default=COMPLETION, help="tokens per completion at most")
    args = parser.parse_args()
    trl_layouts = set(args.trl_layouts or args.layouts)
    _set_batch(args.prompts, args.samples, args.completion)
    if args.device != "cpu" and (args.workers != [1] or args.layouts != ["processes"]):
        parser.error("--device cuda runs one process a side: --workers 1 --layouts processes")
    from safetensors import safe_open


    if args.device == "cpu" and not args.keep_slow_precision:
        import torch

        from polyrl.platforms.precision import SLOWDOWN_LIMIT, cpu_matmul_slowdown

        for name in [p for p in args.precision if p != "float32"]:
            ratio = cpu_matmul_slowdown(getattr(torch, name))
            if ratio > SLOWDOWN_LIMIT:  # no bf16 kernels (AVX2 only): hours for a measurement nobody would run
                print(f"skipping {name}: a {name} product is {ratio:.0f}x slower than float32 on this CPU "
                      f"(docs/platforms.md#16-bit-dtypes-on-a-cpu; --keep-slow-precision runs it)", flush=True)
                args.precision.remove(name)
        if not args.precision:
            parser.error("no --precision left to run on this CPU (float32 is always fast here)")
    all_limits = {p: machine_limits(p, args.device) for p in args.precision}
    for precision, limits in all_limits.items():
        where = "one core" if args.device == "cpu" else args.device
        wide, skinny = (f"{m}^3" if m == k == n else f"{m}x{k}x{n}"
                        for m, k, n, _ in (limit_shapes(args.device)[key] for key in ("wide", "skinny")))
        print(f"{precision}, {where}: matmul {limits['matmul_flops'] / 1e9:.1f} GFLOP/s ({wide}), skinny "
              f"{limits['skinny_flops'] / 1e9:.1f} GFLOP/s ({skinny}), memory {limits['bandwidth'] / 1e9:.1f} GB/s",
              flush=True)
    root = Path(tempfile.mkdtemp(prefix="bench-trl-"))
    report = []
    for workload in args.workloads:
        rows = make_rows(workload, args.gsm8k_file)
        for size in args.sizes:
            model_dir = real_model(size) if size in REAL_SIZES else root / size
            if not model_dir.exists():
                build_model(model_dir, size)
            data, prompt_tokens = prompt_file(rows, model_dir, root / f"{workload}-{size}.jsonl")
            with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
                params = sum(_numel(f.get_slice(k).get_shape()) for k in f.keys())
            tag = f"{workload}-{size}"
            settings = [(c, lay, p) for c in args.workers for lay in args.layouts for p in args.precision
                        if c > 1 or lay == args.layouts[0]]  # one core: the layouts are the same
            for cores, layout, precision in settings:
                limits, run = all_limits[precision], f"{tag}-{cores}-{layout}-{precision}"
                procs, threads = (cores, 1) if layout == "processes" else (1, cores)
                trls, ourss = [], []
                for repeat in range(args.repeats):  # alternate which side goes first; a fresh output dir each run
                    sides = [("trl", trls), ("polyrl", ourss)][::1 if repeat % 2 == 0 else -1]
                    sides = [x for x in sides if x[0] == "polyrl" or layout in trl_layouts or cores == 1]
                    for side, results in sides:
                        out = root / f"{side}-{run}-r{repeat}"
                        if side == "trl":
                            results.append(run_trl(model_dir, data, args.warmup, args.steps, out, procs, precision,
                                                   threads, args.device, workload))
                        else:
                            results.append(run_polyrl(model_dir, data, args.warmup, args.steps, out, procs,
                                                      args.polyrl_args, precision, threads, args.device, workload))
                        shutil.rmtree(out, ignore_errors=True)
                ours = median_run(ourss)
                trl = median_run(trls) if trls else None  # None: TRL not run in this layout (--trl-layouts)
                ours["steps"] = args.steps
                if trl is not None:
                    trl["steps"] = args.steps
                completion = (trl or ours).get("mean_length", COMPLETION)
                floor = phase_floors(params, prompt_tokens, completion, cores, limits,
                                     2 if precision == "bfloat16" else 4)
                p_rate, pp = ours["tokens"] / ours["seconds"], _split(ours)
                t_rate, tp = (trl["tokens"] / trl["seconds"], _split(trl)) if trl else (None, None)
                # the update alone: 6 x params x tokens (the ``rest`` floor; the old-log-prob pass is not in it)
                update_floor = {"update": floor["rest"]}
                frac = {"polyrl": fractions(ours, pp, floor, update_floor)}
                if trl is not None:
                    frac["trl"] = fractions(trl, tp, floor, update_floor)
                row = {"workload": workload, "size": size, "params": params, "cores": cores,
                       "layout": layout if cores > 1 else "-", "precision": precision, "trl_tok_s": t_rate,
                       "polyrl_tok_s": p_rate, "ratio": p_rate / t_rate if t_rate else None, "trl_s": tp,
                       "polyrl_s": pp, "floor_s": floor, "polyrl_phases": ours["phases"], "fractions": frac,
                       "runs": args.repeats,
                       "all_tok_s": {"trl": [r["tokens"] / r["seconds"] for r in trls],
                                     "polyrl": [r["tokens"] / r["seconds"] for r in ourss]},
                       "peak_rss_gb": {"trl": trl["peak_rss"] / 1e9 if trl else None,
                                       "polyrl": ours["peak_rss"] / 1e9},
                       "mean_length": {"trl": trl.get("mean_length") if trl else None,
                                       "polyrl": ours.get("mean_length")},
                       "prompt_tokens": prompt_tokens}
                report.append(row)
                head = f"{workload:5} {size:5} {params / 1e6:5.1f}M {cores} core(s) {row['layout']} {precision}:"
                if trl is None:
                    print(f"{head} polyrl {p_rate:8.1f} tok/s (median of {args.repeats}; TRL not run in this layout: "
                          f"--trl-layouts); peak memory polyrl {ours['peak_rss'] / 1e9:.2f} GB; mean completion "
                          f"{ours.get('mean_length', 0):.0f} tokens", flush=True)
                else:
                    print(f"{head} TRL {t_rate:8.1f} tok/s, polyrl "
                          f"{p_rate:8.1f} tok/s, ratio {p_rate / t_rate:.2f}x (median of {args.repeats}); peak memory "
                          f"TRL {trl['peak_rss'] / 1e9:.2f} GB, polyrl {ours['peak_rss'] / 1e9:.2f} GB; mean "
                          f"completion TRL {trl.get('mean_length', 0):.0f}, polyrl {ours.get('mean_length', 0):.0f} "
                          "tokens", flush=True)
                for phase in ("gen", "rest"):
                    tail = (f"TRL at {floor[phase] / max(tp[phase], 1e-9):.0%}, " if tp else "")
                    print(f"    {phase:4} s/step: TRL {tp[phase] if tp else float('nan'):.3f} polyrl {pp[phase]:.3f}"
                          + (f" (ratio {tp[phase] / max(pp[phase], 1e-9):.2f}x)" if tp else "")
                          + f"; machine floor {floor[phase]:.3f} -> {tail}polyrl at "
                          f"{floor[phase] / max(pp[phase], 1e-9):.0%} of the limit", flush=True)
                for side, f in frac.items():
                    print(f"    {side:6} decoding at {f['decode_of_roofline']:.0%} of its roofline, update at "
                          f"{f['update_of_matmul']:.0%} of the matmul limit, weight sync {f['weight_sync_of_step']:.1%} "
                          "of a step", flush=True)
    best = best_of_each(report) if len(args.precision) > 1 or len(args.layouts) > 1 else []
    for b in best:
        print(f"best of each: {b['workload']:5} {b['size']:5} {b['cores']} core(s): TRL {b['trl_tok_s']:.1f} tok/s "
              f"({b['trl_setting']}), polyrl {b['polyrl_tok_s']:.1f} tok/s ({b['polyrl_setting']}), ratio "
              f"{b['ratio']:.2f}x", flush=True)
    print(json.dumps({"device": args.device, "batch": [PROMPTS_PER_STEP, N, COMPLETION], "limits": all_limits,
                      "rows": report, "best": best}), flush=True)
    shutil.rmtree(root, ignore_errors=True)  # the runs' checkpoints: about 1 GB per configuration


def median_run(results: list[dict]) -> dict:
    """The run of median completion tokens/s (the lower middle one of an even count)."""
    ranked = sorted(results, key=lambda r: r["tokens"] / r["seconds"])
    return ranked[(len(ranked) - 1) // 2]


def real_model(size: str) -> Path:
    """The HF folder of a real pretrained model of :data:`REAL_SIZES` (fetched and converted once by
    ``make real-model``)."""
    from polyrl.models import real

    return Path(real.ensure_real_model())


def prompt_file(rows: list[dict], model_dir: Path, path: Path) -> tuple[Path, int]:
    """Write the rows whose prompt fits ``data.max_prompt_length`` (256) with ``model_dir``'s tokenizer (through its
    chat template where it has one, as both sides render them), and return the file and the mean prompt tokens."""
    from transformers import AutoTokenizer

    from polyrl.data.synthetic import write_jsonl

    tok = AutoTokenizer.from_pretrained(model_dir)
    kept, lengths = [], []
    for row in rows:
        if tok.chat_template:
            ids = tok.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True)
            n = len(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        else:
            n = len(tok("".join(m["content"] for m in row["prompt"]))["input_ids"])
        if n <= 256:
            kept.append(row)
            lengths.append(n)
        if len(kept) == 512:
            break
    return write_jsonl(kept, path), round(statistics.mean(lengths))


def _set_batch(prompts: int, samples: int, completion: int) -> None:
    global PROMPTS_PER_STEP, N, COMPLETION
    PROMPTS_PER_STEP, N, COMPLETION = prompts, samples, completion


def build_model(path: Path, size: str) -> Path:
    """A random-init model of ``size``: one of ``polyrl.models.tiny``'s, or of :data:`SIZES` (the character tokenizer
    padded to the size's vocabulary)."""
    from polyrl.models.tiny import build_char_tokenizer, make_tiny_model

    if size not in SIZES:
        return make_tiny_model(path, size=size, seed=0)
    shape = dict(SIZES[size])
    tokenizer = build_char_tokenizer(vocab_size=shape.pop("vocab_size"))
    return make_tiny_model(path, size="small", tokenizer=tokenizer, seed=0, **shape)


def best_of_each(rows: list[dict]) -> list[dict]:
    """Per workload, size and core count: each side at its fastest layout and precision, and the ratio."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["workload"], r["size"], r["cores"]), []).append(r)
    out = []
    for (workload, size, cores), rs in groups.items():
        ran = [r for r in rs if r["trl_tok_s"] is not None]  # settings where TRL ran (--trl-layouts)
        if not ran:
            continue
        t, p = max(ran, key=lambda r: r["trl_tok_s"]), max(rs, key=lambda r: r["polyrl_tok_s"])
        out.append({"workload": workload, "size": size, "cores": cores, "trl_tok_s": t["trl_tok_s"],
                    "trl_setting": f"{t['layout']} {t['precision']}", "polyrl_tok_s": p["polyrl_tok_s"],
                    "polyrl_setting": f"{p['layout']} {p['precision']}", "ratio": p["polyrl_tok_s"] / t["trl_tok_s"]})
    return out


def _numel(shape: list[int]) -> int:
    total = 1
    for d in shape:
        total *= d
    return total


if __name__ == "__main__":
    main()
