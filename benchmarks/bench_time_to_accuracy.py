"""Wall-clock to a held-out accuracy: polyrl vs TRL's GRPOTrainer on the quickstart task, same SFT start.

The quickstart's task and warm start (``examples/quickstart/``, what ``make quickstart`` runs): the ``mini`` model
(0.86M parameters) built in code, single-digit-operand sums, ``polyrl sft`` with ``examples/quickstart/sft.yaml``
(300 steps). From that one checkpoint, per seed:

- TRL's ``GRPOTrainer`` (``use_vllm=False``) under ``torchrun --nproc_per_node 2`` (gloo DDP, one core each), and
- ``polyrl train`` with ``examples/quickstart/grpo.yaml`` (two workers, ``hf`` rollout; ``--polyrl-mode fully_async``
  runs split placement, one actor and one rollout worker),

with the same data, batch (32 prompts x 8 samples per generation, two optimizer steps of 16 prompts each), 8-token
completions, sampling (temperature 1, no top-k/top-p), AdamW lr 1e-4 constant, no weight decay, gradient clip 1,
no KL term, and the same reward (polyrl's ``arithmetic`` score: the first integer equals the answer). A "TRL step"
is one TRL optimizer step (TRL's ``global_step``); 200 TRL steps are 100 generations, i.e. 100 polyrl steps.

Held-out accuracy is measured the same way on both sides: the 200 held-out prompts, 4 samples each at
temperature 1 (``val/arithmetic/mean@4`` on polyrl's side; the same sampling and score on TRL's, in the child
process), before training and every ``--eval-every`` TRL steps. Wall-clock is training time from the first step,
evaluation excluded (process start-up excluded on both sides). The sides alternate which goes first each seed.

Reported: per seed, both curves as (seconds, accuracy) points; the accuracy TRL reaches after its last step (the
mean of its last two evaluations, to smooth the sampled validation), and the seconds polyrl takes to first reach
it; the ratio of those times (target <= 0.5). Then the same read off both sides' curves averaged over the seeds
(``mean trl`` / ``mean polyrl``), the less noisy number: one seed's final accuracy moves by several points with
the sampling alone. ``--polyrl-steps`` lets polyrl run past TRL's generation count,
so that a side a little short of the target at TRL's last step still gets a time (or none: "never").

TRL is the baseline, not a polyrl dependency: ``pip install --no-deps --target /tmp/trl trl==1.16.0`` and
``PYTHONPATH=/tmp/trl``.

    OMP_NUM_THREADS=1 PYTHONPATH=/tmp/trl .venv/bin/python benchmarks/bench_time_to_accuracy.py \\
        [--seeds 1 2 3] [--trl-steps 200] [--eval-every 20] [--polyrl-mode sync] [--out DIR] \\
        [--cores 2] [--trl-threads 1] [--polyrl-steps 0] [--precision float32|bfloat16] [--polyrl-args KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# polyrl's overrides per ``--precision``, one table for both benchmarks (TRL's side: ``bf16=True``); this script's
# folder is on sys.path when it runs, also as torchrun's child
from bench_grpo_vs_trl import PRECISION_ARGS

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parent.parent
QUICKSTART = ROOT / "examples" / "quickstart"
PROMPTS, N, MINI, COMPLETION, LR = 32, 8, 16, 8, 1e-4
VAL_N = 4


def prepare(root: Path) -> Path:
    """The quickstart's model, data and SFT warm start (as ``examples/quickstart/quickstart.py`` builds them)."""
    from polyrl.data.synthetic import make_arithmetic_rows, write_jsonl
    from polyrl.models.tiny import make_tiny_model

    make_tiny_model(root / "base", size="mini", seed=0)
    rows = make_arithmetic_rows(2400, seed=0, max_operand=20, ops="+")
    held_out = {r["prompt"][-1]["content"] for r in rows[:200]}
    val, train = rows[:200], [r for r in rows[200:] if r["prompt"][-1]["content"] not in held_out]
    write_jsonl(val, root / "val.jsonl")
    write_jsonl(train, root / "train.jsonl")
    write_jsonl([dict(r, response=str(r["reward_model"]["ground_truth"])) for r in train], root / "sft.jsonl")
    subprocess.run([sys.executable, "-m", "polyrl", "sft", "--manifest", str(QUICKSTART / "polyrl.toml"),
                    "--config", str(QUICKSTART / "sft.yaml"), f"model.path={root / 'base'}",
                    f"data.train_files=[{root / 'sft.jsonl'}]", f"trainer.run_dir={root / 'sft'}"],
                   check=True, stdout=subprocess.DEVNULL)
    return root / "sft" / "hf"


# ---------------------------------------------------------------------- TRL


def run_trl(model: Path, root: Path, out: Path, seed: int, steps: int, every: int, procs: int,
            threads: int = 1, precision: str = "float32") -> dict:
    """TRL's GRPOTrainer under ``torchrun --nproc_per_node procs`` of ``threads`` threads each; rank 0 writes the
    curve."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    result = out / "trl.json"
    spec = json.dumps([str(model), str(root), str(out), seed, steps, every, str(result), precision])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={procs}", __file__,
           "--trl-child", spec]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL,
                   env=dict(os.environ, OMP_NUM_THREADS=str(threads)))
    return json.loads(result.read_text())


def trl_child(model_dir: str, root: str, out: str, seed: int, steps: int, every: int, result: str,
              precision: str = "float32") -> None:
    """One torchrun process: GRPO with TRL, held-out accuracy on rank 0 every ``every`` steps (clock paused).
    ``precision="bfloat16"``: TRL's ``bf16=True`` (accelerate's CPU autocast over float32 weights); its evaluation
    still samples from a float32 copy (polyrl's validation samples with its bf16 rollout, as it trains)."""
    import torch
    import torch.distributed as dist
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from polyrl.rewards.functions import arithmetic_score

    def load(name: str) -> list[dict]:
        return [json.loads(line) for line in (Path(root) / name).read_text().splitlines() if line.strip()]

    train = load("train.jsonl")
    val = load("val.jsonl")
    ds = Dataset.from_list([{"prompt": r["prompt"], "answer": str(r["reward_model"]["ground_truth"])} for r in train])

    def reward(completions, answer, **kw):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [arithmetic_score("arithmetic", t, a)["score"] for t, a in zip(texts, answer, strict=True)]

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    answers = [str(r["reward_model"]["ground_truth"]) for r in val]
    holder: dict = {}
    # the evaluator's own model and tokenizer, loaded before TRL touches either (TRL adjusts the training model's
    # and the processing class's settings): the trained weights are copied in at each evaluation
    eval_tok = AutoTokenizer.from_pretrained(model_dir)
    eval_tok.padding_side = "left"
    eval_net = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    texts = [eval_tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False) for r in val]
    enc = eval_tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)

    def evaluate() -> float:
        net = holder["trainer"].accelerator.unwrap_model(holder["trainer"].model)
        eval_net.load_state_dict(net.state_dict())
        torch.manual_seed(seed)  # the same random numbers at every evaluation (as polyrl's validation)
        with torch.no_grad():
            seqs = eval_net.generate(**enc, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                     num_return_sequences=VAL_N, max_new_tokens=COMPLETION,
                                     pad_token_id=eval_tok.pad_token_id)
        outs = eval_tok.batch_decode(seqs[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        scores = [arithmetic_score("arithmetic", o, answers[i // VAL_N])["score"] for i, o in enumerate(outs)]
        return sum(scores) / len(scores)

    class Curve(TrainerCallback):
        def __init__(self) -> None:
            self.points: list[tuple[int, float, float]] = []
            self.paused = 0.0
            self.start = 0.0

        def _eval(self, step: int) -> None:
            t = time.perf_counter()
            if rank == 0:
                self.points.append((step, t - self.start - self.paused, evaluate()))
            if world > 1:
                dist.barrier()
            self.paused += time.perf_counter() - t

        def on_train_begin(self, args, state, control, **kw):
            self.start = time.perf_counter()
            self._eval(0)

        def on_step_end(self, args, state, control, **kw):
            if state.global_step % every == 0 or state.global_step == steps:
                self._eval(state.global_step)

    cfg = GRPOConfig(
        output_dir=out, per_device_train_batch_size=MINI * N // world, steps_per_generation=PROMPTS // MINI,
        num_generations=N, gradient_accumulation_steps=1, max_completion_length=COMPLETION, max_steps=steps,
        learning_rate=LR, lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=1.0, warmup_steps=0,
        logging_steps=10, report_to="none", use_cpu=True, bf16=precision == "bfloat16", fp16=False, save_strategy="no",
        temperature=1.0, top_k=0, top_p=1.0, beta=0.0, seed=seed, data_seed=seed, dataloader_num_workers=0,
        use_vllm=False, gradient_checkpointing=False, ddp_backend="gloo" if world > 1 else None,
        ddp_find_unused_parameters=False,  # every parameter is used: no extra autograd traversal
    )
    curve = Curve()
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=cfg, train_dataset=ds, processing_class=tok,
                          callbacks=[curve])
    holder["trainer"] = trainer
    trainer.train()
    if rank == 0:
        Path(result).write_text(json.dumps({"points": curve.points}))


# ---------------------------------------------------------------------- polyrl


def run_polyrl(model: Path, root: Path, out: Path, seed: int, steps: int, every: int, mode: str,
               extra: list[str]) -> dict:
    """``polyrl train`` with the quickstart's GRPO config; the curve from its metrics (validation time excluded)."""
    if out.exists():
        shutil.rmtree(out)
    placement = [] if mode == "sync" else [
        "trainer.placement=split", "trainer.n_workers=1", "trainer.rollout_workers=1", f"trainer.async_mode={mode}"]
    overrides = [
        f"model.path={model}", f"data.train_files=[{root / 'train.jsonl'}]", f"data.val_files=[{root / 'val.jsonl'}]",
        f"trainer.run_dir={out}", f"trainer.total_steps={steps}", f"trainer.test_freq={every}",
        "trainer.save_freq=0", "trainer.logger=[jsonl]", "trainer.val_before_train=true", f"trainer.seed={seed}",
        f"data.seed={seed}", "trainer.report_freq=0", *placement, *extra,
    ]
    subprocess.run([sys.executable, "-m", "polyrl", "train", "--manifest", str(QUICKSTART / "polyrl.toml"),
                    "--config", str(QUICKSTART / "grpo.yaml"), *overrides], check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    key = "val/arithmetic/mean@4"
    steps_rows = [r for r in rows if "timing/step" in r]
    # clock: wall time of each metrics line since the first step began, less the validations so far
    start = steps_rows[0]["time"] - steps_rows[0]["timing/step"]
    points: list[tuple[int, float, float]] = []
    paused = 0.0
    for r in rows:
        if key not in r:
            continue
        step = int(r.get("step", 0))
        if "timing/step" not in r:  # the validation before training
            points.append((0, 0.0, r[key]))
            continue
        paused += r.get("timing/validate", 0.0)
        # TRL steps: each polyrl step is PROMPTS // MINI optimizer steps
        points.append((step * (PROMPTS // MINI), r["time"] - start - paused, r[key]))
    return {"points": points}


# ---------------------------------------------------------------------- report


def target_and_time(trl: dict, ours: dict) -> dict:
    """TRL's accuracy after its last step (mean of its last two evaluations) and the seconds each side takes to
    first reach it (linear interpolation between evaluations)."""
    tp = trl["points"]
    target = sum(p[2] for p in tp[-2:]) / len(tp[-2:])

    def first_reach(points: list) -> float | None:
        # the first evaluation after training began at or above the target, interpolated from the one before
        for (_, s0, a0), (_, s1, a1) in zip(points, points[1:], strict=False):
            if a1 >= target:
                return s0 + (s1 - s0) * (target - a0) / (a1 - a0) if a0 < target else s1
        return None

    t_trl = first_reach(tp) or tp[-1][1]
    t_ours = first_reach(ours["points"])
    return {"target": target, "trl_s": tp[-1][1], "trl_reach_s": t_trl, "polyrl_reach_s": t_ours,
            "ratio_vs_trl_end": (t_ours / tp[-1][1]) if t_ours is not None else None}


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--trl-child":
        trl_child(*json.loads(sys.argv[2]))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    parser.add_argument("--trl-steps", type=int, default=200, help="TRL optimizer steps (2 per generation)")
    parser.add_argument("--polyrl-steps", type=int, default=0, help="polyrl steps (0: as many generations as TRL's)")
    parser.add_argument("--eval-every", type=int, default=20, help="TRL steps between evaluations (even)")
    parser.add_argument("--cores", type=int, default=2, help="TRL torchrun processes (polyrl: two workers)")
    parser.add_argument("--trl-threads", type=int, default=1,
                        help="threads per TRL process (--cores 1 --trl-threads 2: one process of two threads)")
    parser.add_argument("--polyrl-mode", default="sync", choices=["sync", "one_step_off_policy", "fully_async"])
    parser.add_argument("--polyrl-args", nargs="*", default=[], help="extra `polyrl train` overrides (key=value)")
    parser.add_argument("--sides", nargs="+", default=["trl", "polyrl"], choices=["trl", "polyrl"])
    parser.add_argument("--out", default=None, help="work folder (default: a new temporary one)")
    parser.add_argument("--precision", default="float32", choices=sorted(PRECISION_ARGS),
                        help="both sides: float32, or bf16 compute over float32 weights (TRL's bf16=True; polyrl's "
                             "actor.fsdp.param_dtype=bfloat16 with a bf16 rollout)")
    args = parser.parse_args()
    per = PROMPTS // MINI
    if args.eval_every % per:
        parser.error(f"--eval-every must be a multiple of {per} (one polyrl step is {per} TRL steps)")
    root = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="bench-tta-"))
    root.mkdir(parents=True, exist_ok=True)
    started = time.time()
    model = root / "sft" / "hf"
    if not model.exists():
        model = prepare(root)
    print(f"SFT start ready in {time.time() - started:.0f}s ({root}); load average {os.getloadavg()}", flush=True)
    polyrl_steps = args.polyrl_steps or args.trl_steps // per
    report = []
    for i, seed in enumerate(args.seeds):
        sides = list(args.sides) if i % 2 == 0 else list(reversed(args.sides))
        res: dict = {"seed": seed, "order": sides, "load_before": os.getloadavg()}
        for side in sides:
            if side == "trl":
                res["trl"] = run_trl(model, root, root / f"trl-{seed}", seed, args.trl_steps, args.eval_every,
                                     args.cores, args.trl_threads, args.precision)
            else:
                res["polyrl"] = run_polyrl(model, root, root / f"polyrl-{seed}", seed, polyrl_steps,
                                           args.eval_every // per, args.polyrl_mode,
                                           [*PRECISION_ARGS[args.precision], *args.polyrl_args])
        res["load_after"] = os.getloadavg()
        if "trl" in res and "polyrl" in res:
            res.update(target_and_time(res["trl"], res["polyrl"]))
        report.append(res)
        for side in ("trl", "polyrl"):
            if side in res:
                pts = " ".join(f"({s:.0f}s, {a:.3f})" for _, s, a in res[side]["points"])
                print(f"seed {seed} {side:6}: {pts}", flush=True)
        if "target" in res:
            reach = res["polyrl_reach_s"]
            print(f"seed {seed}: TRL after {args.trl_steps} steps {res['target']:.3f} in {res['trl_s']:.0f}s; polyrl "
                  f"({args.polyrl_mode}) reaches it in "
                  + (f"{reach:.0f}s = {res['ratio_vs_trl_end']:.2f}x TRL's time" if reach is not None else "(never)")
                  + f"; load {res['load_before'][0]:.1f} -> {res['load_after'][0]:.1f}", flush=True)
    ratios = sorted(r["ratio_vs_trl_end"] for r in report if r.get("ratio_vs_trl_end") is not None)
    if ratios:
        print(f"median time ratio polyrl/TRL: {ratios[len(ratios) // 2]:.2f} over {len(ratios)} seeds "
              f"(of {len(report)})", flush=True)
    pooled = pooled_curves(report)
    if pooled is not None:
        reach = pooled["polyrl_reach_s"]
        print(f"mean curves over {pooled['seeds']} seeds: TRL after {args.trl_steps} steps {pooled['target']:.3f} in "
              f"{pooled['trl_s']:.1f}s; polyrl reaches it in "
              + (f"{reach:.1f}s = {pooled['ratio_vs_trl_end']:.2f}x TRL's time" if reach is not None else "(never)"),
              flush=True)
        for side in ("trl", "polyrl"):
            pts = " ".join(f"({s:.1f}s, {a:.3f})" for _, s, a in pooled[side]["points"])
            print(f"mean {side:6}: {pts}", flush=True)
    print(json.dumps({"seeds": report, "pooled": pooled}), flush=True)


def pooled_curves(report: list[dict]) -> dict | None:
    """Both sides' curves averaged over the seeds (accuracy and seconds per evaluation) and the same target and
    time as per seed, read off the mean curves: one run's final accuracy moves by several points with the sampling
    alone (TRL at one seed: 0.54 on two processes, 0.43 on one), so a single seed's target is a noisy line."""
    done = [r for r in report if "trl" in r and "polyrl" in r]
    if len(done) < 2:
        return None
    mean = {}
    for side in ("trl", "polyrl"):
        n = min(len(r[side]["points"]) for r in done)
        mean[side] = {"points": [(done[0][side]["points"][i][0],
                                  sum(r[side]["points"][i][1] for r in done) / len(done),
                                  sum(r[side]["points"][i][2] for r in done) / len(done)) for i in range(n)]}
    return {"seeds": len(done), **mean, **target_and_time(mean["trl"], mean["polyrl"])}


if __name__ == "__main__":
    main()
