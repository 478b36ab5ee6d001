"""The ``hf`` rollout on the real model (issue 48): SmolLM2-135M-Instruct, GSM8K prompts through its chat template,
``--prompts`` x ``--samples`` completions of up to ``--completion`` tokens that stop at ``<|im_end|>``, as the
``gsm8k`` workload of ``bench_grpo_vs_trl.py`` generates them; A/B of the sampler (this tree's
``polyrl.rollout.hf.draw`` against the flat float64 inverse CDF it replaced) in one process, alternating, median of
``--rounds``, plus a split of one ``generate`` call (prefill, the decode steps' layers, the LM head, sampling).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_real_decode.py --threads 1 --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_grpo_vs_trl as bench  # noqa: E402


def flat_draw(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """The sampler before issue 48: one float64 running sum over the whole vocabulary."""
    cdf = probs.to(torch.float64).cumsum(-1)
    u = torch.rand(probs.shape[0], 1, generator=generator, dtype=torch.float64, device=probs.device) * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True).squeeze(-1).clamp_(max=probs.shape[-1] - 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--completion", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    from polyrl.config.roles import RolloutConfig
    from polyrl.protocols import GenerationRequest, SamplingParams
    from polyrl.rollout import hf

    model_dir = bench.real_model("smollm2-135m")
    tok = AutoTokenizer.from_pretrained(model_dir)
    rows = bench.make_rows("gsm8k")[: args.prompts]
    prompts = [list(tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=True, return_dict=True)
                    ["input_ids"]) for r in rows]
    rollout = hf.HFRollout(RolloutConfig(max_batch_size=args.prompts * args.samples, dtype=args.dtype),
                           model_path=str(model_dir), tokenizer=tok)
    stop = [tok.convert_tokens_to_ids("<|im_end|>")]

    def generate(seed: int) -> tuple[float, int]:
        params = SamplingParams(temperature=1.0, max_new_tokens=args.completion, n=args.samples, seed=seed,
                                stop_token_ids=stop, logprobs=True)
        start = time.perf_counter()
        out = rollout.generate([GenerationRequest(p, params) for p in prompts])
        return time.perf_counter() - start, sum(len(r.response_ids) for r in out)

    new_draw = hf.draw
    variants = {"flat float64 draw (before)": flat_draw, "blocked draw (now)": new_draw}
    generate(0)  # warm-up
    times: dict[str, list[float]] = {k: [] for k in variants}
    tokens: dict[str, list[int]] = {k: [] for k in variants}
    for r in range(args.rounds):
        for name in (list(variants) if r % 2 == 0 else list(variants)[::-1]):
            hf.draw = variants[name]  # type: ignore[assignment]
            seconds, n = generate(r + 1)  # the same seed on both sides: the same samples
            times[name].append(seconds)
            tokens[name].append(n)
    hf.draw = new_draw  # type: ignore[assignment]
    for name in variants:
        med = statistics.median(times[name])
        print(f"{name:28} {med:7.2f} s a generate call (median of {args.rounds}; {times[name]}), "
              f"{statistics.median(tokens[name]) / med:6.1f} completion tokens/s, tokens {tokens[name]}")
    before, now = (statistics.median(times[k]) for k in variants)
    print(f"ratio before / now: {before / now:.3f}")
    # where one call's time goes: the profiler's self time per operator, grouped
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        generate(100)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=40))
    print(prof.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=25,
                                                             max_name_column_width=40, max_shapes_column_width=60))


if __name__ == "__main__":
    main()
