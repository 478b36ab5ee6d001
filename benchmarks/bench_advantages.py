"""GRPO and RLOO advantages: polyrl's vectorised estimators vs a per-group Python loop (verl's style).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_advantages.py [--samples 65536 --tokens 1024 --n 8]

Both compute the same thing on the same inputs (checked); the loop reference builds a dict of
scores per group and loops over samples, as verl's ``compute_grpo_outcome_advantage`` does.
Reported as a ratio (loop time / vectorised time), measured in the same run.
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
    scores = rewards.sum(-1)
    groups = defaultdict(list)
    for i in range(len(scores)):
        groups[index[i]].append(scores[i])
    mean, std = {}, {}
    for k, v in groups.items():
        t = torch.stack(v)
        mean[k], std[k] = (t.mean(), t.std()) if len(v) > 1 else (torch.tensor(0.0), torch.tensor(1.0))
    out = scores.clone()
    for i in range(len(scores)):
        out[i] = (scores[i] - mean[index[i]]) / (std[index[i]] + eps)
    return out.unsqueeze(-1) * mask


def loop_rloo(rewards, mask, index):
    scores = rewards.sum(-1)
    groups = defaultdict(list)
    for i in range(len(scores)):
        groups[index[i]].append(scores[i])
    mean = {k: torch.stack(v).mean() for k, v in groups.items()}
    out = scores.clone()
    for i in range(len(scores)):
        n = len(groups[index[i]])
        if n > 1:
            out[i] = scores[i] * n / (n - 1) - mean[index[i]] * n / (n - 1)
    return out.unsqueeze(-1) * mask


def timed(fn, repeat=1):
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
    return best, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=65536)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--n", type=int, default=8, help="samples per group")
    args = parser.parse_args()
    torch.manual_seed(0)
    b, t = args.samples, args.tokens
    lengths = torch.randint(1, t + 1, (b,))
    mask = (torch.arange(t)[None, :] < lengths[:, None]).float()
    rewards = torch.zeros(b, t)
    rewards[torch.arange(b), lengths - 1] = torch.randint(0, 2, (b,)).float()
    index = np.array([f"uid-{i // args.n}" for i in range(b)], dtype=object)
    print(f"{b} samples x {t} tokens, groups of {args.n}")
    print(f"{'estimator':10} {'vectorised s':>13} {'loop s':>9} {'ratio':>7}")
    for name, loop in (("grpo", loop_grpo), ("rloo", loop_rloo)):
        fn = get_adv_estimator_fn(name)
        t_vec, (adv, _) = timed(lambda fn=fn: fn(rewards, mask, index=index), repeat=3)
        t_loop, ref = timed(lambda loop=loop: loop(rewards, mask, index))
        assert torch.allclose(adv, ref, atol=1e-4), f"{name}: results differ"
        print(f"{name:10} {t_vec:13.3f} {t_loop:9.3f} {t_loop / t_vec:6.1f}x", flush=True)


if __name__ == "__main__":
    main()
