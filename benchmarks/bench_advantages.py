"""GRPO and RLOO advantages: polyrl's vectorised estimators vs a per-group Python loop (verl's style).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_advantages.py            # 65536 samples x 1024 tokens
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_advantages.py --small    # 4096 x 256, a few seconds

The loop reference groups scores in a dict keyed by uid and loops over samples, as verl's
``compute_grpo_outcome_advantage`` / ``compute_rloo_outcome_advantage`` do. Both paths get the same
inputs (uids as a numpy object array of strings, as the trainer passes them) and their results are
checked equal. The loop is timed on the first ``--loop-samples`` samples (whole groups) and scaled
linearly to the full batch when that is smaller than the batch; the output says so.
"""

from __future__ import annotations

import argparse
import os
import time
from collections import defaultdict

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from polyrl.algorithms import get_adv_estimator_fn  # noqa: E402


def loop_grpo(rewards, mask, index, eps=1e-6):
    """verl-style GRPO: a dict of per-group score lists, a Python loop per sample."""
    scores = rewards.sum(-1)
    groups = defaultdict(list)
    for i in range(len(scores)):
        groups[index[i]].append(scores[i])
    mean, std = {}, {}
    for k, v in groups.items():
        t = torch.stack(v)
        mean[k], std[k] = (t.mean(), t.std()) if len(v) > 1 else (torch.tensor(0.0), torch.tensor(1.0))
    for i in range(len(scores)):
        scores[i] = (scores[i] - mean[index[i]]) / (std[index[i]] + eps)
    return scores.unsqueeze(-1) * mask


def loop_rloo(rewards, mask, index):
    """verl-style RLOO: a dict of per-group score lists, a Python loop per sample."""
    scores = rewards.sum(-1)
    groups = defaultdict(list)
    for i in range(len(scores)):
        groups[index[i]].append(scores[i])
    mean = {k: torch.stack(v).mean() if len(v) > 1 else torch.tensor(0.0) for k, v in groups.items()}
    for i in range(len(scores)):
        n = len(groups[index[i]])
        if n > 1:
            scores[i] = scores[i] * n / (n - 1) - mean[index[i]] * n / (n - 1)
    return scores.unsqueeze(-1) * mask


def best_of(fn, repeat):
    best, result = float("inf"), None
    for _ in range(repeat):
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
    return best, result


def make_batch(samples: int, tokens: int, n: int, seed: int = 0):
    """Outcome rewards (0/1, some 0.5) on each response's last token; ragged lengths; ``n`` samples per uid."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, tokens + 1, (samples,), generator=g)
    mask = (torch.arange(tokens)[None, :] < lengths[:, None]).float()
    rewards = torch.zeros(samples, tokens)
    scores = torch.randint(0, 3, (samples,), generator=g).float() / 2
    rewards[torch.arange(samples), lengths - 1] = scores
    index = np.array([f"uid-{i // n}" for i in range(samples)], dtype=object)
    return rewards, mask, index


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=65536)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--n", type=int, default=8, help="samples per group (rollout.n)")
    parser.add_argument("--loop-samples", type=int, default=0,
                        help="time the loop reference on this many samples and scale up (0: the whole batch)")
    parser.add_argument("--repeat", type=int, default=3, help="best of this many runs (vectorised path)")
    parser.add_argument("--small", action="store_true", help="4096 samples x 256 tokens: a quick check")
    args = parser.parse_args()
    if args.small:
        args.samples, args.tokens = 4096, 256
    b, t = args.samples, args.tokens
    rewards, mask, index = make_batch(b, t, args.n)
    loop_b = min(b, args.loop_samples or b)
    loop_b -= loop_b % args.n  # whole groups only
    note = "" if loop_b == b else f" (loop timed on {loop_b} samples, scaled x{b / loop_b:.1f})"
    print(f"{b} samples x {t} tokens, groups of {args.n}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} thread(s){note}")
    print(f"{'estimator':10} {'scope':16} {'vectorised s':>13} {'loop s':>9} {'speed-up':>9}")
    # "B x R": the estimator as called (sum over tokens, grouping, tiling back to [B, R]);
    # "grouping only": the same on [B, 1], i.e. just the per-group statistics the loop is slow at.
    for scope, (r_all, m_all) in (("B x R", (rewards, mask)), ("grouping only", (rewards.sum(-1, keepdim=True),
                                                                                     torch.ones(b, 1)))):
        for name, loop in (("grpo", loop_grpo), ("rloo", loop_rloo)):
            fn = get_adv_estimator_fn(name)
            t_vec, (adv, _) = best_of(lambda fn=fn, r=r_all, m=m_all: fn(r, m, index=index), args.repeat)
            t_loop, ref = best_of(lambda loop=loop, r=r_all, m=m_all: loop(r[:loop_b], m[:loop_b], index[:loop_b]), 1)
            t_loop *= b / loop_b
            if not torch.allclose(adv[:loop_b], ref, atol=1e-5):
                raise SystemExit(f"{name}: vectorised and loop results differ")
            print(f"{name:10} {scope:16} {t_vec:13.3f} {t_loop:9.2f} {t_loop / t_vec:8.1f}x", flush=True)

if __name__ == "__main__":
    main()
