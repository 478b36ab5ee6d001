"""One rank of a gloo group running megatron-core scenarios (spawned by the tests; writes ``result_<rank>.pt``).

    python mcore_worker.py RANK WORLD PORT OUT_DIR SCENARIO
"""

from __future__ import annotations

import os
import sys
import warnings

import torch
import torch.distributed as dist

VOCAB = 96


def tiny_hf(arch: str, value: bool = False):
    """A tiny random HF model (float32) built in code; every rank builds the same weights."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6)
    extra = {"llama": dict(tie_word_embeddings=False, rope_theta=5000.0),
             "qwen2": dict(tie_word_embeddings=True),  # tied embeddings and q/k/v biases
             "qwen3": dict(tie_word_embeddings=False, head_dim=24)}[arch]  # qk-norm, head_dim != hidden/heads
    config = AutoConfig.for_model(arch, **common, **extra)
    if value:
        config.num_labels = 1
    torch.manual_seed({"llama": 1, "qwen2": 2, "qwen3": 3}[arch])
    model = (AutoModelForTokenClassification if value else AutoModelForCausalLM).from_config(config,
                                                                                           dtype=torch.float32)
    if not value:  # random init leaves the norms at 1 and biases at 0: perturb them so their layout matters
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name or name.endswith("bias"):
                    p.add_(0.1 * torch.randn_like(p))
    return config, model.eval()


def _pipeline_forward(model, ids: torch.Tensor, info) -> torch.Tensor | None:
    """Forward through all pipeline stages by hand (point-to-point send/recv of the hidden states)."""
    from megatron.core import parallel_state as ps

    pos = torch.arange(ids.shape[1])[None].expand_as(ids)
    if not info.is_first_stage:
        hidden = torch.empty(ids.shape[1], ids.shape[0], model.config.hidden_size)
        dist.recv(hidden, src=ps.get_pipeline_model_parallel_prev_rank())
        model.set_input_tensor(hidden)
    out = model(ids if info.is_first_stage else None, pos, attention_mask=None)
    if not info.is_last_stage:
        dist.send(out.contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
        return None
    return out


def _full_vocab(logits: torch.Tensor) -> torch.Tensor:
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    if tp == 1:
        return logits
    parts = [torch.empty_like(logits) for _ in range(tp)]
    dist.all_gather(parts, logits.contiguous(), group=ps.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=-1)


def convert(rank: int, world: int, out: str) -> dict:
    """HF logits/values reproduced and HF -> mcore -> HF round trips in TP=1 (DP=2), TP=2 and PP=2."""
    from polyrl_engine_megatron.convert import hf_param_shapes, iter_hf_weights, load_hf_weights
    from polyrl_engine_megatron.model import build_gpt_model
    from polyrl_engine_megatron.parallel import destroy_parallel_state, init_parallel_state

    ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(0))
    result: dict = {}
    for arch in ("llama", "qwen2", "qwen3"):
        config, hf = tiny_hf(arch)
        with torch.no_grad():
            ref = hf(ids).logits
        hf_state = hf.state_dict()
        if config.tie_word_embeddings:
            hf_state.pop("lm_head.weight", None)
        source = hf_state
        if arch == "qwen3":  # from a sharded safetensors folder with an index, as a checkpoint comes
            folder = os.path.join(out, arch)
            if rank == 0:
                hf.save_pretrained(folder, max_shard_size="60KB")
            dist.barrier()
            source = folder
        for tp, pp in ((1, 1), (2, 1), (1, 2)):
            info = init_parallel_state(tp, pp)
            model = build_gpt_model(config).eval()
            load_hf_weights(model, source, config)
            with torch.no_grad():
                logits = _pipeline_forward(model, ids, info)
            if logits is not None:
                result[f"{arch}/tp{tp}pp{pp}/logit_err"] = float((_full_vocab(logits) - ref).abs().max())
            got, sizes = {}, []
            for bucket in iter_hf_weights(model, config, bucket_bytes=16 << 10):
                sizes.append(sum(t.numel() * t.element_size() for _, t in bucket))
                got.update(bucket)
            result[f"{arch}/tp{tp}pp{pp}/bucket_bytes"] = sizes
            result[f"{arch}/tp{tp}pp{pp}/names_equal"] = list(got) == list(hf_param_shapes(config)) and set(
                got) == set(hf_state)
            result[f"{arch}/tp{tp}pp{pp}/exact"] = all(torch.equal(got[k], hf_state[k]) for k in hf_state if k in got)
            destroy_parallel_state()

    # the critic: a value head on Qwen2 (tied in the causal LM, untied in the critic) under TP=2 and PP=2
    config, critic = tiny_hf("qwen2", value=True)
    with torch.no_grad():
        critic.score.weight.normal_()
        critic.score.bias.fill_(0.5)
        ref = critic(ids).logits
    state = critic.state_dict()
    for tp, pp in ((2, 1), (1, 2)):
        info = init_parallel_state(tp, pp)
        model = build_gpt_model(config, value_head=True).eval()
        load_hf_weights(model, state, config, value_head=True)
        with torch.no_grad():
            values = _pipeline_forward(model, ids, info)
        if values is not None:
            result[f"critic/tp{tp}pp{pp}/value_err"] = float((values - ref).abs().max())
        got = dict(kv for bucket in iter_hf_weights(model, config, value_head=True) for kv in bucket)
        result[f"critic/tp{tp}pp{pp}/exact"] = set(got) == set(state) and all(
            torch.equal(got[k], state[k]) for k in state)
        destroy_parallel_state()
    return result


def tiny_moe_hf(arch: str):
    """A tiny random mixture of experts (4 experts, top 2, float32) built in code with transformers' config class;
    norms and router perturbed so that their layout and the routing matter. ``qwen3_moe`` renormalises the top-2
    weights (``norm_topk_prob``), ``qwen3_moe_unnormalised`` does not, ``mixtral`` always does."""
    from transformers import AutoModelForCausalLM, MixtralConfig, Qwen3MoeConfig

    common = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=False)
    if arch.startswith("qwen3_moe"):
        config = Qwen3MoeConfig(**common, intermediate_size=96, moe_intermediate_size=32, num_experts=4,
                                num_experts_per_tok=2, head_dim=24, norm_topk_prob=arch == "qwen3_moe")
    else:
        config = MixtralConfig(**common, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2)
    torch.manual_seed(4)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
            if name.endswith("gate.weight"):  # routers: clear preferences, so a misplaced expert shows
                p.normal_(0, 0.5)
    return config, model.eval()


def convert_moe(rank: int, world: int, out: str) -> dict:
    """Qwen3-MoE and Mixtral, read from the checkpoint folder ``save_pretrained`` writes (per-expert names):
    megatron reproduces transformers' logits and gives back exactly the checkpoint's tensors in EP=1 (DP=2), EP=2,
    TP=2, TP=2 x EP=2 (expert TP 1) and PP=2."""
    from polyrl_engine_megatron.convert import hf_param_shapes, iter_hf_weights, load_hf_weights
    from polyrl_engine_megatron.model import build_gpt_model
    from polyrl_engine_megatron.parallel import destroy_parallel_state, init_parallel_state
    from safetensors.torch import load_file

    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    result: dict = {}
    for arch in ("qwen3_moe", "qwen3_moe_unnormalised", "mixtral"):
        config, hf = tiny_moe_hf(arch)
        with torch.no_grad():
            ref = hf(ids).logits
        folder = os.path.join(out, arch)
        if rank == 0:
            hf.save_pretrained(folder)
        dist.barrier()
        disk = load_file(os.path.join(folder, "model.safetensors"))
        result[f"{arch}/expert_names"] = sorted(k for k in disk if ".experts." in k)[:3]
        for tp, pp, ep, etp in ((1, 1, 1, None), (1, 1, 2, None), (2, 1, 1, None), (2, 1, 2, 1), (1, 2, 1, None)):
            key = f"{arch}/tp{tp}pp{pp}ep{ep}"
            info = init_parallel_state(tp, pp, ep=ep, etp=etp)
            model = build_gpt_model(config).eval()
            load_hf_weights(model, folder, config)
            with torch.no_grad():
                logits = _pipeline_forward(model, ids, info)
            if logits is not None:
                result[f"{key}/logit_err"] = float((_full_vocab(logits) - ref).abs().max())
            got = dict(kv for bucket in iter_hf_weights(model, config, bucket_bytes=16 << 10) for kv in bucket)
            result[f"{key}/names_equal"] = list(got) == list(hf_param_shapes(config)) and set(got) == set(disk)
            result[f"{key}/exact"] = all(torch.equal(got[k], disk[k]) for k in disk if k in got)
            destroy_parallel_state()
        result[f"{arch}/logit_scale"] = float(ref.abs().max())
    return result


def train(rank: int, world: int, out: str) -> dict:
    """One optimizer step through megatron's own DDP, optimizer, grad clipping and pipeline schedules in
    TP=1 x DP=2 (distributed optimizer), TP=2 and PP=2 (distributed optimizer): loss, grad norm and the
    updated weights must agree; this is what the CPU emulation exists for."""
    from functools import partial

    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from polyrl_engine_megatron.convert import iter_hf_weights, load_hf_weights
    from polyrl_engine_megatron.model import build_gpt_model
    from polyrl_engine_megatron.parallel import destroy_parallel_state, init_parallel_state

    config, hf = tiny_hf("qwen3")
    hf_state = hf.state_dict()
    data = torch.randint(0, VOCAB, (4, 9), generator=torch.Generator().manual_seed(1))
    result: dict = {}
    for tp, pp, dist_opt in ((1, 1, True), (2, 1, False), (1, 2, True)):
        info = init_parallel_state(tp, pp)
        model = build_gpt_model(config)
        load_hf_weights(model, hf_state, config)
        model.config.finalize_model_grads_func = finalize_model_grads
        ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(
            use_distributed_optimizer=dist_opt, grad_reduce_in_fp32=True), model)
        optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, clip_grad=1.0, adam_eps=1e-6,
                                                           use_distributed_optimizer=dist_opt), [ddp])
        rows = data.chunk(info.dp)[info.dp_rank]  # this data-parallel rank's rows
        micro = list(rows.split(2))  # micro-batches of 2 rows
        losses: list[float] = []

        def loss_func(mask, output, losses=losses):
            loss = (output * mask).sum() / mask.sum()
            losses.append(float(loss))
            return loss, {"loss": loss.detach()}

        def step(it, model):
            batch = next(it)
            ids, labels = batch[:, :-1], batch[:, 1:]
            pos = torch.arange(ids.shape[1])[None].expand_as(ids)
            output = model(ids, pos, None, labels=labels)
            return output, partial(loss_func, torch.ones_like(labels, dtype=torch.float32))

        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        get_forward_backward_func()(forward_step_func=step, data_iterator=iter(micro), model=[ddp],
                                    num_microbatches=len(micro), seq_length=8, micro_batch_size=2)
        ok, grad_norm, _ = optimizer.step()
        key = f"tp{tp}pp{pp}"
        result[f"{key}/ok"] = bool(ok)
        result[f"{key}/grad_norm"] = float(grad_norm)
        if losses:  # the last stage: mean loss of this rank's micro-batches (averaged over DP by the test)
            result[f"{key}/loss"] = sum(losses) / len(losses)
        result[f"{key}/weights"] = {k: v.clone() for b in iter_hf_weights(ddp, config) for k, v in b}
        destroy_parallel_state()
    result["initial"] = hf_state
    result["torch_cuda_untouched"] = not torch.cuda.is_available()
    return result


def main() -> None:
    warnings.filterwarnings("ignore")
    rank, world, port, out, scenario = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
    from polyrl.distributed import init_distributed

    torch.set_num_threads(1)
    init_distributed("gloo", rank, world, "127.0.0.1", int(port))
    result = {}
    for name in scenario.split(","):
        result.update(globals()[name](rank, world, out))
    torch.save(result, os.path.join(out, f"result_{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    from polyrl.distributed import exit_process

    exit_process(0)  # no interpreter teardown: a rare gloo abort at exit after the work is done
