"""Runs an FSDP engine scenario in a process of a gloo group (spawned by the tests)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch


def run_ranks(script: str, world: int, args: list[str], result: Path, hang_hint: str = "") -> dict:
    """Run ``script RANK WORLD PORT *args`` in ``world`` processes of a gloo group (this folder on their path) and
    return what they saved at ``result``; a port taken before rank 0 bound it is retried with another. Raises with
    every failed rank's stderr (``hang_hint`` is added to a rank that timed out)."""
    import subprocess

    from polyrl.distributed import free_port

    here = Path(__file__).parent
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(here), os.environ.get("PYTHONPATH", "")) if p))
    for _attempt in range(3):  # the free port can be taken by another process before rank 0 binds it
        port = str(free_port())
        procs = [subprocess.Popen([sys.executable, str(here / script), str(r), str(world), port, *args], env=env,
                                  stderr=subprocess.PIPE, text=True)
                 for r in range(world)]
        errs = []
        for p in procs:
            try:
                errs.append(p.communicate(timeout=300)[1])
            except subprocess.TimeoutExpired:
                p.kill()
                errs.append(p.communicate()[1] + f"\n(timed out{hang_hint})")
        if all(p.returncode == 0 for p in procs):
            return torch.load(result)
        if not any("address already in use" in e.lower() for e in errs):
            break
    raise AssertionError("\n".join(f"rank {r} exited {p.returncode}:\n{e[-3000:]}"
                                    for r, (p, e) in enumerate(zip(procs, errs)) if p.returncode))

def batch(seed: int = 0, rows: int = 8, group: int = 1):
    """``rows`` random samples; consecutive runs of ``group`` rows share a prompt (GRPO's ``n`` samples)."""
    from polyrl.agent_loops import collate
    from polyrl.protocols import AgentLoopOutput

    g = torch.Generator().manual_seed(seed)
    outs = []
    for i in range(rows):
        if i % group == 0:
            p = int(torch.randint(2, 9, (1,), generator=g))
            prompt = torch.randint(5, 200, (p,), generator=g).tolist()
        r = int(torch.randint(1, 10, (1,), generator=g))
        outs.append(AgentLoopOutput(prompt_ids=prompt, response_ids=torch.randint(5, 200, (r,), generator=g).tolist(),
                                    response_mask=[1] * r))
    b = collate(outs, pad_token_id=0, max_prompt_length=8, max_response_length=10)
    b["advantages"] = torch.randn(rows, 1, generator=g).expand(rows, 10).contiguous()
    b["old_log_probs"] = torch.zeros(rows, 10)
    return b


def loss_fn(out, mb, scale):
    """Policy-gradient token mean, normalised by the mini-batch's global token count (as agg_loss does)."""
    loss = (-out["log_probs"] * mb["advantages"] * mb["response_mask"]).sum() / scale.batch_num_tokens * scale.dp_size
    return loss, {"loss": float(loss.detach())}


def make_engine(model_dir: str, role: str = "actor", model_type: str = "causal_lm", platform=None, **kw):
    """A small-lr fsdp engine over ``model_dir``; ``kw`` are EngineRoleConfig fields. CPU unless ``platform``."""
    from polyrl.config.roles import EngineRoleConfig, ModelConfig, OptimConfig
    from polyrl.platforms import CPUPlatform
    from polyrl_engine_fsdp.engine import FSDPEngine

    # eps=1e-2: the tests compare weights after a step taken two ways (world sizes, chunkings, shared prompts),
    # whose gradients agree to float rounding (~1e-8) only. Adam's first step is lr * g / (|g| + eps), so a
    # gradient entry near eps turns that rounding into a weight difference of up to lr / eps times it: with
    # eps=1e-6 that was ~1e-5 (over the tests' 1e-6) wherever an entry was ~1e-7..1e-6, which depends on the CPU's
    # kernels (it failed on an AMD EPYC, passed on Intel Xeons). With eps=1e-2 the step is close to linear in g
    # (lr / eps = 0.1), and a real gradient error (1e-4 and up) still moves weights by far more than 1e-6.
    optim = kw.pop("optim", None) or OptimConfig(lr=kw.pop("lr", 1e-3), grad_clip=1.0, eps=1e-2)
    model = ModelConfig(path=model_dir, **{k: kw.pop(k) for k in ("lora", "attn_implementation") if k in kw})
    cfg = EngineRoleConfig(model=model, optim=optim,
                           micro_batch_size=kw.pop("micro_batch_size", 2), **kw)
    return FSDPEngine(cfg, role=role, model_type=model_type, platform=platform or CPUPlatform())


def cuda_checks(model_dir: str, out: str) -> None:
    """The engine on one CUDA device with nccl; writes what it measured to ``out/cuda.json``."""
    import json

    from transformers import AutoModelForCausalLM

    from polyrl.platforms import CUDAPlatform
    from polyrl_engine_fsdp.config import FSDPConfig

    platform = CUDAPlatform()
    platform.set_device(0)
    torch.distributed.init_process_group("nccl", rank=0, world_size=1)
    b = batch(seed=0)
    found: dict = {}
    engine = make_engine(model_dir, platform=platform)
    found["device"] = str(next(engine.module.parameters()).device)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    ids = b["input_ids"][0][b["attention_mask"][0].bool()][None]
    n = int(b["response_mask"][0].sum())
    with torch.no_grad():
        ref = torch.log_softmax(model(ids).logits[0, -n - 1 : -1], -1).gather(-1, ids[0, -n:, None]).squeeze(-1)
    before = engine.infer_batch(b)["log_probs"]
    found["max_err_vs_cpu_transformers"] = float((before[0, :n] - ref).abs().max())
    m = engine.train_batch(b, loss_fn)
    found["grad_norm"] = m["actor/grad_norm"]
    trained = engine.infer_batch(b)["log_probs"]
    found["changed"] = not torch.allclose(before, trained)
    engine.save_checkpoint(os.path.join(out, "ckpt"))
    engine.train_batch(b, loss_fn)
    engine.load_checkpoint(os.path.join(out, "ckpt"))
    found["reload_err"] = float((engine.infer_batch(b)["log_probs"] - trained).abs().max())
    sent = [t for bucket in engine.weights_for_rollout(1 << 16) for _, t in bucket]
    found["sent_on_device"] = all(t.is_cuda for t in sent)
    torch.cuda.synchronize()
    on = torch.cuda.memory_allocated()
    engine.offload()
    found["offload_freed_bytes"] = on - torch.cuda.memory_allocated()
    engine.onload()
    found["onload_err"] = float((engine.infer_batch(b)["log_probs"] - trained).abs().max())
    engine.train_batch(b, loss_fn)
    mixed = make_engine(model_dir, platform=platform, use_dynamic_bsz=True, use_remove_padding=True,
                        max_token_len_per_gpu=40, plugin_config=FSDPConfig(param_dtype="bfloat16", optimizer_offload=True))
    m = mixed.train_batch(b, loss_fn)
    found["bf16_packed_grad_norm"] = m["actor/grad_norm"]
    found["bf16_err_vs_fp32"] = float((mixed.infer_batch(b)["log_probs"] - trained).abs().max())
    state_devices = {str(v.device) for st in mixed.optimizer.state.values() for v in st.values() if torch.is_tensor(v)}
    found["offloaded_optimizer_state_devices"] = sorted(state_devices)
    with open(os.path.join(out, "cuda.json"), "w") as f:
        json.dump(found, f)
    torch.distributed.destroy_process_group()


def main() -> None:
    rank, world, port, model_dir, out, scenario = (int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4],
                                                  sys.argv[5], sys.argv[6])
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    if scenario == "cuda":
        cuda_checks(model_dir, out)
        return
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    # a small lr: Adam normalises away gradient scale, so the gradient norms (compared to 1e-6 relative)
    # are what catches a wrong reduction; the weights then agree to 1e-6 absolute
    # "dynamic": token-budget micro-batches over packed sequences; the budget gives the ranks different
    # micro-batch counts, so the padding micro-batches that keep collectives in step are exercised
    # "replicate": fsdp_size=1, a plain module per rank with all-reduced gradients
    # "grouped": rows share prompts in runs of 3 (micro-batches of 2 then hold one or two distinct prompts);
    # "noshare" turns the shared-prompt forward off, so the two are compared
    # "nooverlap": the replicated layout's gradient all-reduce after backward instead of during it;
    # "buckets": 4 KiB gradient buckets (dozens on the tiny model), "grads": record the averaged gradients
    parts = set(scenario.split("-"))
    if "buckets" in parts:
        import polyrl_engine_fsdp.grad_reduce as grad_reduce

        grad_reduce.DEFAULT_BUCKET_BYTES = 4 << 10
    kw: dict = {"use_dynamic_bsz": True, "use_remove_padding": True, "max_token_len_per_gpu": 20} if "dynamic" in parts else {}
    from polyrl_engine_fsdp.config import FSDPConfig

    kw["plugin_config"] = FSDPConfig(fsdp_size=1 if "replicate" in parts else -1, shared_prompt="noshare" not in parts,
                                     overlap_grad_reduce="nooverlap" not in parts, shared_prompt_min_tokens=0)
    engine = make_engine(model_dir, lr=1e-4, **kw)
    results: dict = {"grad_norm": [], "loss": [], "replicated": engine.replicated, "grads": [], "overlapped": []}
    if "grads" in parts:  # the gradients the optimizer steps on (after the all-reduce, before clipping changes them)
        clip = torch.nn.utils.clip_grad_norm_

        def recording_clip(params, *args, **kwargs):
            params = list(params)
            results["grads"].append([p.grad.clone() for p in params])
            reducer = engine._grad_reducer()
            results["overlapped"].append(reducer.launched_in_backward if reducer is not None else 0)
            return clip(params, *args, **kwargs)

        torch.nn.utils.clip_grad_norm_ = recording_clip
    for step in range(3):
        full = batch(seed=step, group=3 if "grouped" in parts else 1)
        shard = full[rank * (8 // world) : (rank + 1) * (8 // world)]
        m = engine.train_batch(shard, loss_fn)
        results["grad_norm"].append(m["actor/grad_norm"])
        # the metric is this rank's mean over its micro-batches; the mini-batch loss is the sum over all / dp
        real = [r for r in engine.split_micro_batches(shard, engine.config.use_dynamic_bsz) if r is not None]
        total = torch.tensor([m["loss"] * len(real)], dtype=torch.float64)
        torch.distributed.all_reduce(total)
        results["loss"].append(float(total) / world)
        counts = [None] * world
        torch.distributed.all_gather_object(counts, len(real))
        results.setdefault("micro_batches", []).append(counts)
        if "resume" in parts and step == 0:
            engine.save_checkpoint(os.path.join(out, "ckpt"))
            engine = make_engine(model_dir, lr=1e-4, **kw)
            engine.load_checkpoint(os.path.join(out, "ckpt"))
    weights = {n: t.clone() for bucket in engine.weights_for_rollout(1 << 14) for n, t in bucket}
    if "replicate" in parts:  # every rank holds the whole model
        local = {n: p.to_local() if hasattr(p, "to_local") else p for n, p in engine.module.named_parameters()}
        results["local_equals_full"] = all(v.shape == getattr(p, "shape", v.shape) for n, p in
                                           engine.module.named_parameters() for v in [local[n]])
    if rank == 0:
        torch.save({"results": results, "weights": weights}, os.path.join(out, f"result_{world}_{scenario}.pt"))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
    from polyrl.distributed import exit_process

    exit_process(0)  # no interpreter teardown: a rare gloo abort at exit after the work is done
