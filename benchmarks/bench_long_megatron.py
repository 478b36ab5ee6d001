"""Long sequences on the megatron engine: peak memory and seconds per update step against response length, for
unchunked vs chunked log-probs and context parallelism CP=1 vs CP=2, in the same run (2 workers).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_long_megatron.py [--lengths 1024,2048,4096] [--steps 2]
        [--size small] [--vocab 32768] [--padded] [--cuda]

The model is ``polyrl.models.tiny``'s ``small`` decoder (8 layers, hidden 512) with a ``--vocab``-token vocabulary
(random weights: ``model.random_init``), so the log-prob head weighs what it weighs in a real LLM. Each update
step trains on sequences of a 64-token prompt and a ``length``-token response:

* ``CP=1``: the 2 workers are data parallel, each trains one sequence (2 sequences a step);
* ``CP=2``: the 2 workers split one sequence (megatron's load-balanced chunks; 1 sequence a step).

So each row holds what one worker holds when it is given the longest sequence of a batch. Sequences are packed
(``use_remove_padding``: the engine's attention, torch's ``scaled_dot_product_attention``) unless ``--padded``
(megatron's own attention for CP=1, which holds the ``[length, length]`` scores of every head and layer). Reported per worker:
seconds per step (median), tokens/s, the peak memory the step added over the memory held before it (CPU: resident
set, sampled every 2 ms after returning freed memory to the OS; CUDA: ``max_memory_allocated``), and the distance
from the machine's limits: peak memory as a share of the memory one worker has (half of RAM on CPU, the GPU's
memory on CUDA), and the model FLOP/s of the step (6 x parameters x tokens + the causal attention) as a share of the
matmul FLOP/s measured on this worker in the same run (the best of a measurement before and one after the
configurations: on shared cores another job's load lowers it, and the share is then too high to read).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

PROMPT = 64
CONFIGS = (("CP=1 unchunked", 1, 0), ("CP=1 chunked", 1, 1024), ("CP=2 chunked", 2, 1024))


class PeakMemory:
    """Peak memory a block adds: CUDA's allocator counter, or this process's resident set sampled on a thread."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.peak = 0

    @staticmethod
    def _rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def __enter__(self) -> PeakMemory:
        gc.collect()
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
            return self
        try:  # hand memory freed earlier back to the OS, so the resident set measures this block
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except OSError:
            pass
        self.base = self._rss()
        self._stop = threading.Event()
        self._top = self.base

        def poll() -> None:
            while not self._stop.is_set():
                self._top = max(self._top, self._rss())
                time.sleep(0.002)

        self._thread = threading.Thread(target=poll, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated() - self.base
            return
        self._stop.set()
        self._thread.join()
        self.peak = max(self._top, self._rss()) - self.base


def _matmul_flops(device: torch.device) -> float:
    """FLOP/s of a 1024^3 (CPU) or 8192^3 (CUDA) float32 matmul on this worker: the compute limit."""
    n = 8192 if device.type == "cuda" else 1024
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    a @ b
    reps = 10 if device.type == "cuda" else 5
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        a @ b
    if device.type == "cuda":
        torch.cuda.synchronize()
    return 2 * n**3 * reps / (time.perf_counter() - start)


def _batch(rows: int, length: int, vocab: int, seed: int):
    from polyrl.agent_loops import collate
    from polyrl.protocols import AgentLoopOutput

    g = torch.Generator().manual_seed(seed)
    outs = [AgentLoopOutput(prompt_ids=torch.randint(5, vocab, (PROMPT,), generator=g).tolist(),
                            response_ids=torch.randint(5, vocab, (length,), generator=g).tolist(),
                            response_mask=[1] * length) for _ in range(rows)]
    b = collate(outs, pad_token_id=0, max_prompt_length=PROMPT, max_response_length=length)
    b["advantages"] = torch.randn(rows, 1, generator=g).expand(rows, length).contiguous()
    return b


def _loss(out, mb, scale):
    mask = mb["response_mask"].float()
    loss = (-out["log_probs"] * mb["advantages"] * mask).sum() / scale.batch_num_tokens * scale.dp_size
    loss = loss - 0.001 * (out["entropy"] * mask).sum() / scale.batch_num_tokens * scale.dp_size
    return loss, {"loss": float(loss.detach())}


def _worker(rank: int, world: int, port: int, model_dir: str, args: argparse.Namespace) -> None:
    from polyrl_engine_megatron.config import MegatronConfig
    from polyrl_engine_megatron.engine import MegatronEngine
    from polyrl_engine_megatron.parallel import destroy_parallel_state

    from polyrl.batch import split
    from polyrl.config.roles import EngineRoleConfig, ModelConfig, OptimConfig
    from polyrl.distributed import init_distributed
    from polyrl.platforms import CPUPlatform, CUDAPlatform

    if args.cuda:
        torch.cuda.set_device(rank)
        platform = CUDAPlatform()
        platform.set_device(rank)
        device, limit = torch.device("cuda", rank), torch.cuda.get_device_properties(rank).total_memory
    else:
        platform, device = CPUPlatform(), torch.device("cpu")
        limit = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // world
    init_distributed("nccl" if args.cuda else "gloo", rank, world, "127.0.0.1", port)
    flops_limit = _matmul_flops(device)
    lengths = [int(n) for n in args.lengths.split(",")]
    rows_out = []
    for name, cp, chunk in CONFIGS:
        block = MegatronConfig(context_parallel_size=cp, param_dtype="bfloat16" if args.cuda else None)
        config = EngineRoleConfig(engine="megatron", model=ModelConfig(path=model_dir, random_init=True),
                                  optim=OptimConfig(lr=1e-5, grad_clip=1.0), micro_batch_size=1,
                                  logits_chunk_size=chunk, use_remove_padding=not args.padded, plugin_config=block)
        engine = MegatronEngine(config, role="actor", platform=platform)
        params = sum(p.numel() for p in engine.inner.parameters()) * engine.parallel.tp * engine.parallel.pp
        spec = engine.spec
        for length in lengths:
            batch = _batch(world // cp, length, args.vocab, seed=length)
            shard = split(batch, engine.dp_size)[engine.dp_rank] if engine.dp_size > 1 else batch
            try:
                engine.train_batch(shard, _loss)  # warm-up
                times, peaks = [], []
                for _ in range(args.steps):
                    torch.distributed.barrier()
                    with PeakMemory(args.cuda) as mem:
                        start = time.perf_counter()
                        engine.train_batch(shard, _loss)
                        if args.cuda:
                            torch.cuda.synchronize()
                        times.append(time.perf_counter() - start)
                    peaks.append(mem.peak)
                error = None
            except (RuntimeError, MemoryError) as exc:  # out of memory: report it, go on
                error, times, peaks = type(exc).__name__ + ": " + str(exc).splitlines()[0][:80], [float("nan")], [0]
            step_s = sorted(times)[len(times) // 2]
            tokens = (PROMPT + length) * (world // cp)  # every sequence the step trained, over both workers
            flops = 6 * params * tokens + 6 * spec.num_layers * spec.hidden_size * (PROMPT + length) * tokens
            found = torch.tensor([max(peaks), step_s], dtype=torch.float64)
            torch.distributed.all_reduce(found, op=torch.distributed.ReduceOp.MAX)
            rows_out.append({"config": name, "length": length, "step_s": float(found[1]), "tokens": tokens,
                             "peak_bytes": float(found[0]), "memory_share": float(found[0]) / limit,
                             "flops_per_s": flops / world / float(found[1]), "error": error})
        del engine
        destroy_parallel_state()
        gc.collect()
    flops_limit = max(flops_limit, _matmul_flops(device))
    for r in rows_out:
        r["flops_share"] = r["flops_per_s"] / flops_limit
    if rank == 0:
        what = f"CUDA ({torch.cuda.get_device_name(0)})" if args.cuda else f"CPU ({os.cpu_count()} cores)"
        layout = "padded rows" if args.padded else "packed sequences"
        print(f"bench_long_megatron: model={args.size} vocab={args.vocab} params={params / 1e6:.1f}M, {layout}, 2 "
              f"workers on {what}; per-worker limits: memory {limit / 2**30:.1f} GiB, matmul {flops_limit / 1e9:.1f} GFLOP/s")
        print(f"{'config':16} {'response':>8} {'s/step':>8} {'tokens/s':>9} {'peak MiB':>9} {'of memory':>9} "
              f"{'of FLOP/s':>9}")
        for r in rows_out:
            note = f"  {r['error']}" if r["error"] else ""
            print(f"{r['config']:16} {r['length']:8d} {r['step_s']:8.2f} {r['tokens'] / r['step_s']:9.0f} "
                  f"{r['peak_bytes'] / 2**20:9.0f} {r['memory_share']:9.1%} {r['flops_share']:9.1%}{note}")
        if args.json:
            Path(args.json).write_text(json.dumps(rows_out, indent=1))
    torch.distributed.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="1024,2048,4096", help="response lengths, comma-separated")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per point (after one warm-up step)")
    parser.add_argument("--size", default="small", choices=["tiny", "mini", "small"])
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--padded", action="store_true", help="padded rows instead of packed sequences")
    parser.add_argument("--cuda", action="store_true", help="one GPU per worker, nccl, bfloat16 parameters")
    parser.add_argument("--json", help="also write the rows here")
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank is not None:
        _worker(args.rank, 2, args.port, args.model_dir, args)
        return
    from polyrl.distributed import free_port
    from polyrl.models.tiny import tiny_config

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "m"
        tiny_config(size=args.size, vocab_size=args.vocab, max_position_embeddings=65536).save_pretrained(model_dir)
        port = free_port()
        forwarded = [a for a in sys.argv[1:]]
        base = [sys.executable, __file__, *forwarded, "--port", str(port), "--model-dir", str(model_dir)]
        procs = [subprocess.Popen(base + ["--rank", str(r)], stderr=None if os.environ.get("BENCH_DEBUG") else subprocess.DEVNULL) for r in range(2)]
        codes = [p.wait() for p in procs]
        if any(codes):
            raise SystemExit(f"a worker failed: exit codes {codes}")


if __name__ == "__main__":
    main()
