"""Runs an FSDP engine scenario in a process of a gloo group (spawned by the tests)."""

from __future__ import annotations

import os
import sys

import torch


def batch(seed: int = 0, rows: int = 8):
    from polyrl.agent_loops import collate
    from polyrl.protocols import AgentLoopOutput

    g = torch.Generator().manual_seed(seed)
    outs = []
    for _ in range(rows):
        p = int(torch.randint(2, 9, (1,), generator=g))
        r = int(torch.randint(1, 10, (1,), generator=g))
        outs.append(AgentLoopOutput(prompt_ids=torch.randint(5, 200, (p,), generator=g).tolist(),
                                    response_ids=torch.randint(5, 200, (r,), generator=g).tolist(),
                                    response_mask=[1] * r))
    b = collate(outs, pad_token_id=0, max_prompt_length=8, max_response_length=10)
    b["advantages"] = torch.randn(rows, 1, generator=g).expand(rows, 10).contiguous()
    b["old_log_probs"] = torch.zeros(rows, 10)
    return b


def loss_fn(out, mb, scale):
    from polyrl.algorithms import agg_loss

    loss = agg_loss(-out["log_probs"] * mb["advantages"], mb["response_mask"], "token-mean", loss_scale=scale)
    return loss, {"loss": float(loss.detach())}


def make_engine(model_dir: str, **kw):
    from polyrl.config.roles import EngineRoleConfig, ModelConfig, OptimConfig
    from polyrl_engine_fsdp.engine import FSDPEngine

    # eps=1e-6: attention's k_proj bias has an exactly-zero true gradient, and with eps=1e-8 Adam turns its
    # float-rounding noise (which depends on the reduction order, i.e. the world size) into lr-sized steps.
    cfg = EngineRoleConfig(model=ModelConfig(path=model_dir), optim=OptimConfig(lr=kw.pop("lr", 1e-3), grad_clip=1.0, eps=1e-6),
                           micro_batch_size=kw.pop("micro_batch_size", 2), **kw)
    return FSDPEngine(cfg, role="actor")


def main() -> None:
    rank, world, port, model_dir, out, scenario = (int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4],
                                                  sys.argv[5], sys.argv[6])
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    # a small lr: Adam normalises away gradient scale, so the gradient norms (compared to 1e-6 relative)
    # are what catches a wrong reduction; the weights then agree to 1e-6 absolute
    engine = make_engine(model_dir, lr=1e-4)
    results = {"grad_norm": [], "loss": []}
    for step in range(3):
        full = batch(seed=step)
        shard = full[rank * (8 // world) : (rank + 1) * (8 // world)]
        m = engine.train_batch(shard, loss_fn)
        results["grad_norm"].append(m["actor/grad_norm"])
        results["loss"].append(m["loss"])
        if scenario == "resume" and step == 0:
            engine.save_checkpoint(os.path.join(out, "ckpt"))
            engine = make_engine(model_dir, lr=1e-4)
            engine.load_checkpoint(os.path.join(out, "ckpt"))
    weights = {n: t.clone() for bucket in engine.weights_for_rollout(1 << 14) for n, t in bucket}
    if rank == 0:
        torch.save({"results": results, "weights": weights}, os.path.join(out, f"result_{world}.pt"))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
