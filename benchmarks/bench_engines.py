"""Training throughput of one step: the megatron engine vs the fsdp engine, same model and batch, 2 workers.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_engines.py [--size mini] [--steps 3] [--tp 2]

Both engines run in the same 2-process gloo group (the same run), one after the other, on the same batch
of GRPO-like rows: fsdp shards over the 2 ranks (data parallel, each rank half the rows); megatron uses
``--tp`` tensor-parallel ranks (TP=2: both ranks compute every row, split by heads and vocabulary; TP=1:
data parallel like fsdp). Reported: trained response+prompt tokens/s of each engine, their ratio, and where
a megatron step goes (megatron's forward/backward schedule incl. the gradient all-reduce, vs the optimizer).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402


def _batch(rows: int, seed: int = 0):
    from polyrl.agent_loops import collate
    from polyrl.protocols import AgentLoopOutput

    g = torch.Generator().manual_seed(seed)
    outs = []
    for i in range(rows):
        if i % 4 == 0:
            prompt = torch.randint(5, 250, (int(torch.randint(16, 48, (1,), generator=g)),), generator=g).tolist()
        r = int(torch.randint(16, 64, (1,), generator=g))
        outs.append(AgentLoopOutput(prompt_ids=prompt, response_ids=torch.randint(5, 250, (r,), generator=g).tolist(),
                                    response_mask=[1] * r))
    b = collate(outs, pad_token_id=0, max_prompt_length=48, max_response_length=64)
    b["advantages"] = torch.randn(rows, 1, generator=g).expand(rows, 64).contiguous()
    return b


def _loss(out, mb, scale):
    loss = (-out["log_probs"] * mb["advantages"] * mb["response_mask"]).sum() / scale.batch_num_tokens * scale.dp_size
    return loss, {"loss": float(loss.detach())}


def _worker(rank: int, world: int, port: int, model_dir: str, args: argparse.Namespace) -> None:
    from polyrl_engine_megatron.config import MegatronConfig
    from polyrl_engine_megatron.engine import MegatronEngine

    from polyrl.batch import split
    from polyrl.config.roles import EngineRoleConfig, ModelConfig, OptimConfig
    from polyrl.distributed import init_distributed
    from polyrl.platforms import CPUPlatform
    from polyrl_engine_fsdp.engine import FSDPEngine

    init_distributed("gloo", rank, world, "127.0.0.1", port)
    batch = _batch(args.rows)
    tokens = int(batch["attention_mask"].sum())
    optim = OptimConfig(lr=1e-5, grad_clip=1.0)
    results = {}
    for name in ("fsdp", "megatron"):
        if name == "fsdp":
            engine = FSDPEngine(EngineRoleConfig(model=ModelConfig(path=model_dir), optim=optim,
                                                 micro_batch_size=args.micro_batch_size), role="actor",
                                platform=CPUPlatform())
        else:
            block = MegatronConfig(tensor_model_parallel_size=args.tp)
            engine = MegatronEngine(EngineRoleConfig(engine="megatron", model=ModelConfig(path=model_dir), optim=optim,
                                                     micro_batch_size=args.micro_batch_size, plugin_config=block),
                                    role="actor", platform=CPUPlatform())
        shard = split(batch, engine.dp_size)[engine.dp_rank] if engine.dp_size > 1 else batch
        engine.train_batch(shard, _loss)  # warm-up
        times, opt_times = [], []
        for _ in range(args.steps):
            torch.distributed.barrier()
            start = time.perf_counter()
            if name == "megatron":  # time the optimizer part separately
                step = engine.optimizer.step_with_ready_grads
                spent = [0.0]

                def timed(step=step, spent=spent):
                    t = time.perf_counter()
                    out = step()
                    spent[0] += time.perf_counter() - t
                    return out

                engine.optimizer.step_with_ready_grads = timed
            engine.train_batch(shard, _loss)
            torch.distributed.barrier()
            times.append(time.perf_counter() - start)
            if name == "megatron":
                opt_times.append(spent[0])
                del engine.optimizer.step_with_ready_grads
        step_s = sorted(times)[len(times) // 2]
        results[name] = {"tokens_per_s": tokens / step_s, "step_s": step_s,
                         "optimizer_s": sorted(opt_times)[len(opt_times) // 2] if opt_times else None}
        if name == "megatron":
            from polyrl_engine_megatron.parallel import destroy_parallel_state

            destroy_parallel_state()
        del engine
    if rank == 0:
        f, m = results["fsdp"], results["megatron"]
        print(f"model={args.size} rows={args.rows} tokens/step={tokens} workers={world} megatron TP={args.tp}")
        print(f"fsdp:     {f['tokens_per_s']:8.1f} tokens/s ({f['step_s']:.3f} s/step)")
        print(f"megatron: {m['tokens_per_s']:8.1f} tokens/s ({m['step_s']:.3f} s/step; optimizer {m['optimizer_s']:.3f} s, "
              f"schedule (forward/backward + grad reduce) {m['step_s'] - m['optimizer_s']:.3f} s)")
        print(f"megatron / fsdp: {m['tokens_per_s'] / f['tokens_per_s']:.2f}x")
    torch.distributed.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="mini", choices=["tiny", "mini", "small"])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--tp", type=int, default=2, choices=[1, 2])
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank is not None:
        _worker(args.rank, 2, args.port, args.model_dir, args)
        return
    from polyrl.distributed import free_port
    from polyrl.models.tiny import make_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_model(Path(tmp) / "m", size=args.size, seed=0)
        port = free_port()
        base = [sys.executable, __file__, "--size", args.size, "--rows", str(args.rows), "--micro-batch-size",
                str(args.micro_batch_size), "--steps", str(args.steps), "--tp", str(args.tp), "--port", str(port),
                "--model-dir", str(model_dir)]
        procs = [subprocess.Popen(base + ["--rank", str(r)], stderr=subprocess.DEVNULL) for r in range(2)]
        codes = [p.wait() for p in procs]
        if any(codes):
            raise SystemExit(f"a worker failed: exit codes {codes}")


if __name__ == "__main__":
    main()
