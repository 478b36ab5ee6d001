"""FSDP engine training throughput: dynamic (token-budget) micro-batches vs fixed padded micro-batches.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_fsdp_dynamic_bsz.py [--size small] [--steps 3]

Same model, same batch of prompts/responses of mixed lengths (a few long, many short), same number of
sequences per step; reported: trained tokens/s of each mode, its ratio to fixed micro-batches, and peak
RSS (this is a CPU run; each mode runs in its own process so the peak is its own). Modes: fixed padded
micro-batches, dynamic micro-batches by a token budget, and dynamic micro-batches of packed sequences
(``use_remove_padding``).
"""

from __future__ import annotations

import argparse
import os
import resource
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from polyrl.agent_loops import collate  # noqa: E402
from polyrl.algorithms import agg_loss  # noqa: E402
from polyrl.config.roles import EngineRoleConfig, ModelConfig, OptimConfig  # noqa: E402
from polyrl.models.tiny import make_tiny_model  # noqa: E402
from polyrl.protocols import AgentLoopOutput  # noqa: E402

#: fixed: 8 sequences per micro-batch (all-padding columns trimmed); dynamic: first-fit by a token budget of
#: padded tokens; packed: the same budget of real tokens, sequences concatenated without padding
MODES = {
    "fixed": {"micro_batch_size": 8},
    "dynamic": {"use_dynamic_bsz": True},
    "dynamic+packed": {"use_dynamic_bsz": True, "use_remove_padding": True},
}


def make_batch(rows: int, max_len: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    outs = []
    for i in range(rows):
        long = i % 8 == 0  # one in eight responses is long, the rest short: typical RL length skew
        r = int(torch.randint(max_len // 2, max_len, (1,), generator=g)) if long else int(torch.randint(8, 32, (1,), generator=g))
        p = int(torch.randint(16, 64, (1,), generator=g))
        outs.append(AgentLoopOutput(torch.randint(5, 250, (p,), generator=g).tolist(),
                                    torch.randint(5, 250, (r,), generator=g).tolist(), [1] * r))
    b = collate(outs, pad_token_id=0, max_prompt_length=64, max_response_length=max_len)
    b["advantages"] = torch.randn(rows, 1, generator=g).expand(rows, max_len).contiguous()
    return b


def loss_fn(out, mb, scale):
    """The token-mean policy-gradient loss with the engine's global normalisation."""
    return agg_loss(-out["log_probs"] * mb["advantages"], mb["response_mask"], "token-mean", loss_scale=scale), {}


def run(model_dir: Path, batch, steps: int, **kw) -> float:
    from polyrl_engine_fsdp.engine import FSDPEngine

    engine = FSDPEngine(EngineRoleConfig(model=ModelConfig(path=str(model_dir)), optim=OptimConfig(lr=1e-5), **kw),
                        role="actor")
    engine.train_batch(batch, loss_fn)  # warm-up
    start = time.perf_counter()
    for _ in range(steps):
        engine.train_batch(batch, loss_fn)
    return float(batch["attention_mask"].sum()) * steps / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="small")
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--max-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--mode", choices=list(MODES), help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    budget = 8 * (64 + args.max_len) // 2
    if args.mode:  # one measurement per process, so peak memory is that mode's own
        batch = make_batch(args.rows, args.max_len)
        kw = dict(MODES[args.mode], max_token_len_per_gpu=budget)
        rate = run(Path(args.model_dir), batch, args.steps, **kw)
        print(f"{rate} {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}")
        return
    import subprocess
    import sys

    model_dir = make_tiny_model(Path(tempfile.mkdtemp()) / args.size, size=args.size)
    results = {}
    for mode in MODES:
        out = subprocess.run([sys.executable, __file__, "--mode", mode, "--model-dir", str(model_dir), "--size", args.size,
                              "--rows", str(args.rows), "--max-len", str(args.max_len), "--steps", str(args.steps)],
                             check=True, capture_output=True, text=True).stdout.split()
        results[mode] = (float(out[-2]), float(out[-1]))
    fixed, rss_f = results["fixed"]
    print(f"model={args.size} rows={args.rows} max_len={args.max_len} (1 in 8 responses long), "
          f"token budget {budget}")
    for mode, (rate, rss) in results.items():
        print(f"{mode:>15}: {rate:8.1f} tokens/s ({rate / fixed:.2f}x fixed)   peak RSS {rss:.2f} GiB "
              f"({rss / rss_f:.2f}x fixed)")


if __name__ == "__main__":
    main()
