"""Training throughput of one step: the megatron engine vs the fsdp engine, same model and batch, 2 workers.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_engines.py [--size mini] [--steps 3] [--tp 2]

Both engines run in the same 2-process gloo group (the same run), one after the other, on the same batch
of GRPO-like rows: fsdp shards over the 2 ranks (data parallel, each rank half the rows); megatron uses
``--tp`` tensor-parallel ranks (TP=2: both ranks compute every row, split by heads and vocabulary; TP=1:
data parallel like fsdp). Reported: trained response+prompt tokens/s of each engine, their ratio, and where
a megatron step goes (megatron's forward/backward schedule incl. the gradient all-reduce, vs the optimizer).

The fsdp engine's update alone, variants against each other (``--variants``), on the GRPO benchmark's
``short`` shape (``--shape grpo-short``: 8 prompts of 9 tokens x 4 samples of 32 tokens, each rank half the
rows), the quickstart's (``--shape quickstart``: 16 prompts x 8 short answers per rank, e.g.
``--variants packed:fsdp_size=1 padded:fsdp_size=1,shared_prompt_packed=false``) or the rows above:

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_engines.py --size small --shape grpo-short --steps 5 \
        --variants overlap:fsdp_size=1 after:fsdp_size=1,overlap_grad_reduce=false

Each variant is ``label:key=value,...`` (keys of ``FSDPConfig`` or ``EngineRoleConfig``: ``micro_batch_size``,
``use_dynamic_bsz``, ``max_token_len_per_gpu``...). All variants' engines live in the same 2 processes and
take their steps in turn (the order rotating each round); reported per variant: the median step, its parts
(forward + backward, waiting for the gradient all-reduce, clipping, optimizer) and the step's fraction of
the matmul limit (6 x parameters x trained tokens at one core's measured 1024^3 matmul FLOP/s per rank).
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


def _grpo_batch(rows: int, prompt_len: int = 9, response_len: int = 32, n: int = 4, seed: int = 0):
    """GRPO's shape: ``rows / n`` prompts of ``prompt_len`` tokens, ``n`` full-length responses each."""
    from polyrl.agent_loops import collate
    from polyrl.protocols import AgentLoopOutput

    g = torch.Generator().manual_seed(seed)
    outs = []
    for i in range(rows):
        if i % n == 0:
            prompt = torch.randint(5, 250, (prompt_len,), generator=g).tolist()
        outs.append(AgentLoopOutput(prompt_ids=prompt, response_ids=torch.randint(5, 250, (response_len,),
                                                                                  generator=g).tolist(),
                                    response_mask=[1] * response_len))
    b = collate(outs, pad_token_id=0, max_prompt_length=prompt_len, max_response_length=response_len)
    b["advantages"] = torch.randn(rows, 1, generator=g).expand(rows, response_len).contiguous()
    return b


def _quickstart_batch(rows: int, n: int = 8, seed: int = 0):
    """The quickstart's shape (``examples/quickstart/grpo.yaml``): ``rows / n`` prompts of 7-9 tokens, ``n`` samples
    each of a short answer (2-4 tokens) or, one in 16, the whole 8-token budget (no end-of-sequence token)."""
    from polyrl.agent_loops import collate
    from polyrl.protocols import AgentLoopOutput

    g = torch.Generator().manual_seed(seed)
    outs = []
    for i in range(rows):
        if i % n == 0:
            prompt = torch.randint(5, 250, (int(torch.randint(7, 10, (1,), generator=g)),), generator=g).tolist()
        r = 8 if int(torch.randint(0, 16, (1,), generator=g)) == 0 else int(torch.randint(2, 5, (1,), generator=g))
        outs.append(AgentLoopOutput(prompt_ids=prompt, response_ids=torch.randint(5, 250, (r,), generator=g).tolist(),
                                    response_mask=[1] * r))
    b = collate(outs, pad_token_id=0, max_prompt_length=32, max_response_length=8)
    b["advantages"] = torch.randn(rows, 1, generator=g).expand(rows, 8).contiguous()
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


def _variant(spec: str) -> tuple[str, dict, dict]:
    """``label:key=value,...`` -> (label, EngineRoleConfig fields, FSDPConfig fields)."""
    import dataclasses

    from polyrl_engine_fsdp.config import FSDPConfig

    label, _, body = spec.partition(":")
    fsdp_keys = {f.name: f.type for f in dataclasses.fields(FSDPConfig)}
    role, block = {}, {}
    for item in filter(None, body.split(",")):
        key, _, raw = item.partition("=")
        value: object = {"true": True, "false": False}.get(raw.lower(), raw)
        if isinstance(value, str):
            try:
                value = int(raw)
            except ValueError:
                pass
        (block if key in fsdp_keys else role)[key] = value
    return label, role, block


def _update_worker(rank: int, world: int, port: int, model_dir: str, args: argparse.Namespace) -> None:
    """The fsdp engine's update, ``args.variants`` in turn (the order rotating each round), same batch."""
    import json

    from polyrl.batch import split
    from polyrl.config.roles import EngineRoleConfig, ModelConfig, OptimConfig
    from polyrl.distributed import init_distributed
    from polyrl.platforms import CPUPlatform
    from polyrl_engine_fsdp import grad_reduce
    from polyrl_engine_fsdp.config import FSDPConfig
    from polyrl_engine_fsdp.engine import FSDPEngine

    init_distributed("gloo", rank, world, "127.0.0.1", port)
    batch = {"grpo-short": _grpo_batch, "quickstart": _quickstart_batch}.get(args.shape, _batch)(args.rows)
    tokens = int(batch["attention_mask"].sum())
    optim = OptimConfig(lr=1e-5, grad_clip=1.0)
    spent: dict[str, float] = {}

    def timed(name, fn):
        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[name] = spent.get(name, 0.0) + time.perf_counter() - t
        return wrapper

    torch.nn.utils.clip_grad_norm_ = timed("clip", torch.nn.utils.clip_grad_norm_)
    grad_reduce.GradReducer.finish = timed("reduce_wait", grad_reduce.GradReducer.finish)
    engines = {}
    for spec in args.variants:
        label, role, block = _variant(spec)
        role.setdefault("micro_batch_size", args.micro_batch_size)
        engine = FSDPEngine(EngineRoleConfig(model=ModelConfig(path=model_dir), optim=optim,
                                             plugin_config=FSDPConfig(**block), **role),
                            role="actor", platform=CPUPlatform())
        engine.optimizer.step = timed("optimizer", engine.optimizer.step)
        shard = split(batch, engine.dp_size)[engine.dp_rank] if engine.dp_size > 1 else batch
        engine.train_batch(shard, _loss)  # warm-up
        engines[label] = (engine, shard)
    labels = list(engines)
    times: dict[str, list[dict[str, float]]] = {label: [] for label in labels}
    for round_ in range(args.steps):
        for label in labels[round_ % len(labels):] + labels[: round_ % len(labels)]:
            engine, shard = engines[label]
            torch.distributed.barrier()
            spent.clear()
            start = time.perf_counter()
            engine.train_batch(shard, _loss)
            step = time.perf_counter() - start
            torch.distributed.barrier()
            times[label].append({"step": step, **spent})
    if rank == 0:
        limits = json.loads(args.limits)
        params = sum(p.numel() for p in engines[labels[0]][0].module.parameters())
        floor = 6 * params * tokens / (world * limits["matmul_flops"])
        print(f"model={args.size} ({params / 1e6:.1f}M) shape={args.shape} rows={args.rows} tokens/step={tokens} "
              f"workers={world}; one core: matmul {limits['matmul_flops'] / 1e9:.1f} GFLOP/s -> update floor "
              f"{floor:.3f} s")
        for label in labels:
            runs = times[label]

            def median(key, runs=runs):
                values = sorted(r.get(key, 0.0) for r in runs)
                return values[len(values) // 2]

            step = median("step")
            parts = {k: median(k) for k in ("reduce_wait", "clip", "optimizer")}
            fwd_bwd = step - sum(parts.values())
            each = " ".join(f"{r['step']:.3f}" for r in runs)
            print(f"{label:>12}: {step:.3f} s/step (runs {each}), "
                  f"{floor / step:.0%} of the matmul limit; fwd+bwd {fwd_bwd:.3f}, reduce wait "
                  f"{parts['reduce_wait']:.3f}, clip {parts['clip']:.3f}, optimizer {parts['optimizer']:.3f}", flush=True)
    torch.distributed.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="mini", choices=["tiny", "mini", "small"])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--tp", type=int, default=2, choices=[1, 2])
    parser.add_argument("--shape", default="mixed", choices=["mixed", "grpo-short", "quickstart"],
                        help="the rows: mixed lengths (default), the GRPO benchmark's short workload, or the "
                             "quickstart's (16 prompts x 8 short answers per rank)")
    parser.add_argument("--variants", nargs="+", default=[],
                        help="fsdp update variants label:key=value,... (no megatron then)")
    parser.add_argument("--limits", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.shape == "grpo-short":  # the GRPO benchmark's batch and micro-batch (ppo_micro_batch_size_per_gpu=32)
        if args.rows == parser.get_default("rows"):
            args.rows = 32
        if args.micro_batch_size == parser.get_default("micro_batch_size"):
            args.micro_batch_size = 32
    if args.shape == "quickstart":  # a mini-batch of examples/quickstart/grpo.yaml on each rank, one micro-batch
        if args.rows == parser.get_default("rows"):
            args.rows = 256
        if args.micro_batch_size == parser.get_default("micro_batch_size"):
            args.micro_batch_size = 128
    if args.rank is not None:
        (_update_worker if args.variants else _worker)(args.rank, 2, args.port, args.model_dir, args)
        return
    from polyrl.distributed import free_port
    from polyrl.models.tiny import make_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_model(Path(tmp) / "m", size=args.size, seed=0)
        port = free_port()
        base = [sys.executable, __file__, "--size", args.size, "--rows", str(args.rows), "--micro-batch-size",
                str(args.micro_batch_size), "--steps", str(args.steps), "--tp", str(args.tp), "--port", str(port),
                "--model-dir", str(model_dir), "--shape", args.shape]
        if args.variants:
            import json

            sys.path.insert(0, str(Path(__file__).parent))
            from bench_grpo_vs_trl import machine_limits

            base += ["--limits", json.dumps(machine_limits()), "--variants", *args.variants]
        procs = [subprocess.Popen(base + ["--rank", str(r)], stderr=subprocess.DEVNULL) for r in range(2)]
        codes = [p.wait() for p in procs]
        if any(codes):
            raise SystemExit(f"a worker failed: exit codes {codes}")


if __name__ == "__main__":
    main()
