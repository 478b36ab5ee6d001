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


#: MegatronConfig keys ``role_config`` accepts besides tp and pp
_BLOCK_KEYS = ("sequence_parallel", "use_distributed_optimizer", "context_parallel_size", "expert_model_parallel_size",
               "expert_tensor_parallel_size", "moe_aux_loss_coeff", "moe_token_dispatcher_type", "activation_offload",
               "recompute_granularity", "recompute_method", "recompute_num_layers")


def role_config(model_dir: str, *, tp: int = 1, pp: int = 1, **kw):
    """An actor role config over ``model_dir`` with a megatron block; ``kw`` are EngineRoleConfig fields or
    MegatronConfig keys (``_BLOCK_KEYS``)."""
    from polyrl_engine_megatron.config import MegatronConfig

    from polyrl.config.roles import EngineRoleConfig, ModelConfig, OptimConfig

    block = MegatronConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                           **{k: kw.pop(k) for k in _BLOCK_KEYS if k in kw})
    # weight_decay=0.1 on every parameter (as both engines apply it). eps=1e-2: the tests compare weights after
    # a step taken two ways (parallel layouts, the fsdp engine), whose gradients agree to float rounding only;
    # Adam's first step lr * g / (|g| + eps) turns that rounding into up to lr / eps times it wherever an entry is
    # near eps (with eps=1e-6, 1e-6..1e-5 on an AMD EPYC's kernels, over WEIGHT_ATOL); with eps=1e-2 the step is
    # close to linear in g, and a real gradient error still moves weights by far more than the tolerance.
    optim = OptimConfig(lr=kw.pop("lr", 1e-3), grad_clip=kw.pop("grad_clip", 1.0), eps=1e-2, weight_decay=0.1)
    return EngineRoleConfig(engine="megatron", model=ModelConfig(path=model_dir), optim=optim,
                            micro_batch_size=kw.pop("micro_batch_size", 2), plugin_config=block, **kw)


#: set to 1 (by a GPU test) to run the scenarios on CUDA with nccl, one GPU per rank
CUDA_ENV = "ENGINE_DIST_CUDA"


def _platform():
    if os.environ.get(CUDA_ENV) == "1":
        from polyrl.platforms import CUDAPlatform

        platform = CUDAPlatform()
        platform.set_device(torch.distributed.get_rank() if torch.distributed.is_initialized() else 0)
        return platform
    from polyrl.platforms import CPUPlatform

    return CPUPlatform()


def make_engine(model_dir: str, role: str = "actor", model_type: str = "causal_lm", *, tp: int = 1, pp: int = 1,
                **kw):
    from polyrl_engine_megatron.engine import MegatronEngine

    return MegatronEngine(role_config(model_dir, tp=tp, pp=pp, **kw), role=role, model_type=model_type,
                          platform=_platform())


def _shard(engine, b):
    """This rank's data-parallel shard of ``b`` (what the worker group's dispatch gives it)."""
    from polyrl.batch import split

    return split(b, engine.dp_size)[engine.dp_rank] if engine.dp_size > 1 else b


def _full_weights(engine) -> dict[str, torch.Tensor]:
    return {n: t.detach().cpu().clone() for bucket in engine.weights_for_rollout(1 << 16) for n, t in bucket}


def parse_layout(layout: str) -> dict:
    """``tp2``, ``pp2``, ``dp2``, ``cp2``, ``ep2``, ``tp2ep2`` (expert TP 1), ``tp1``, with suffixes ``sp`` (sequence
    parallel), ``dist`` (distributed optimizer), ``packed`` (``use_remove_padding``), ``chunk3`` (log-probs 3 tokens
    at a time), ``unchunked`` (``logits_chunk_size=0``), ``offload`` (activation offload), ``recompute`` (full
    recomputation) -> make_engine keywords."""
    import re

    kw: dict = {}
    for size in re.findall(r"(?:tp|pp|cp|ep)\d", layout):
        key = {"tp": "tp", "pp": "pp", "cp": "context_parallel_size", "ep": "expert_model_parallel_size"}[size[:2]]
        kw[key] = int(size[2])
    if kw.get("tp", 1) > 1 and kw.get("expert_model_parallel_size", 1) > 1:
        kw["expert_tensor_parallel_size"] = 1
    flags = {"sp": ("sequence_parallel", True), "dist": ("use_distributed_optimizer", True),
             "packed": ("use_remove_padding", True), "chunk3": ("logits_chunk_size", 3),
             "unchunked": ("logits_chunk_size", 0), "offload": ("activation_offload", True)}
    for flag, (key, value) in flags.items():
        if layout.endswith(flag) or f"{flag}_" in layout:
            kw[key] = value
    if "recompute" in layout:
        kw.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    return kw


def train_step(model_dir: str, layout: str, **kw) -> dict:
    """One infer + train step + infer in ``layout`` (see :func:`parse_layout`)."""
    engine = make_engine(model_dir, **{**parse_layout(layout), **kw})
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


def widest_logits(model_dir: str, layout: str) -> dict:
    """The most rows any ``[rows, vocab / tp]`` tensor had during one train step in ``layout`` (every op's outputs
    are watched): the chunked log-probs never hold the logits of more than one chunk of tokens."""
    from torch.utils._python_dispatch import TorchDispatchMode

    engine = make_engine(model_dir, **parse_layout(layout))
    vocab = engine.hf_config.vocab_size // engine.parallel.tp
    widest = [0]

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            inputs = {a.untyped_storage().data_ptr() for a in torch.utils._pytree.tree_leaves((args, kwargs))
                      if isinstance(a, torch.Tensor)}
            for t in out if isinstance(out, (tuple, list)) else [out]:
                # new memory only: views (weight.t(), detach) of an existing tensor hold no logits
                if (isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-1] == vocab
                        and t.untyped_storage().data_ptr() not in inputs):
                    widest[0] = max(widest[0], t.numel() // vocab)
            return out

    b = batch()
    with Watch():
        engine.train_batch(b, loss_fn, temperature=0.9)
    tokens = int(b["response_mask"].sum())
    return {"widest": widest[0], "tokens": tokens, "positions": int(b["attention_mask"].sum())}


def tiny_moe(out: Path, arch: str) -> str:
    """A tiny random Qwen3-MoE / Mixtral (4 experts, top 2) with the char tokenizer, written by rank 0."""
    folder = out / arch
    if torch.distributed.get_rank() == 0 and not (folder / "config.json").exists():
        from polyrl.models.tiny import make_tiny_model

        make_tiny_model(folder, arch=arch, seed=0, num_key_value_heads=2)
    torch.distributed.barrier()
    return str(folder)


def moe_step(out: Path, spec: str, coeff: float = 0.01) -> dict:
    """``ARCH:LAYOUT``: one step of a tiny mixture of experts with a load-balancing loss (coefficient ``coeff``)."""
    arch, layout = spec.split(":")
    return train_step(tiny_moe(out, arch), layout, moe_aux_loss_coeff=coeff)


def moe_export(out: Path, spec: str) -> dict:
    """``ARCH:LAYOUT``: one step, then ``export_hf``; transformers loads the export (per-expert names) and gives the
    engine's log-probs of the batch."""
    from transformers import AutoModelForCausalLM

    arch, layout = spec.split(":")
    engine = make_engine(tiny_moe(out, arch), **parse_layout(layout), moe_aux_loss_coeff=0.01)
    b = batch()
    engine.train_batch(_shard(engine, b), loss_fn, temperature=0.9)  # the step moe_step takes
    folder = out / f"export_{arch}_{layout}"
    engine.export_hf(str(folder))
    result: dict = {}
    if torch.distributed.get_rank() == 0:
        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        with torch.no_grad():
            logits = hf(b["input_ids"], attention_mask=b["attention_mask"], position_ids=b["position_ids"]).logits
        r = b["responses"].shape[1]
        logp = torch.log_softmax(logits[:, -r - 1 : -1].float(), -1).gather(-1, b["responses"][..., None])[..., 0]
        result["hf_log_probs"] = logp * b["response_mask"]
        from safetensors import safe_open

        with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
            result["names"] = sorted(f.keys())
    return result


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
    """The value model: values, one step of the value loss, values again, in ``layout`` (``tp1``, ``tp2sp``, ``cp2``)."""
    engine = make_engine(model_dir, role="critic", model_type="value", lr=1e-2, **parse_layout(layout))
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
    import warnings

    warnings.filterwarnings("ignore")
    rank, world, out = int(rank), int(world), Path(out)
    from polyrl.distributed import init_distributed

    if os.environ.get(CUDA_ENV) == "1":
        torch.cuda.set_device(rank)
    init_distributed("nccl" if os.environ.get(CUDA_ENV) == "1" else "gloo", rank, world, "127.0.0.1", int(port))
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
        elif name == "widest":
            result = widest_logits(model_dir, arg)
        elif name == "moe":
            result = moe_step(out, arg)
        elif name == "moe0":  # no load-balancing loss
            result = moe_step(out, arg, coeff=0.0)
        elif name == "export":
            result = moe_export(out, arg)
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
    from polyrl.distributed import exit_process

    exit_process(0)  # no interpreter teardown: a rare gloo abort at exit after the work is done
