"""The hf rollout's decode loop (polyrl.rollout.decode) against transformers' forward step by step, in one process.

Same model, prompts and sampling on both paths (``HFRollout.decoder`` set or ``None``): 8 prompts x 4 samples
(GRPO's shape), 32 new tokens each, temperature 1, no stop; the paths alternate, the first round is not
counted, medians of wall and CPU seconds per ``generate`` call. One thread (``OMP_NUM_THREADS=1``), so CPU
seconds are what the call costs a core even on a machine other jobs share.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_hf_decode.py [--size small] [--prompt-tokens 9 200] \\
        [--rows 32 16] [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="small", choices=["tiny", "mini", "small"])
    parser.add_argument("--prompt-tokens", type=int, nargs="+", default=[9, 200])
    parser.add_argument("--rows", type=int, nargs="+", default=[32, 16], help="samples per batch (4 per prompt)")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    import torch
    from transformers import AutoTokenizer

    from polyrl.config.roles import RolloutConfig
    from polyrl.models.tiny import make_tiny_model
    from polyrl.protocols import GenerationRequest, SamplingParams
    from polyrl.rollout.hf import HFRollout

    torch.set_num_threads(1)
    path = make_tiny_model(Path(tempfile.mkdtemp(prefix="bench-decode-")) / args.size, size=args.size, seed=0)
    rollout = HFRollout(RolloutConfig(max_batch_size=64), model_path=str(path),
                        tokenizer=AutoTokenizer.from_pretrained(path))
    decoder = rollout.decoder
    assert decoder is not None, "the benchmark model is not one polyrl.rollout.decode runs"
    params = SamplingParams(temperature=1.0, max_new_tokens=32, n=4, seed=1, ignore_eos=True)
    print(f"{args.size}: load average {os.getloadavg()[0]:.1f}", flush=True)
    for prompt_tokens in args.prompt_tokens:
        for rows in args.rows:
            reqs = [GenerationRequest([10 + (i + j) % 200 for j in range(prompt_tokens)], params)
                    for i in range(rows // 4)]
            wall: dict[str, list[float]] = {"transformers": [], "polyrl": []}
            cpu: dict[str, list[float]] = {"transformers": [], "polyrl": []}
            for r in range(args.rounds):
                order = ["transformers", "polyrl"] if r % 2 == 0 else ["polyrl", "transformers"]
                for side in order:
                    rollout.decoder = decoder if side == "polyrl" else None
                    t, c = time.perf_counter(), time.process_time()
                    rollout.generate(reqs)
                    wall[side].append(time.perf_counter() - t)
                    cpu[side].append(time.process_time() - c)
            w = {k: statistics.median(v[1:]) for k, v in wall.items()}
            c2 = {k: statistics.median(v[1:]) for k, v in cpu.items()}
            print(f"prompt {prompt_tokens:3d} tokens, {rows:2d} rows: transformers {w['transformers']:.3f} s "
                  f"(cpu {c2['transformers']:.3f}), polyrl {w['polyrl']:.3f} s (cpu {c2['polyrl']:.3f}); "
                  f"speed-up wall {w['transformers'] / w['polyrl']:.2f}x, cpu {c2['transformers'] / c2['polyrl']:.2f}x",
                  flush=True)
    rollout.decoder = decoder


if __name__ == "__main__":
    main()
