"""Long sequences in the FSDP engine: peak memory and seconds per update step against response length, Ulysses
sequence parallelism (SP=1 vs SP=2) and chunked vs unchunked log-probs, in one run.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_long.py [--lengths 1024,2048,4096,8192,16384]

The model is the ``small`` tiny-Qwen2 (8 layers, hidden 512, 8 heads, 4 KV heads) with a 32k vocabulary (a real
tokenizer's size: the char tokenizer's 262 would make the logits negligible), random-init. One update step
(forward, backward, optimizer) of one sequence: a 64-token prompt and a response of each length, with gradient
checkpointing (what long sequences are trained with). Configurations:

* ``sp1``: one rank; ``sp2``: two gloo ranks splitting the sequence (one data-parallel group, so each rank
  does half the work and the step uses two cores);
* ``chunked``: log-probs and entropy over the vocabulary ``logits_chunk_size=1024`` tokens at a time (the default);
  ``unchunked``: one chunk of every token, so the ``[tokens, vocab]`` logits exist whole.

Each configuration runs in processes of its own, so each peak is its own. Wall seconds per step, and CPU seconds of
the busiest rank (on a shared machine the CPU time is the steadier number; ``load`` is the 1-minute load average
when the configuration finished). Memory is the peak resident set of each
rank (CPU) or the peak allocated device memory (CUDA), and the increase over the rank's memory after building the
engine (the step's own: activations, logits, gradients, optimizer state on the first step). On CUDA, SP=2 needs
two GPUs. The table ends with the machine's memory and how close the largest peak came to it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

CONFIGS = {  # name: (sequence-parallel size, logits_chunk_size)
    "sp1-chunked": (1, 1024),
    "sp1-unchunked": (1, 1 << 30),
    "sp2-chunked": (2, 1024),
    "sp2-unchunked": (2, 1 << 30),
}
PROMPT = 64


def make_model(folder: Path, vocab: int, max_len: int) -> Path:
    """The small tiny-Qwen2 with a ``vocab``-token vocabulary, saved as an HF folder."""
    from transformers import AutoModelForCausalLM

    from polyrl.models.tiny import build_char_tokenizer, tiny_config

    config = tiny_config("qwen2", vocab_size=vocab, size="small", max_position_embeddings=max_len, pad_token_id=0,
                         eos_token_id=1, bos_token_id=1)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    build_char_tokenizer().save_pretrained(folder)
    return folder


def one_sequence(length: int, seed: int = 0):
    """A batch of one sequence: a ``PROMPT``-token prompt and a ``length``-token response."""
    from polyrl.agent_loops import collate
    from polyrl.protocols import AgentLoopOutput

    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(5, 250, (PROMPT,), generator=g).tolist()
    response = torch.randint(5, 250, (length,), generator=g).tolist()
    b = collate([AgentLoopOutput(prompt, response, [1] * length)], pad_token_id=0, max_prompt_length=PROMPT,
                max_response_length=length)
    b["advantages"] = torch.randn(1, length, generator=g)
    return b


def loss_fn(out, mb, scale):
    """Token-mean policy gradient with an entropy term (so the entropy is computed and differentiated too)."""
    from polyrl.algorithms import agg_loss

    per_token = -out["log_probs"] * mb["advantages"] - 1e-3 * out["entropy"]
    return agg_loss(per_token, mb["response_mask"], "token-mean", loss_scale=scale), {}


def _rss_gib() -> float:
    """This process's resident set now (``/proc/self/statm``), GiB."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**30


def worker(rank: int, world: int, port: str, model: str, length: int, chunk: int, out: str) -> None:
    """One rank: build the engine, a short warm-up step, then one timed step at ``length``; rank 0 writes JSON."""
    import resource

    import torch.distributed as dist

    from polyrl.config.roles import EngineRoleConfig, ModelConfig, OptimConfig
    from polyrl.platforms import detect_platform
    from polyrl_engine_fsdp.config import FSDPConfig
    from polyrl_engine_fsdp.engine import FSDPEngine

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    platform = detect_platform()
    cuda = platform.device_type != "cpu"
    if cuda:
        platform.set_device(rank)
    dist.init_process_group(platform.dist_backend, rank=rank, world_size=world)
    cfg = EngineRoleConfig(model=ModelConfig(path=model, gradient_checkpointing=True), optim=OptimConfig(lr=1e-6),
                           micro_batch_size=1, logits_chunk_size=chunk,
                           plugin_config=FSDPConfig(ulysses_sequence_parallel_size=world))
    engine = FSDPEngine(cfg, role="actor", platform=platform)
    engine.train_batch(one_sequence(128, seed=1), loss_fn)  # warm-up: optimizer state exists, kernels are loaded
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() / 2**30
    else:
        base = _rss_gib()
    batch = one_sequence(length)
    dist.barrier()
    start, cpu = time.perf_counter(), time.process_time()
    engine.train_batch(batch, loss_fn)
    platform.synchronize()
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    if cuda:
        peak = torch.cuda.max_memory_allocated() / 2**30
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    found: list = [None] * world
    dist.all_gather_object(found, {"peak_gib": peak, "base_gib": base, "seconds": seconds, "cpu_seconds": cpu})
    if rank == 0:
        Path(out).write_text(json.dumps(found))
    dist.destroy_process_group()


def measure(model: Path, length: int, config: str, folder: Path) -> dict | str:
    """One configuration at one length, in fresh processes: per-rank peaks and the step's seconds (or what failed)."""
    from polyrl.distributed import free_port

    sp, chunk = CONFIGS[config]
    out = folder / f"{config}_{length}.json"
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(r), str(sp), port, str(model), str(length),
                               str(chunk), str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for r in range(sp)]
    errors = [p.communicate()[1] for p in procs]
    if any(p.returncode for p in procs):
        code = next(p.returncode for p in procs if p.returncode)
        last = next((e.strip().splitlines()[-1] for e in errors if e.strip()), "")
        return f"failed (exit {code}{': ' + last[:80] if last else ''})"
    ranks = json.loads(out.read_text())
    return {"seconds": max(r["seconds"] for r in ranks), "cpu_seconds": max(r["cpu_seconds"] for r in ranks),
            "peak_gib": max(r["peak_gib"] for r in ranks),
            "step_gib": max(r["peak_gib"] - r["base_gib"] for r in ranks), "ranks": len(ranks),
            "load": os.getloadavg()[0]}


def machine_memory_gib() -> float:
    """Device memory of one GPU, or the host's RAM."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory / 2**30
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) / 2**20
    return float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="1024,2048,4096,8192,16384", help="response lengths, comma-separated")
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"of {', '.join(CONFIGS)}")
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--worker", nargs=7, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        r, w, port, model, length, chunk, out = args.worker
        worker(int(r), int(w), port, model, int(length), int(chunk), out)
        return
    lengths = [int(x) for x in args.lengths.split(",")]
    configs = args.configs.split(",")
    folder = Path(tempfile.mkdtemp(prefix="bench_long_"))
    model = make_model(folder / "model", args.vocab, max(lengths) + PROMPT + 64)
    print(f"small tiny-Qwen2, vocab {args.vocab}, gradient checkpointing; one sequence of {PROMPT} prompt tokens + "
          f"the response; one update step after a warm-up")
    print(f"{'response':>9} {'config':>14} {'s/step':>8} {'CPU s/rank':>10} {'peak GiB/rank':>14} "
          f"{'step GiB/rank':>14} {'load':>5}")
    largest = 0.0
    results: dict = {}
    for length in lengths:
        for config in configs:
            found = measure(model, length, config, folder)
            results[(length, config)] = found
            if isinstance(found, str):
                print(f"{length:>9} {config:>14} {found}", flush=True)
                continue
            largest = max(largest, found["peak_gib"] * (found["ranks"] if not torch.cuda.is_available() else 1))
            print(f"{length:>9} {config:>14} {found['seconds']:>8.1f} {found['cpu_seconds']:>10.1f} "
                  f"{found['peak_gib']:>14.2f} {found['step_gib']:>14.2f} {found['load']:>5.1f}", flush=True)
    total = machine_memory_gib()
    print(f"machine memory {total:.1f} GiB ({'one GPU' if torch.cuda.is_available() else 'RAM, all ranks together'}); "
          f"the largest configuration used {largest:.2f} GiB, {100 * largest / total:.0f}% of it")


if __name__ == "__main__":
    main()
