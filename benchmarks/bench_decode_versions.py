"""Two versions of the hf rollout's decode loop (polyrl.rollout.decode) on the same model, alternating.

The installed module against an older copy of the file (``git show REV:packages/core/src/polyrl/rollout/decode.py >
old.py``): the small model, 8 prompts x 4 samples, 32 decode steps fed the same tokens (a float32 model's greedy
ones), per-step wall seconds, the first round not counted, medians; and each side's largest logit difference
from the float32 model.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_decode_versions.py old.py [--threads 1] \\
        [--dtype bfloat16] [--prompt-tokens 9 200] [--rounds 7]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old", type=Path, help="an older decode.py")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--prompt-tokens", type=int, nargs="+", default=[9, 200])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    import torch
    from transformers import AutoTokenizer

    import polyrl.rollout.decode as new
    from polyrl.config.roles import RolloutConfig
    from polyrl.models.tiny import make_tiny_model
    from polyrl.rollout.hf import HFRollout

    spec = importlib.util.spec_from_file_location("polyrl_decode_old", args.old)
    old = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = old
    spec.loader.exec_module(old)
    torch.set_num_threads(args.threads)
    path = make_tiny_model(Path(tempfile.mkdtemp(prefix="bench-decode-")) / "small", size="small", seed=0)
    tok = AutoTokenizer.from_pretrained(path)
    model = HFRollout(RolloutConfig(max_batch_size=64, dtype=args.dtype), model_path=str(path), tokenizer=tok).model
    exact = HFRollout(RolloutConfig(max_batch_size=64, dtype="float32"), model_path=str(path), tokenizer=tok).model
    decoders = {"old": old.StaticDecoder(model), "new": new.StaticDecoder(model)}
    u, group, steps = 8, 4, 32
    expand = torch.arange(u).repeat_interleave(group)
    print(f"load average {os.getloadavg()[0]:.1f}, {args.threads} thread(s), {args.dtype}", flush=True)
    for width in args.prompt_tokens:
        ids = torch.randint(10, 200, (u, width), generator=torch.Generator().manual_seed(0))
        mask = torch.ones_like(ids)
        mask[0, : width // 3] = 0  # one left-padded prompt

        def run(decoder, tokens=None, ids=ids, mask=mask):
            with torch.inference_mode():
                state, logits, pos = decoder.start(ids, mask, expand, steps)
                outs, fed = [logits], []
                start = time.perf_counter()
                for t in range(steps - 1):
                    token = logits.argmax(-1) if tokens is None else tokens[t]
                    fed.append(token)
                    logits = state.step(token, pos)
                    pos = pos + 1
                    outs.append(logits)
                seconds = (time.perf_counter() - start) / (steps - 1)
                state.release()
            return seconds, torch.stack(outs), fed

        _, reference, tokens = run(new.StaticDecoder(exact))
        times: dict[str, list[float]] = {"old": [], "new": []}
        error: dict[str, float] = {}
        for r in range(args.rounds):
            for side in (["old", "new"] if r % 2 == 0 else ["new", "old"]):
                seconds, logits, _ = run(decoders[side], tokens)
                error[side] = float((logits - reference).abs().max())
                if r:
                    times[side].append(seconds)
        o, n = statistics.median(times["old"]), statistics.median(times["new"])
        print(f"{width}-token prompts: old {o * 1e3:.2f} ms/step, new {n * 1e3:.2f} ms/step, new/old {n / o:.3f}; "
              f"max |logit - float32| old {error['old']:.3g}, new {error['new']:.3g}", flush=True)


if __name__ == "__main__":
    main()
