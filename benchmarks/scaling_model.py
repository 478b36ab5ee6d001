"""A step-time model for sync, one-step off-policy and fully async training (docs/scaling.md).

``calibrate RUN_DIR --params P``: reads polyrl's per-phase timings (``timing/gen``, ``timing/update_actor``,
``timing/weight_sync``, token counts) from ``RUN_DIR/metrics.jsonl`` and states each phase as a fraction of
this machine's measured limits (matmul FLOP/s for the update, the decode roofline for generation) and the
weight sync as bytes/s. ``predict``: the model's step time for a 7B model on 8, 64 and 1024 GPUs in the
three modes, with the assumptions printed.

    .venv/bin/python benchmarks/scaling_model.py calibrate runs/x --params 25.5e6
    .venv/bin/python benchmarks/scaling_model.py predict
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass, replace
from pathlib import Path


@dataclass(frozen=True)
class Hardware:
    """One accelerator and its links (defaults: H100 SXM, bf16 dense)."""

    flops: float = 989e12
    hbm_bandwidth: float = 3.35e12  # bytes/s
    node_gpus: int = 8
    #: weight-sync bandwidth per GPU between pools (NCCL broadcast over InfiniBand, 400 Gb/s per GPU)
    link_bandwidth: float = 50e9


@dataclass(frozen=True)
class Efficiency:
    """Fractions of the limits each phase reaches (see docs/scaling.md for where the defaults come from)."""

    mfu_train: float = 0.35  # update (forward + backward + optimizer) vs peak FLOP/s
    decode: float = 0.5  # decode step vs the memory roofline (weights + KV read once per step)
    prefill: float = 0.4  # prefill vs peak FLOP/s
    sync: float = 0.5  # weight broadcast vs link bandwidth
    overhead_s: float = 2.0  # per step: driver, rewards, data movement, scheduling


@dataclass(frozen=True)
class Workload:
    """One GRPO step."""

    params: float = 7e9
    prompts: int = 512
    n: int = 16
    prompt_len: int = 1024
    response_mean: int = 2048
    #: the longest response of a batch over the mean: generation waits for it in sync modes
    tail: float = 4.0
    bytes_per_param: int = 2
    tp: int = 2  # rollout tensor parallelism for a 7B model


def gen_time(w: Workload, gpus: int, hw: Hardware, eff: Efficiency, *, streamed: bool) -> float:
    """Seconds to generate the step's ``prompts * n`` responses on ``gpus`` rollout GPUs.

    Decoding runs in replicas of ``tp`` GPUs; each decode step of a replica reads its weights and KV cache
    once (memory-bound) or is bound by its FLOPs, whichever is longer. In sync and one-step modes the batch
    ends with its longest response (``tail`` x mean: the last steps run nearly empty); a streamed rollout
    (fully async) keeps replicas full, so only the mean length counts.
    """
    replicas = max(1, gpus // w.tp)
    seqs = w.prompts * w.n / replicas  # sequences per replica
    weights = w.params * w.bytes_per_param / w.tp  # bytes per GPU
    kv = 2 * 32 * 4096 * w.bytes_per_param * (w.prompt_len + w.response_mean / 2) / 4 / w.tp  # GQA /4, per seq
    step_mem = (weights + seqs * kv) / (hw.hbm_bandwidth * eff.decode)
    step_flops = 2 * w.params / w.tp * seqs / (hw.flops * eff.mfu_train)
    per_token = max(step_mem, step_flops)
    prefill = 2 * w.params * w.prompt_len * seqs / w.tp / (hw.flops * eff.prefill)
    if streamed:
        return prefill + w.response_mean * per_token
    # the tail: after the mean length most sequences are done and steps run memory-bound on a near-empty batch
    tail_steps = w.response_mean * (w.tail - 1)
    return prefill + w.response_mean * per_token + tail_steps * weights / (hw.hbm_bandwidth * eff.decode)


def train_time(w: Workload, gpus: int, hw: Hardware, eff: Efficiency) -> float:
    """Old log-probs (forward) plus the update (forward + backward): 8 x params x tokens FLOPs."""
    tokens = w.prompts * w.n * (w.prompt_len + w.response_mean)
    return 8 * w.params * tokens / (gpus * hw.flops * eff.mfu_train)


def sync_time(w: Workload, hw: Hardware, eff: Efficiency, *, colocated: bool) -> float:
    """Weights to the rollout: in-process reshard (colocated, HBM speed) or a broadcast between pools."""
    size = w.params * w.bytes_per_param
    if colocated:
        return size / (hw.hbm_bandwidth * eff.sync) + 0.5
    return size / (hw.link_bandwidth * eff.sync) + 0.5


def predict(w: Workload, gpus: int, hw: Hardware, eff: Efficiency) -> dict[str, dict[str, float]]:
    """Step time by phase for each mode; the async modes use the best split of GPUs between the pools."""
    out = {}
    gen = gen_time(w, gpus, hw, eff, streamed=False)
    train = train_time(w, gpus, hw, eff)
    sync = sync_time(w, hw, eff, colocated=True)
    out["sync (colocated)"] = {"gen": gen, "train": train, "sync": sync, "wait": 0.0,
                               "step": gen + train + sync + eff.overhead_s}
    for mode, streamed in (("one_step_off_policy", False), ("fully_async", True)):
        best = None
        for rollout in range(w.tp, gpus, w.tp):
            g = gen_time(w, rollout, hw, eff, streamed=streamed)
            t = train_time(w, gpus - rollout, hw, eff)
            s = sync_time(w, hw, eff, colocated=False)
            step = max(g, t + s) + eff.overhead_s
            if best is None or step < best["step"]:
                best = {"gen": g, "train": t, "sync": s, "wait": step - eff.overhead_s - max(t + s, 0) if g > t + s
                        else 0.0, "step": step, "rollout_gpus": rollout}
        out[mode] = best
    return out


def calibrate(run_dir: Path, params: float) -> dict[str, float]:
    """This machine's efficiencies from a polyrl run's metrics (one core per worker, float32)."""
    import time

    import torch

    torch.set_num_threads(1)
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    start = time.perf_counter()
    for _ in range(10):
        a @ b
    flops = 2 * 1024**3 * 10 / (time.perf_counter() - start)
    x = torch.empty(64 << 20)
    y = torch.empty_like(x)
    start = time.perf_counter()
    for _ in range(5):
        y.copy_(x)
    bandwidth = 2 * x.numel() * 4 * 5 / (time.perf_counter() - start)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "timing/update_actor" in r][1:]  # the first step warms up
    import yaml

    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    batch = int(cfg["data"]["train_batch_size"]) * int(cfg["rollout"]["n"])
    mean = lambda k: sum(r.get(k, 0.0) for r in rows) / len(rows)  # noqa: E731
    resp, prompt = mean("response_length/mean"), mean("prompt_length/mean")
    update_flops = 6 * params * batch * (prompt + resp)
    decode_floor = resp * max(params * 4 / bandwidth, 2 * params * batch / flops)
    return {
        "cpu_matmul_gflops": flops / 1e9, "cpu_bandwidth_gbs": bandwidth / 1e9,
        "update_fraction_of_matmul_peak": update_flops / flops / mean("timing/update_actor"),
        "gen_fraction_of_roofline": decode_floor / mean("timing/gen"),
        "weight_sync_gbs": params * 4 / mean("timing/weight_sync") / 1e9,
        "gen_s": mean("timing/gen"), "update_s": mean("timing/update_actor"), "sync_s": mean("timing/weight_sync"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    cal = sub.add_parser("calibrate")
    cal.add_argument("run_dir", type=Path)
    cal.add_argument("--params", type=float, required=True)
    pred = sub.add_parser("predict")
    pred.add_argument("--gpus", type=int, nargs="+", default=[8, 64, 1024])
    args = parser.parse_args()
    if args.cmd == "calibrate":
        print(json.dumps(calibrate(args.run_dir, args.params), indent=1))
        return
    hw, eff = Hardware(), Efficiency()
    for gpus in args.gpus:
        # the global batch grows with the cluster beyond 256 GPUs (16 responses per GPU), as runs that size do
        w = Workload()
        w = replace(w, prompts=max(w.prompts, math.ceil(16 * gpus / w.n)))
        res = predict(w, gpus, hw, eff)
        base = res["sync (colocated)"]["step"]
        print(f"{gpus} GPUs, {w.prompts} prompts x {w.n}:")
        for mode, r in res.items():
            extra = f", rollout GPUs {r['rollout_gpus']}" if "rollout_gpus" in r else ""
            print(f"  {mode:20} step {r['step']:7.1f} s  gen {r['gen']:7.1f}  train {r['train']:6.1f}  "
                  f"sync {r['sync']:4.1f}  x{base / r['step']:.2f}{extra}")


if __name__ == "__main__":
    main()
