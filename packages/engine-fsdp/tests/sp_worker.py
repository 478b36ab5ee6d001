"""Runs the Ulysses sequence-parallel scenarios in one process of a gloo group (spawned by test_ulysses.py).

``python sp_worker.py RANK WORLD PORT MODEL_DIR OUT SP`` trains, on the same data, an actor and a critic with
padded micro-batches, an actor with packed dynamic micro-batches, and a LoRA actor (packed), each with
``fsdp.ulysses_sequence_parallel_size=SP``, and rank 0 writes what it measured to ``OUT/sp_WORLD_SP.pt``: the
losses, gradient norms, log-probs / entropies / values and the final weights, which the test compares across
layouts (SP=1 on one rank is the reference).
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

#: token budget per rank of the dynamic scenario (a group of sp ranks packs sp times as many)
BUDGET = 24


def _vloss(out, mb, scale):
    loss = (((out["values"] - mb["returns"]) ** 2) * mb["response_mask"]).sum() / scale.batch_num_tokens * scale.dp_size
    return loss, {"loss": float(loss.detach())}


def run(name: str, engine, loss, steps: int, world: int, sp: int, results: dict):
    """``steps`` updates on this rank's data-parallel shard of fixed batches; what every rank of the world agrees on."""
    from dist_worker import batch

    dp = world // sp
    found: dict = {"grad_norm": [], "loss": [], "layout": (engine.dp_rank, engine.dp_size, engine.collects_output)}
    for step in range(steps):
        full = batch(seed=10 + step, rows=8)
        full["returns"] = torch.randn(8, 10, generator=torch.Generator().manual_seed(step))
        shard = full[engine.dp_rank * (8 // dp) : (engine.dp_rank + 1) * (8 // dp)]
        if step == 0:  # before any update: what infer_batch returns (the collector's is what the driver keeps)
            out = engine.infer_batch(shard, compute_entropy=engine.model_type != "value")
            found["infer"] = {k: _gather_rows(v, engine) for k, v in out.items()}
        splits = [r for r in engine.split_micro_batches(shard, engine.config.use_dynamic_bsz) if r is not None]
        found.setdefault("micro_batch_tokens", []).append(
            [int(shard["attention_mask"][rows].sum()) for rows in splits])
        m = engine.train_batch(shard, loss)
        found["grad_norm"].append(m[f"{'critic' if engine.model_type == 'value' else 'actor'}/grad_norm"])
        # the metric is this rank's mean over its micro-batches; the mini-batch loss is the sum over the data-parallel
        # groups (each sequence-parallel rank holds its group's copy) divided by dp
        total = torch.tensor([m["loss"] * len(splits)], dtype=torch.float64)
        dist.all_reduce(total)
        found["loss"].append(float(total) / sp / dp)
    found["weights"] = {n: t.clone() for bucket in engine.weights_for_rollout(1 << 14) for n, t in bucket}
    results[name] = found
    return engine


def export_and_resume(engine, make, out: str, found: dict) -> None:
    """``export_hf`` and a checkpoint round trip of a trained sequence-parallel engine: the exported folder gives the
    engine's log-probs in plain transformers, and a fresh engine loading the checkpoint gives them too."""
    from dist_worker import batch
    from transformers import AutoModelForCausalLM

    b = batch(seed=20, rows=8)
    shard = b[engine.dp_rank * (8 // engine.dp_size) : (engine.dp_rank + 1) * (8 // engine.dp_size)]
    mine = engine.infer_batch(shard)["log_probs"]
    engine.export_hf(os.path.join(out, "export"))
    engine.save_checkpoint(os.path.join(out, "ckpt"))
    again = make()
    again.load_checkpoint(os.path.join(out, "ckpt"))
    found["resume_err"] = float((again.infer_batch(shard)["log_probs"] - mine).abs().max())
    model = AutoModelForCausalLM.from_pretrained(os.path.join(out, "export"))
    errs = []
    for row in range(shard.batch_size[0]):
        ids = shard["input_ids"][row][shard["attention_mask"][row].bool()][None]
        n = int(shard["response_mask"][row].sum())
        with torch.no_grad():
            ref = torch.log_softmax(model(ids).logits[0, -n - 1 : -1], -1).gather(-1, ids[0, -n:, None]).squeeze(-1)
        errs.append(float((mine[row, :n] - ref).abs().max()))
    found["export_err"] = max(errs)
    found["export_attn"] = model.config._attn_implementation


def _gather_rows(value: torch.Tensor, engine) -> torch.Tensor:
    """The rows of every data-parallel group, in order, from the groups' collecting ranks (what dispatch returns)."""
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, (engine.dp_rank, engine.collects_output, value))
    return torch.cat([v for _, c, v in sorted((p for p in parts if p[1]), key=lambda p: p[0])])


def main() -> None:
    rank, world, port, model_dir, out, sp = (int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5],
                                            int(sys.argv[6]))
    wanted = set(sys.argv[7].split(",")) if len(sys.argv) > 7 else {"actor_padded", "critic_padded", "actor_packed",
                                                                    "lora_packed"}
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    # SP_WORKER_DEVICE=cuda (the GPU-marked test): nccl, one GPU per rank, SP_WORKER_ATTN, packed scenarios only
    cuda = os.environ.get("SP_WORKER_DEVICE") == "cuda"
    platform = None
    if cuda:
        from polyrl.platforms import CUDAPlatform

        platform = CUDAPlatform()
        platform.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    from dist_worker import loss_fn, make_engine

    from polyrl.config.roles import LoRAConfig
    from polyrl_engine_fsdp.config import FSDPConfig

    def engine(*args, **kw):
        attn = os.environ.get("SP_WORKER_ATTN", "sdpa")
        return make_engine(model_dir, *args, platform=platform, attn_implementation=attn,
                           plugin_config=FSDPConfig(ulysses_sequence_parallel_size=sp), **kw)

    # a small lr: Adam normalises away the gradients' scale, so float-rounding differences in tiny gradients would
    # otherwise become lr-sized steps; the gradient norms (compared to 1e-5 relative) catch a wrong reduction
    packed = {"use_remove_padding": True, "use_dynamic_bsz": True, "max_token_len_per_gpu": BUDGET}
    lora = LoRAConfig(rank=4, alpha=8, target_modules=["q_proj", "v_proj", "o_proj"])
    scenarios = {
        "actor_padded": lambda: (engine(lr=1e-4, micro_batch_size=3), loss_fn),
        "critic_padded": lambda: (engine("critic", "value", lr=1e-4, micro_batch_size=3), _vloss),
        "actor_packed": lambda: (engine(lr=1e-4, **packed), loss_fn),
        "lora_packed": lambda: (engine(lr=1e-3, lora=lora, **packed), loss_fn),
    }
    if cuda:  # flash attention runs on packed sequences only
        wanted -= {"actor_padded", "critic_padded"}
    results: dict = {}
    for name in scenarios:
        if name in wanted:
            trained = run(name, *scenarios[name](), 2, world, sp, results)
            if name == "actor_padded":
                export_and_resume(trained, lambda: scenarios["actor_padded"]()[0], out, results[name])
    if rank == 0:
        torch.save(results, os.path.join(out, f"sp_{world}_{sp}.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    from polyrl.distributed import exit_process

    exit_process(0)  # no interpreter teardown: a rare gloo abort at exit after the work is done
