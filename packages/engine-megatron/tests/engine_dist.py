"""Runs megatron engine scenarios in one process of a gloo group (spawned by test_megatron_engine.py).

``python engine_dist.py RANK WORLD PORT MODEL_DIR OUT SCENARIO[,SCENARIO...]``. Every scenario writes
``OUT/<scenario>_rank<RANK>.pt``. Scenarios run one after the other in the same group, each with its own
megatron parallel state, so one process start (the slow part) serves several layouts.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

ROWS = 8


def batch(seed: int = 0, rows: int = ROWS):
    """``rows`` random samples in pairs sharing a prompt (GRPO's ``n`` samples), with a masked (tool) token."""
    from polyrl.agent_loops import collate
    from polyrl.protocols import AgentLoopOutput

    g = torch.Generator().manual_seed(seed)
    outs = []
    for i in range(rows):
        if i % 2 == 0:
            p = int(torch.randint(2, 9, (1,), generator=g))
            prompt = torch.randint(5, 250, (p,), generator=g).tolist()
        r = int(torch.randint(2, 10, (1,), generator=g))
        mask = [1] * r
        if i == 3:
            mask[1] = 0
        outs.append(AgentLoopOutput(prompt_ids=prompt, response_ids=torch.randint(5, 250, (r,), generator=g).tolist(),
                                    response_mask=mask))
    b = collate(outs, pad_token_id=0, max_prompt_length=8, max_response_length=10)
    b["advantages"] = torch.randn(rows, 1, generator=g).expand(rows, 10).contiguous()
    b["returns"] = torch.randn(rows, 1, generator=g).expand(rows, 10).contiguous()
    return b


def loss_fn(out, mb, scale):
    """Policy-gradient token mean plus a small entropy bonus, normalised by the global token count."""
    mask = mb["response_mask"].float()
    pg = (-out["log_probs"] * mb["advantages"] * mask).sum() / scale.batch_num_tokens * scale.dp_size
    ent = (out["entropy"] * mask).sum() / scale.batch_num_tokens * scale.dp_size
    loss = pg - 0.01 * ent
    return loss, {"loss": float(loss.detach())}


def value_loss_fn(out, mb, scale):
    mask = mb["response_mask"].float()
    loss = (((out["values"] - mb["returns"]) ** 2) * mask).sum() / scale.batch_num_tokens * scale.dp_size
    return loss, {"vf_loss": float(loss.detach())}


def role_config(model_dir: str, *, tp: int = 1, pp: int = 1, **kw):
    """An actor role config over ``model_dir`` with a megatron block; ``kw`` are EngineRoleConfig fields."""
    from polyrl_engine_megatron.config import MegatronConfig

    from polyrl.config.roles import EngineRoleConfig, ModelConfig, OptimConfig

    block = MegatronConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                           sequence_parallel=kw.pop("sequence_parallel", False),
                           use_distributed_optimizer=kw.pop("use_distributed_optimizer", False))
    # weight_decay=0.1 on every parameter (as both engines apply it); eps=1e-6 keeps Adam from turning
    # float-rounding noise of exactly-zero gradients into lr-sized steps
    optim = OptimConfig(lr=kw.pop("lr", 1e-3), grad_clip=kw.pop("grad_clip", 1.0), eps=1e-6, weight_decay=0.1)
    return EngineRoleConfig(engine="megatron", model=ModelConfig(path=model_dir), optim=optim,
                            micro_batch_size=kw.pop("micro_batch_size", 2), plugin_config=block, **kw)


def make_engine(model_dir: str, role: str = "actor", model_type: str = "causal_lm", *, tp: int = 1, pp: int = 1,
                **kw):
    from polyrl_engine_megatron.engine import MegatronEngine

    from polyrl.platforms import CPUPlatform

    return MegatronEngine(role_config(model_dir, tp=tp, pp=pp, **kw), role=role, model_type=model_type,
                          platform=CPUPlatform())


def _shard(engine, b):
    """This rank's data-parallel shard of ``b`` (what the worker group's dispatch gives it)."""
    from polyrl.batch import split

    return split(b, engine.dp_size)[engine.dp_rank] if engine.dp_size > 1 else b


def _full_weights(engine) -> dict[str, torch.Tensor]:
    return {n: t.detach().cpu().clone() for bucket in engine.weights_for_rollout(1 << 16) for n, t in bucket}


def train_step(model_dir: str, layout: str, **kw) -> dict:
    """One infer + train step + infer in ``layout`` (``tp2``, ``pp2``, ``dp2``, ``tp1``, ``tp2sp``, ``dp2dist``)."""
    tp = 2 if layout.startswith("tp2") else 1
    pp = 2 if layout.startswith("pp2") else 1
    extra = dict(kw)
    if layout.endswith("sp"):
        extra["sequence_parallel"] = True
    if layout.endswith("dist"):
        extra["use_distributed_optimizer"] = True
    engine = make_engine(model_dir, tp=tp, pp=pp, **extra)
    b = batch()
    shard = _shard(engine, b)
    before = engine.infer_batch(shard, compute_entropy=True, temperature=0.9)
    metrics = engine.train_batch(shard, loss_fn, temperature=0.9)
    after = engine.infer_batch(shard)
    from polyrl_engine_megatron.model import SequenceParallelRMSNorm

    sp_norms = sum(isinstance(m, SequenceParallelRMSNorm) for m in engine.inner.modules())
    return {"metrics": metrics, "before": before.to_dict(), "after": after.to_dict(), "dp_rank": engine.dp_rank,
            "dp_size": engine.dp_size, "collects": engine.collects_output, "weights": _full_weights(engine),
            "sequence_parallel": bool(engine.tcfg.sequence_parallel), "sp_norms": sp_norms}


def qwen3_model(out: Path) -> str:
    """A tiny Qwen3 (query/key norms, head_dim 24 != hidden / heads) written by rank 0 into ``out/qwen3``."""
    folder = out / "qwen3"
    if torch.distributed.get_rank() == 0 and not (folder / "config.json").exists():
        from transformers import AutoModelForCausalLM, Qwen3Config

        config = Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=2, num_key_value_heads=2, head_dim=24, max_position_embeddings=256,
                             tie_word_embeddings=False)
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    torch.distributed.barrier()
    return str(folder)


def critic_step(model_dir: str, layout: str) -> dict:
    """The value model: values, one step of the value loss, values again, in ``layout`` (``tp1``, ``tp2sp``)."""
    extra = {"sequence_parallel": True} if layout.endswith("sp") else {}
    engine = make_engine(model_dir, role="critic", model_type="value", tp=2 if layout.startswith("tp2") else 1,
                         lr=1e-2, **extra)
    b = batch()
    before = engine.infer_batch(b)
    metrics = engine.train_batch(b, value_loss_fn)
    after = engine.infer_batch(b)
    return {"metrics": metrics, "before": before.to_dict(), "after": after.to_dict(), "weights": _full_weights(engine)}


def checkpoint_save(model_dir: str, layout: str, out: Path) -> dict:
    """Train one step in ``layout`` and save; then one more step (what a resumed run must reproduce)."""
    tp, pp = (2, 1) if layout == "tp2" else (1, 2) if layout == "pp2" else (1, 1)
    engine = make_engine(model_dir, tp=tp, pp=pp)
    b = batch()
    engine.train_batch(_shard(engine, b), loss_fn)
    engine.save_checkpoint(str(out / "ckpt"))
    saved = engine.infer_batch(_shard(engine, b))
    second = engine.train_batch(_shard(engine, b), loss_fn)
    return {"saved": saved.to_dict(), "second": second, "after_second": engine.infer_batch(_shard(engine, b)).to_dict()}


def checkpoint_load(model_dir: str, layout: str, out: Path) -> dict:
    tp, pp = (2, 1) if layout == "tp2" else (1, 2) if layout == "pp2" else (1, 1)
    engine = make_engine(model_dir, tp=tp, pp=pp)
    b = batch()
    engine.load_checkpoint(str(out / "ckpt"))
    loaded = engine.infer_batch(_shard(engine, b))
    second = engine.train_batch(_shard(engine, b), loss_fn)
    return {"loaded": loaded.to_dict(), "second": second, "after_second": engine.infer_batch(_shard(engine, b)).to_dict(),
            "step": engine.step}


def vocab_parallel(rank: int, world: int) -> dict:
    """Log-probs, entropy and their gradients over a vocabulary split in ``world`` slices."""
    from polyrl_engine_megatron.vocab_parallel import vocab_parallel_log_probs

    g = torch.Generator().manual_seed(0)
    full = torch.randn(6, 10, generator=g) * 3
    targets = torch.tensor([0, 9, 4, 5, 2, 7])
    width = full.shape[1] // world
    local = full[:, rank * width : (rank + 1) * width].clone().requires_grad_(True)
    lp, ent = vocab_parallel_log_probs(local, targets, vocab_start=rank * width, group=torch.distributed.group.WORLD,
                                       temperature=0.7, compute_entropy=True)
    (lp.sum() + 0.5 * ent.sum()).backward()
    return {"log_probs": lp.detach(), "entropy": ent.detach(), "grad": local.grad, "full": full, "targets": targets}


def vocab_products(rank: int, world: int) -> dict:
    """The forward products (sum of p^2, top-k, gathered log-probs) over a vocabulary split in ``world`` slices,
    with the gradients of the differentiable ones."""
    from polyrl_engine_megatron.vocab_parallel import vocab_parallel_products

    g = torch.Generator().manual_seed(0)
    full = torch.randn(6, 10, generator=g) * 3
    ids = torch.randint(0, 10, (6, 3), generator=g)
    width = full.shape[1] // world
    local = full[:, rank * width : (rank + 1) * width].clone().requires_grad_(True)
    out = vocab_parallel_products(local, vocab_start=rank * width, group=torch.distributed.group.WORLD,
                                  temperature=0.7, sum_pi_squared=True, top_k=4, gather_ids=ids)
    (out["sum_pi_squared"].sum() + out["gathered_log_probs"].sum()).backward()
    return {**{k: v.detach() for k, v in out.items()}, "grad": local.grad, "full": full, "ids": ids}


def products_step(model_dir: str, layout: str) -> dict:
    """``infer_batch`` with every forward product in ``layout`` (``tp1``, ``tp2``), and one ``train_batch`` whose
    loss reads the gathered log-probs."""
    from polyrl.protocols import ForwardProducts

    engine = make_engine(model_dir, tp=2 if layout == "tp2" else 1)
    b = batch(seed=4)
    b["other_ids"] = torch.randint(0, 250, (b.batch_size[0], 10, 3), generator=torch.Generator().manual_seed(1))
    products = ForwardProducts(sum_pi_squared=True, top_k=4, gather_ids="other_ids")
    out = engine.infer_batch(b, temperature=0.7, products=products)

    def gathered_loss(o, mb, scale):
        loss = -(o["gathered_log_probs"].sum(-1) * mb["response_mask"]).sum() / scale.batch_num_tokens
        return loss, {"loss": float(loss.detach())}

    metrics = engine.train_batch(b, gathered_loss, products=ForwardProducts(gather_ids="other_ids"))
    return {"out": out.to_dict(), "batch": b.select("input_ids", "attention_mask", "response_mask",
                                                    "other_ids").to_dict(), "metrics": metrics}


def main() -> None:
    rank, world, port, model_dir, out, scenarios = sys.argv[1:7]
    rank, world, out = int(rank), int(world), Path(out)
    from polyrl.distributed import init_distributed

    init_distributed("gloo", rank, world, "127.0.0.1", int(port))
    from polyrl_engine_megatron.parallel import destroy_parallel_state

    for scenario in scenarios.split(","):
        name, _, arg = scenario.partition(":")
        if name == "train":
            result = train_step(model_dir, arg)
        elif name == "qwen3":
            result = train_step(qwen3_model(out), arg)
        elif name == "critic":
            result = critic_step(model_dir, arg)
        elif name == "save":
            result = checkpoint_save(model_dir, arg, out)
        elif name == "load":
            result = checkpoint_load(model_dir, arg, out)
        elif name == "vocab":
            result = vocab_parallel(rank, world)
        elif name == "vocabprod":
            result = vocab_products(rank, world)
        elif name == "products":
            result = products_step(model_dir, arg)
        else:
            raise SystemExit(f"unknown scenario {scenario}")
        torch.save(result, out / f"{scenario.replace(':', '_')}_rank{rank}.pt")
        destroy_parallel_state()
        torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
