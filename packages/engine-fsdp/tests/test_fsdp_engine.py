"""The FSDP2 engine on CPU with real gloo process groups."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from polyrl.distributed import free_port
from polyrl.errors import CheckpointError, ConfigError
from polyrl.testing import EngineConformance

sys.path.insert(0, str(Path(__file__).parent))
from dist_worker import batch, loss_fn, make_engine, run_ranks  # noqa: E402

HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from polyrl.models.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("m") / "tiny", size="tiny", seed=0)


class TestFSDPConformance(EngineConformance):
    @pytest.fixture
    def engine_factory(self, model_dir):
        return lambda role="actor", model_type="causal_lm", **kw: make_engine(str(model_dir), role, model_type, **kw)


def _hf_log_probs(model, b, row: int) -> torch.Tensor:
    ids = b["input_ids"][row][b["attention_mask"][row].bool()][None]
    n = int(b["response_mask"][row].sum())
    with torch.no_grad():
        logits = model(ids).logits[0, -n - 1 : -1]
    return torch.log_softmax(logits, -1).gather(-1, ids[0, -n:, None]).squeeze(-1)


def _run_group(world: int, model_dir: Path, out: Path, scenario: str = "plain") -> dict:
    return run_ranks("dist_worker.py", world, [str(model_dir), str(out), scenario], out / f"result_{world}_{scenario}.pt")


def test_two_processes_match_one(model_dir, tmp_path):
    one = _run_group(1, model_dir, tmp_path)
    two = _run_group(2, model_dir, tmp_path)
    # dynamic micro-batches of packed sequences, a different count on each rank
    packed = _run_group(2, model_dir, tmp_path, "dynamic")
    assert any(len(set(counts)) > 1 for counts in packed["results"]["micro_batches"])
    for other in (two, packed):
        assert one["results"]["grad_norm"] == pytest.approx(other["results"]["grad_norm"], rel=1e-6)
        assert one["results"]["loss"] == pytest.approx(other["results"]["loss"], rel=1e-6)
        assert set(one["weights"]) == set(other["weights"])
        for name, w in one["weights"].items():
            assert torch.allclose(w, other["weights"][name], atol=1e-6), name


def test_save_load_continue_equals_uninterrupted(model_dir, tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    straight = _run_group(2, model_dir, tmp_path / "a")
    resumed = _run_group(2, model_dir, tmp_path / "b", "resume")
    assert straight["results"]["grad_norm"] == pytest.approx(resumed["results"]["grad_norm"], abs=1e-6)
    for name, w in straight["weights"].items():
        assert torch.allclose(w, resumed["weights"][name], atol=1e-6), name


def test_fsdp_size_one_replicates_and_matches_full_sharding(model_dir, tmp_path):
    """``fsdp.fsdp_size=1`` (a plain module on each rank, gradients all-reduced) trains exactly like full
    sharding, and its checkpoints resume exactly."""
    for sub in ("a", "b", "c"):
        (tmp_path / sub).mkdir()
    sharded = _run_group(2, model_dir, tmp_path / "a")
    replicated = _run_group(2, model_dir, tmp_path / "b", "replicate")
    resumed = _run_group(2, model_dir, tmp_path / "c", "replicate-resume")
    assert not sharded["results"]["replicated"] and replicated["results"]["replicated"]
    assert replicated["results"]["local_equals_full"]
    for other in (replicated, resumed):
        assert sharded["results"]["grad_norm"] == pytest.approx(other["results"]["grad_norm"], rel=1e-6)
        for name, w in sharded["weights"].items():
            assert torch.allclose(w, other["weights"][name], atol=1e-6), name


def test_overlapped_grad_reduce_equals_reduce_after_backward(model_dir, tmp_path):
    """Replicated (``fsdp_size=1``) on 2 gloo ranks: the gradients all-reduced bucket by bucket during the last
    backward are bit-for-bit those all-reduced after it, over 3 steps of 2 micro-batches. Small buckets (dozens);
    the ranks' micro-batches take different forward paths (shared-prompt or plain). (Ranks that finish their
    buckets in different orders or leave parameters out: tests/test_grad_reduce.py.)"""
    for sub in ("a", "b"):
        (tmp_path / sub).mkdir()
    after = _run_group(2, model_dir, tmp_path / "a", "replicate-grouped-buckets-grads-nooverlap")
    during = _run_group(2, model_dir, tmp_path / "b", "replicate-grouped-buckets-grads")
    assert after["results"]["overlapped"] == [0, 0, 0]
    assert all(n > 1 for n in during["results"]["overlapped"])  # buckets did start inside backward
    assert len(after["results"]["grads"]) == len(during["results"]["grads"]) == 3
    for step_after, step_during in zip(after["results"]["grads"], during["results"]["grads"]):
        assert len(step_after) == len(step_during)
        for a, d in zip(step_after, step_during):
            assert torch.equal(a, d)
    assert after["results"]["grad_norm"] == during["results"]["grad_norm"]
    for name, w in after["weights"].items():
        assert torch.equal(w, during["weights"][name]), name


@pytest.mark.parametrize("layout", ["sharded", "replicate"])
def test_shared_prompt_forward_trains_like_the_full_forward(model_dir, tmp_path, layout):
    """Rows that share a prompt run it once (its KV cache copied to each row): the same losses, gradient norms
    and weights as running every row whole, on 2 ranks, under full sharding and replicated."""
    extra = "" if layout == "sharded" else "-replicate"
    for sub in ("a", "b"):
        (tmp_path / sub).mkdir()
    whole = _run_group(2, model_dir, tmp_path / "a", f"grouped-noshare{extra}")
    shared = _run_group(2, model_dir, tmp_path / "b", f"grouped{extra}")
    assert whole["results"]["grad_norm"] == pytest.approx(shared["results"]["grad_norm"], rel=1e-5)
    assert whole["results"]["loss"] == pytest.approx(shared["results"]["loss"], rel=1e-5)
    for name, w in whole["weights"].items():
        assert torch.allclose(w, shared["weights"][name], atol=1e-6), name


def test_shared_prompt_log_probs_and_values_match_transformers(model_dir):
    """Log-probs of rows sharing a prompt equal a plain transformers forward of each whole row, and a value
    model gives the same values either way."""
    from transformers import AutoModelForCausalLM

    from polyrl_engine_fsdp.config import FSDPConfig
    from polyrl_engine_fsdp.engine import _model_inputs, _trim

    b = batch(seed=7, rows=6, group=3)
    assert "prompt_ids" in _model_inputs(_trim(b), packed=False, shared_prompt=True)
    engine = make_engine(str(model_dir), micro_batch_size=6, plugin_config=FSDPConfig(shared_prompt_min_tokens=0))
    got = engine.infer_batch(b)["log_probs"]
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    for row in range(6):
        n = int(b["response_mask"][row].sum())
        assert torch.allclose(got[row, :n], _hf_log_probs(model, b, row), atol=1e-5), row
    values = {}
    for share in (True, False):
        critic = make_engine(str(model_dir), "critic", "value", micro_batch_size=6,
                             plugin_config=FSDPConfig(shared_prompt=share, shared_prompt_min_tokens=0))
        critic.train_batch(b, lambda out, mb, scale: ((out["values"] * mb["response_mask"]).sum(), {}))
        values[share] = critic.infer_batch(b)["values"]
    assert values[True].abs().sum() > 0
    assert torch.allclose(values[True], values[False], atol=1e-5)


@pytest.mark.parametrize("order", ["grouped", "interleaved"])
def test_shared_prompt_rows_in_any_order_train_like_whole_rows(model_dir, order):
    """Rows that come in whole groups in prompt order get their prompt's keys and values broadcast (its backward a
    sum per group); rows in any other order gather them. Either way one update moves every weight as running each
    row whole does, and the prompts are numbered in the order they first come."""
    from polyrl_engine_fsdp.config import FSDPConfig
    from polyrl_engine_fsdp.engine import _model_inputs, _trim

    b = batch(seed=11, rows=8, group=4)
    if order == "interleaved":
        b = b[torch.tensor([0, 4, 1, 5, 2, 6, 3, 7])]
    inputs = _model_inputs(_trim(b), packed=False, shared_prompt=True)
    expected = [0, 0, 0, 0, 1, 1, 1, 1] if order == "grouped" else [0, 1, 0, 1, 0, 1, 0, 1]
    assert inputs["prompt_of_row"].tolist() == expected
    weights = {}
    for share in (True, False, None):  # None: the weights before the update
        engine = make_engine(str(model_dir), micro_batch_size=8,
                             plugin_config=FSDPConfig(shared_prompt=bool(share), shared_prompt_min_tokens=0,
                                                      shared_prompt_packed=False))  # the padded form's row copies
        if share is not None:
            engine.train_batch(b, loss_fn)
        weights[share] = {k: v.detach().clone() for k, v in engine.module.named_parameters()}
    moved = [name for name, w in weights[False].items() if not torch.equal(w, weights[None][name])]
    assert len(moved) > len(weights[None]) // 2
    for name, w in weights[False].items():
        assert torch.allclose(w, weights[True][name], atol=1e-6), name


def _grpo_rows(lengths: list[int], group: int, prompt_len: int = 6, seed: int = 5):
    """Rows of ``group`` samples per prompt (prompts of 1 to ``prompt_len`` tokens, left-padded), responses of
    ``lengths`` tokens, random advantages."""
    from polyrl.agent_loops import collate
    from polyrl.protocols import AgentLoopOutput

    g = torch.Generator().manual_seed(seed)
    outs = []
    for i, n in enumerate(lengths):
        if i % group == 0:
            prompt = torch.randint(5, 200, (int(torch.randint(1, prompt_len + 1, (1,), generator=g)),), generator=g)
        outs.append(AgentLoopOutput(prompt_ids=prompt.tolist(), response_ids=torch.randint(5, 200, (n,),
                                                                                           generator=g).tolist(),
                                    response_mask=[1] * n))
    r = max(lengths)
    b = collate(outs, pad_token_id=0, max_prompt_length=prompt_len, max_response_length=r)
    b["advantages"] = torch.randn(len(lengths), 1, generator=g).expand(len(lengths), r).contiguous()
    b["old_log_probs"] = torch.zeros(len(lengths), r)
    return b


@pytest.mark.parametrize("order", ["grouped", "interleaved"])
def test_packed_shared_prompt_form_gives_the_whole_rows_log_probs_and_gradients(model_dir, order):
    """Responses of very different lengths (short answers, one long one) take the packed shared-prompt form: every
    response in one row, a block mask over the prompts' caches and its own tokens. Log-probs, entropies, a critic's
    values and the gradients of a loss are those of running each row whole, in either row order."""
    from polyrl_engine_fsdp.config import FSDPConfig
    from polyrl_engine_fsdp.engine import _model_inputs, _trim

    b = _grpo_rows([1, 2, 9, 1, 2, 1, 3, 1, 2, 1, 1, 2], group=4)
    if order == "interleaved":
        b = b[torch.tensor([0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11])]
    got: dict = {}
    for form, block in (("packed", FSDPConfig(shared_prompt_min_tokens=0)), ("whole", FSDPConfig(shared_prompt=False))):
        engine = make_engine(str(model_dir), micro_batch_size=12, plugin_config=block)
        inputs = _model_inputs(_trim(b), packed=False, shared_prompt=form == "packed", pack_costs=engine._pack_costs)
        # packed: one row of every response token but each row's last (the lengths less one, summed: 14)
        assert inputs["input_ids"].shape == ((1, 14) if form == "packed" else (12, 15))
        out = engine.infer_batch(b, compute_entropy=True)
        engine.module.train()
        model_out, mb = engine.forward_micro_batch(b, 1.0, compute_entropy=True)
        loss = (-model_out["log_probs"] * mb["advantages"] * mb["response_mask"]).sum() + model_out["entropy"].sum()
        loss.backward()
        grads = {n: p.grad.clone() for n, p in engine.module.named_parameters()}
        critic = make_engine(str(model_dir), "critic", "value", micro_batch_size=12, plugin_config=block)
        critic.train_batch(b, lambda o, m, scale: ((o["values"] * m["response_mask"]).sum(), {}))
        got[form] = (out["log_probs"], out["entropy"], grads, critic.infer_batch(b)["values"])
    mask = b["response_mask"].bool()
    (lp, ent, grads, values), (lp_w, ent_w, grads_w, values_w) = got["packed"], got["whole"]
    assert torch.allclose(lp[mask], lp_w[mask], atol=1e-5)
    assert torch.allclose(ent[mask], ent_w[mask], atol=1e-5)
    assert values_w.abs().sum() > 0 and torch.allclose(values, values_w, atol=1e-5)
    assert len(grads) == len(grads_w)
    for name, g in grads_w.items():
        assert torch.allclose(grads[name], g, atol=1e-6, rtol=1e-4), name


def test_packed_form_only_where_it_costs_less(model_dir):
    """The packed shared-prompt form is taken where the padding it drops costs more than its dense mask: responses
    of very different lengths are packed, responses all of the longest length stay in the padded ``[rows, R]``
    form, and ``fsdp.shared_prompt_packed=false`` keeps every micro-batch padded."""
    from polyrl_engine_fsdp.config import FSDPConfig
    from polyrl_engine_fsdp.engine import _model_inputs, _trim

    engine = make_engine(str(model_dir), micro_batch_size=8, plugin_config=FSDPConfig(shared_prompt_min_tokens=0))
    off = make_engine(str(model_dir), micro_batch_size=8,
                      plugin_config=FSDPConfig(shared_prompt_min_tokens=0, shared_prompt_packed=False))
    assert engine._pack_costs is not None and off._pack_costs is None
    uneven = _trim(_grpo_rows([1, 1, 2, 12, 1, 2, 1, 1], group=4))
    even = _trim(_grpo_rows([12] * 8, group=4))
    assert _model_inputs(uneven, packed=False, shared_prompt=True, pack_costs=engine._pack_costs)[
        "attention_mask"].dim() == 4
    assert _model_inputs(even, packed=False, shared_prompt=True, pack_costs=engine._pack_costs)[
        "attention_mask"].dim() == 2
    assert _model_inputs(uneven, packed=False, shared_prompt=True, pack_costs=off._pack_costs)[
        "attention_mask"].dim() == 2


def test_shared_prompt_form_only_where_it_skips_enough_prompt_tokens(model_dir):
    """A micro-batch takes the shared-prompt form (two backbone passes) only when it skips at least
    ``fsdp.shared_prompt_min_tokens`` prompt tokens; the log-probs are the same either way."""
    from polyrl.agent_loops import collate
    from polyrl.protocols import AgentLoopOutput
    from polyrl_engine_fsdp.config import FSDPConfig

    g = torch.Generator().manual_seed(3)

    def grpo_rows(prompt_len: int):  # 2 prompts x 4 samples: (8 - 2) x prompt_len prompt tokens skipped
        outs = []
        for i in range(8):
            if i % 4 == 0:
                prompt = torch.randint(5, 200, (prompt_len,), generator=g).tolist()
            outs.append(AgentLoopOutput(prompt_ids=prompt, response_ids=torch.randint(5, 200, (6,), generator=g).tolist(),
                                        response_mask=[1] * 6))
        return collate(outs, pad_token_id=0, max_prompt_length=prompt_len, max_response_length=6)

    batches = {prompt_len: grpo_rows(prompt_len) for prompt_len in (9, 24)}  # 54 and 144 prompt tokens skipped
    passes = {}
    for min_tokens in ("default", 0):  # the default threshold (96) lies between the two batches' 54 and 144
        block = FSDPConfig() if min_tokens == "default" else FSDPConfig(shared_prompt_min_tokens=min_tokens)
        engine = make_engine(str(model_dir), micro_batch_size=8, plugin_config=block)
        calls: list[int] = []
        engine.module.model.base_model.register_forward_pre_hook(lambda *_, calls=calls: calls.append(1))
        for prompt_len, rows in batches.items():
            calls.clear()
            out = engine.infer_batch(rows)["log_probs"]
            passes[min_tokens, prompt_len] = (len(calls), out)
    assert passes["default", 9][0] == 1 and passes["default", 24][0] == 2  # plain below the threshold, shared above
    assert passes[0, 9][0] == 2 and passes[0, 24][0] == 2
    assert torch.allclose(passes["default", 9][1], passes[0, 9][1], atol=1e-5)


def test_fused_adamw_by_default_on_cpu(model_dir):
    from polyrl.config.roles import OptimConfig

    assert make_engine(str(model_dir)).optimizer.defaults["fused"]
    plain = make_engine(str(model_dir), optim=OptimConfig(lr=1e-3, fused=False)).optimizer.defaults
    assert not plain["fused"] and plain["foreach"]


def test_dynamic_micro_batches_give_the_same_gradients(model_dir):
    b = batch(seed=4)
    fixed = make_engine(str(model_dir), micro_batch_size=3)
    dynamic = make_engine(str(model_dir), use_dynamic_bsz=True, max_token_len_per_gpu=24)
    m1, m2 = fixed.train_batch(b, loss_fn), dynamic.train_batch(b, loss_fn)
    assert m1["actor/grad_norm"] == pytest.approx(m2["actor/grad_norm"], rel=1e-5)
    w1 = dict(p for bucket in fixed.weights_for_rollout() for p in bucket)
    w2 = dict(p for bucket in dynamic.weights_for_rollout() for p in bucket)
    assert all(torch.allclose(w1[n], w2[n], atol=1e-6) for n in w1)
    splits = dynamic.split_micro_batches(b, True)
    assert len(splits) > 1
    from polyrl_engine_fsdp.engine import _trim

    assert all(_trim(b[rows])["input_ids"].numel() <= 24 for rows in splits)  # the budget holds after trimming
    assert sorted(torch.cat(splits).tolist()) == list(range(8))


def test_loss_metrics_read_the_same_in_one_micro_batch_or_four(model_dir):
    """``actor/entropy`` (a loss term: each micro-batch's loss is its share of the mini-batch's) reads the same
    whatever ``micro_batch_size`` splits the mini-batch into; averaged as shares it read a quarter of itself."""
    from polyrl.config.schema import ActorConfig
    from polyrl.trainer.losses import make_actor_loss

    b = batch(seed=5)
    loss = make_actor_loss(ActorConfig())
    whole = make_engine(str(model_dir), micro_batch_size=8).train_batch(b, loss)
    split = make_engine(str(model_dir), micro_batch_size=2).train_batch(b, loss)
    assert whole["actor/entropy"] > 1.0  # a random model's next-token entropy: near log(vocabulary)
    assert split["actor/entropy"] == pytest.approx(whole["actor/entropy"], rel=0.05)


def test_lora_merge_reproduces_the_merged_model(model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    from polyrl.config.roles import LoRAConfig

    engine = make_engine(str(model_dir))
    engine.config.model.lora = LoRAConfig(rank=4, alpha=8, target_modules=["q_proj", "v_proj"])
    from polyrl_engine_fsdp.engine import FSDPEngine

    lora = FSDPEngine(engine.config, role="actor")
    b = batch(seed=1)
    for _ in range(2):
        lora.train_batch(b, loss_fn)
    merged = dict(p for bucket in lora.weights_for_rollout() for p in bucket)
    assert not any("lora" in n for n in merged)
    lora.export_hf(str(tmp_path / "merged"))
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert all(torch.allclose(model.state_dict()[n], t, atol=1e-6) for n, t in merged.items())
    ids = b["input_ids"][0][b["attention_mask"][0].bool()][None]
    n = int(b["response_mask"][0].sum())
    ref = torch.log_softmax(model(ids).logits[0, -n - 1 : -1], -1).gather(-1, ids[0, -n:, None]).squeeze(-1)
    assert torch.allclose(lora.infer_batch(b)["log_probs"][0, :n], ref, atol=1e-4)
    # the adapter-disabled actor is the base model: the reference policy without a second copy
    base = make_engine(str(model_dir)).infer_batch(b)["log_probs"]
    assert torch.allclose(lora.infer_batch(b, disable_adapter=True)["log_probs"], base, atol=1e-5)

    # adapter alone: peft's own loader and merge agree with the engine's merged weights
    from peft import PeftModel

    lora.config.model.lora.sync = "adapter"
    lora.fsdp.lora_export = "adapter"
    adapter = dict(p for bucket in lora.weights_for_rollout() for p in bucket)
    assert adapter and all(".lora_A.weight" in n or ".lora_B.weight" in n for n in adapter)
    assert len(adapter) == 2 * 2 * 2  # 2 layers x (q_proj, v_proj) x (A, B)
    lora.export_hf(str(tmp_path / "adapter"))
    assert not (tmp_path / "adapter" / "model.safetensors").exists()
    assert (tmp_path / "adapter" / "adapter_config.json").exists()
    assert (tmp_path / "adapter" / "tokenizer_config.json").exists()
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), tmp_path / "adapter")
    assert torch.allclose(_hf_log_probs(peft_model, b, 0), ref, atol=1e-4)
    by_peft = peft_model.merge_and_unload().state_dict()
    assert all(torch.allclose(by_peft[n], t, atol=1e-6) for n, t in merged.items())


def test_export_is_what_save_pretrained_writes(model_dir, tmp_path):
    """Sharded safetensors with an index, generation config and tokenizer; the folder gives the engine's log-probs."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    engine = make_engine(str(model_dir))
    b = batch(seed=3)
    engine.train_batch(b, loss_fn)
    engine.fsdp.export_max_shard_size = "20KB"
    engine.export_hf(str(tmp_path / "sharded"))
    out = tmp_path / "sharded"
    shards = sorted(out.glob("model-*-of-*.safetensors"))
    assert len(shards) > 1 and (out / "model.safetensors.index.json").exists()
    assert not (out / "model.safetensors").exists()
    source_gen = GenerationConfig.from_pretrained(model_dir)
    assert GenerationConfig.from_pretrained(out).eos_token_id == source_gen.eos_token_id is not None
    assert AutoTokenizer.from_pretrained(out).get_vocab() == AutoTokenizer.from_pretrained(model_dir).get_vocab()
    model = AutoModelForCausalLM.from_pretrained(out)
    mine = engine.infer_batch(b)["log_probs"]
    for row in range(2):
        n = int(b["response_mask"][row].sum())
        assert torch.allclose(mine[row, :n], _hf_log_probs(model, b, row), atol=1e-5)
    # the default limit keeps a small model in one file, as save_pretrained does
    engine.fsdp.export_max_shard_size = "5GB"
    engine.export_hf(str(tmp_path / "single"))
    assert (tmp_path / "single" / "model.safetensors").exists()
    assert not (tmp_path / "single" / "model.safetensors.index.json").exists()
    single = AutoModelForCausalLM.from_pretrained(tmp_path / "single").state_dict()
    assert all(torch.equal(single[k], v) for k, v in model.state_dict().items())


def test_export_of_tied_embeddings(tmp_path):
    from transformers import AutoModelForCausalLM

    from polyrl.models.tiny import make_tiny_model

    tied_dir = make_tiny_model(tmp_path / "tied", seed=1, tie_word_embeddings=True)
    engine = make_engine(str(tied_dir))
    engine.train_batch(batch(seed=4), loss_fn)
    engine.export_hf(str(tmp_path / "out"))
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    b = batch(seed=4)
    n = int(b["response_mask"][0].sum())
    assert torch.allclose(engine.infer_batch(b)["log_probs"][0, :n], _hf_log_probs(model, b, 0), atol=1e-5)


def _vloss(out, mb, scale):
    loss = (((out["values"] - mb["returns"]) ** 2) * mb["response_mask"]).sum() / scale.batch_num_tokens * scale.dp_size
    return loss, {"vf": float(loss.detach())}


def test_value_model_trains_and_exports(model_dir, tmp_path):
    from transformers import AutoModelForTokenClassification

    from polyrl.config.roles import EngineRoleConfig, ModelConfig, OptimConfig
    from polyrl_engine_fsdp.engine import FSDPEngine

    critic = FSDPEngine(EngineRoleConfig(model=ModelConfig(path=str(model_dir)), optim=OptimConfig(lr=1e-2)),
                        role="critic", model_type="value")
    b = batch(seed=2)
    b["returns"] = torch.ones(8, 10)
    first = critic.train_batch(b, _vloss)
    assert "critic/grad_norm" in first
    for _ in range(10):
        last = critic.train_batch(b, _vloss)["vf"]
    assert last < first["vf"] * 0.6
    values = critic.infer_batch(b)["values"]
    assert values.shape == (8, 10) and torch.all(values[b["response_mask"] == 0] == 0)
    # the value of response token t is read where the log-prob of t is: at position P - 1 + t (verl's choice)
    critic.export_hf(str(tmp_path / "critic"))
    model = AutoModelForTokenClassification.from_pretrained(tmp_path / "critic")
    ids = b["input_ids"][0][b["attention_mask"][0].bool()][None]
    n = int(b["response_mask"][0].sum())
    with torch.no_grad():
        ref = model(ids).logits[0, -n - 1 : -1, 0]
    assert torch.allclose(values[0, :n], ref, atol=1e-5)
    # a critic resumed from that export keeps its trained head
    again = make_engine(str(tmp_path / "critic"), "critic", "value")
    assert torch.allclose(again.infer_batch(b)["values"], values, atol=1e-5)


def test_lora_critic_trains_its_head(model_dir, tmp_path):
    from transformers import AutoModelForTokenClassification

    from polyrl.config.roles import EngineRoleConfig, LoRAConfig, ModelConfig, OptimConfig
    from polyrl_engine_fsdp.engine import FSDPEngine

    critic = FSDPEngine(EngineRoleConfig(model=ModelConfig(path=str(model_dir), lora=LoRAConfig(rank=4)),
                                         optim=OptimConfig(lr=1e-2)), role="critic", model_type="value")
    b = batch(seed=2)
    b["returns"] = torch.ones(8, 10)
    for _ in range(3):
        critic.train_batch(b, _vloss)
    values = critic.infer_batch(b)["values"]
    assert values[b["response_mask"] == 1].abs().min() > 0
    critic.export_hf(str(tmp_path / "critic"))
    model = AutoModelForTokenClassification.from_pretrained(tmp_path / "critic")
    ids = b["input_ids"][0][b["attention_mask"][0].bool()][None]
    n = int(b["response_mask"][0].sum())
    with torch.no_grad():
        assert torch.allclose(values[0, :n], model(ids).logits[0, -n - 1 : -1, 0], atol=1e-5)


def test_packed_sequences_match_padded(model_dir):
    from polyrl_engine_fsdp.engine import _model_inputs

    b = batch(seed=3)
    inputs = _model_inputs(b, packed=True)
    assert inputs["input_ids"].shape == (1, int(b["attention_mask"].sum())) and inputs["attention_mask"] is None
    padded, packed = make_engine(str(model_dir)), make_engine(str(model_dir), use_remove_padding=True)
    out1, out2 = padded.infer_batch(b, compute_entropy=True), packed.infer_batch(b, compute_entropy=True)
    assert torch.allclose(out1["log_probs"], out2["log_probs"], atol=1e-5)
    assert torch.allclose(out1["entropy"], out2["entropy"], atol=1e-5)
    m1, m2 = padded.train_batch(b, loss_fn), packed.train_batch(b, loss_fn)
    assert m1["actor/grad_norm"] == pytest.approx(m2["actor/grad_norm"], rel=1e-5)
    b["returns"] = torch.ones(8, 10)
    critics = [make_engine(str(model_dir), "critic", "value", use_remove_padding=flag) for flag in (False, True)]
    for critic in critics:
        critic.train_batch(b, _vloss)  # a non-zero head, so the comparison below means something
    values = [critic.infer_batch(b)["values"] for critic in critics]
    assert values[0].abs().sum() > 0 and torch.allclose(values[0], values[1], atol=1e-5)


def test_gradient_checkpointing_gives_the_same_step(model_dir):
    b = batch(seed=5)
    from polyrl_engine_fsdp.engine import FSDPEngine

    plain = make_engine(str(model_dir))
    cfg = make_engine(str(model_dir)).config
    cfg.model.gradient_checkpointing = True
    ckpt = FSDPEngine(cfg, role="actor")
    model = ckpt.module.model
    assert getattr(model, "is_activation_checkpointing", None) or model.is_gradient_checkpointing
    m1, m2 = plain.train_batch(b, loss_fn), ckpt.train_batch(b, loss_fn)
    assert m1["actor/grad_norm"] == pytest.approx(m2["actor/grad_norm"], rel=1e-5)


def test_bf16_mixed_precision_trains(model_dir):
    from polyrl_engine_fsdp.config import FSDPConfig

    b = batch(seed=6)
    engine = make_engine(str(model_dir), plugin_config=FSDPConfig(param_dtype="bfloat16", reduce_dtype="float32"))
    before = engine.infer_batch(b)["log_probs"]
    fp32 = make_engine(str(model_dir)).infer_batch(b)["log_probs"]
    assert not torch.equal(before, fp32) and torch.allclose(before, fp32, atol=0.1)  # bf16 compute, close to fp32
    m = engine.train_batch(b, loss_fn)
    assert 0 < m["actor/grad_norm"] < float("inf")
    assert not torch.allclose(before, engine.infer_batch(b)["log_probs"])
    assert all(p.dtype == torch.float32 for p in engine.module.parameters())  # storage stays model.dtype


def _long_prompt_batch(prompt_tokens: int, rows: int = 4):
    from polyrl.agent_loops import collate
    from polyrl.protocols import AgentLoopOutput

    g = torch.Generator().manual_seed(9)
    prompt = torch.randint(5, 200, (prompt_tokens,), generator=g).tolist()
    outs = [AgentLoopOutput(prompt_ids=prompt, response_ids=torch.randint(5, 200, (6,), generator=g).tolist(),
                            response_mask=[1] * 6) for _ in range(rows)]
    b = collate(outs, pad_token_id=0, max_prompt_length=prompt_tokens, max_response_length=6)
    b["advantages"] = torch.randn(rows, 1, generator=g).expand(rows, 6).contiguous()
    b["old_log_probs"] = torch.zeros(rows, 6)
    return b


def test_a_slow_param_dtype_on_this_cpu_is_warned_about(model_dir, monkeypatch, caplog):
    """``actor.fsdp.param_dtype=bfloat16`` on a CPU that multiplies bf16 far slower than float32 (an AVX2-only host
    measured 50x; the probe's result is set here, polyrl.platforms.precision's own tests measure it): one warning
    naming the key and the fix when the model is set up; none for float32."""
    import logging

    from polyrl.platforms import precision
    from polyrl_engine_fsdp.config import FSDPConfig

    monkeypatch.setattr(precision, "_SLOWDOWN", {torch.bfloat16: 50.0})
    monkeypatch.setattr(precision, "_WARNED", set())
    with caplog.at_level(logging.WARNING, logger="polyrl.platforms"):
        make_engine(str(model_dir), plugin_config=FSDPConfig(fsdp_size=1))
        assert not [r for r in caplog.records if r.name == "polyrl.platforms"]
        make_engine(str(model_dir), plugin_config=FSDPConfig(fsdp_size=1, param_dtype="bfloat16"))
    warnings = [r.getMessage() for r in caplog.records if r.name == "polyrl.platforms"]
    assert len(warnings) == 1 and warnings[0].startswith("actor.fsdp.param_dtype=bfloat16: ")
    assert "set actor.fsdp.param_dtype=float32" in warnings[0]


def test_bf16_on_whole_copies_is_autocast(model_dir):
    """``fsdp_size=1`` with ``param_dtype=bfloat16``: a whole model per rank (no FSDP wrapping) whose forward runs
    under autocast with its attention in float32 (on a CPU), its residual stream and its norms' outputs in bf16 (as
    with bf16 weights), on short rows and on 150-token shared prompts: log-probs and the gradient norm close to
    float32's but not equal, weights kept in float32."""
    from polyrl_engine_fsdp.config import FSDPConfig
    from polyrl_engine_fsdp.engine import FLOAT32_SDPA

    for b in (batch(seed=8, rows=8, group=4), _long_prompt_batch(150)):
        mixed = make_engine(str(model_dir), plugin_config=FSDPConfig(fsdp_size=1, param_dtype="bfloat16"))
        full = make_engine(str(model_dir), plugin_config=FSDPConfig(fsdp_size=1))
        assert mixed.replicated and not any("FSDP" in type(m).__name__ for m in mixed.module.modules())
        assert mixed.module.model.config._attn_implementation == FLOAT32_SDPA
        assert full.module.model.config._attn_implementation == "sdpa"
        seen: dict[tuple[str, str], torch.dtype] = {}
        for name, engine in (("mixed", mixed), ("full", full)):
            layer = engine.module.model.model.layers[0]
            hooks = [part.register_forward_hook(lambda m, a, out, key=(name, what), seen=seen: seen.update(
                {key: (out[0] if isinstance(out, tuple) else out).dtype}))
                for what, part in (("residual", layer), ("norm", layer.input_layernorm))]
            engine.infer_batch(b)
            for hook in hooks:
                hook.remove()
        assert seen == {("mixed", "residual"): torch.bfloat16, ("mixed", "norm"): torch.bfloat16,
                        ("full", "residual"): torch.float32, ("full", "norm"): torch.float32}
        low, exact = mixed.infer_batch(b)["log_probs"], full.infer_batch(b)["log_probs"]
        assert not torch.equal(low, exact) and torch.allclose(low, exact, atol=0.1)
        m_low, m_exact = mixed.train_batch(b, loss_fn), full.train_batch(b, loss_fn)
        assert m_low["actor/grad_norm"] == pytest.approx(m_exact["actor/grad_norm"], rel=0.1)
        assert all(p.dtype == torch.float32 for p in mixed.module.parameters())
        assert not torch.allclose(low, mixed.infer_batch(b)["log_probs"])  # it trained


@pytest.mark.parametrize("queries,keys,masked", [(6, 6, False), (4, 11, True)])
def test_grouped_query_attention_is_transformers_sdpa(queries, keys, masked):
    """The float32 attention's GQA without repeated keys: the same outputs and gradients as transformers' ``sdpa``
    on the repeated ones, causal (no mask) and with a padding mask over cached keys; ``None`` (the caller falls
    back) for one query, no mask over cached keys, or an unknown keyword."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from polyrl_engine_fsdp.engine import _grouped_query_attention

    class Attn(torch.nn.Module):
        num_key_value_groups, is_causal = 3, True

    g = torch.Generator().manual_seed(queries + keys)
    q, k, v = (torch.randn(2, h, n, 8, generator=g, requires_grad=True) for h, n in ((6, queries), (2, keys), (2, keys)))
    mask = None
    if masked:  # causal after the cache, the first two keys of row 1 padding
        mask = torch.ones(queries, keys, dtype=torch.bool).tril(keys - queries)[None, None].repeat(2, 1, 1, 1)
        mask[1, :, :, :2] = False
    ours = _grouped_query_attention(Attn(), q, k, v, mask, scaling=0.3, use_cache=True, position_ids=None)
    theirs, _ = sdpa_attention_forward(Attn(), q, k, v, mask, scaling=0.3)
    assert ours.shape == (2, queries, 6, 8) and torch.allclose(ours, theirs, atol=1e-6)
    grads = [torch.autograd.grad((out * torch.arange(out.numel()).view_as(out).sin()).sum(), (q, k, v))
             for out in (ours, theirs)]
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(*grads))
    assert _grouped_query_attention(Attn(), q[:, :, :1], k, v, None) is None
    assert _grouped_query_attention(Attn(), q[:, :, :3], k[:, :, :5], v[:, :, :5], None) is None
    assert _grouped_query_attention(Attn(), q, k, v, mask, softcap=30.0) is None


def test_warmup_and_cosine_schedule(model_dir):
    from polyrl.config.roles import OptimConfig

    engine = make_engine(str(model_dir))
    engine.config.optim = OptimConfig(lr=1e-3, lr_warmup_steps=2, lr_scheduler_type="cosine", total_steps=6,
                                      min_lr_ratio=0.1)
    engine._build_optimizer()
    b = batch(seed=7)
    lrs = [engine.train_batch(b, loss_fn)["actor/lr"] for _ in range(6)]
    assert lrs[:2] == pytest.approx([5e-4, 1e-3])
    assert lrs[2] == pytest.approx(1e-3) and lrs[5] < lrs[4] < lrs[3] < lrs[2]
    assert lrs[5] > 1e-4


def test_bad_inputs(model_dir, tmp_path):
    from polyrl.config.roles import EngineRoleConfig, LoRAConfig, ModelConfig
    from polyrl_engine_fsdp.engine import FSDPEngine

    with pytest.raises(ConfigError, match=r"actor\.model\.path=.*nope: no such folder"):
        FSDPEngine(EngineRoleConfig(model=ModelConfig(path=str(tmp_path / "nope"))), role="actor")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"critic\.model\.path=.*config\.json is missing"):
        FSDPEngine(EngineRoleConfig(model=ModelConfig(path=str(tmp_path / "empty"))), role="critic", model_type="value")
    import json
    import shutil

    classifier = tmp_path / "classifier"
    shutil.copytree(model_dir, classifier)
    conf = json.loads((classifier / "config.json").read_text())
    conf["architectures"] = ["Qwen2ForSequenceClassification"]
    (classifier / "config.json").write_text(json.dumps(conf))
    with pytest.raises(ConfigError, match="is not a causal LM"):
        FSDPEngine(EngineRoleConfig(model=ModelConfig(path=str(classifier))), role="actor")
    from polyrl_engine_fsdp.config import FSDPConfig

    with pytest.raises(ConfigError, match=r"actor.fsdp.param_dtype='bf16' is not a torch dtype"):
        make_engine(str(model_dir), plugin_config=FSDPConfig(param_dtype="bf16"))
    with pytest.raises(ConfigError, match=r"actor.model.lora.sync='both'"):
        FSDPEngine(EngineRoleConfig(model=ModelConfig(path=str(model_dir), lora=LoRAConfig(rank=2, sync="both"))),
                   role="actor")
    with pytest.raises(ConfigError, match="use_remove_padding=true needs"):
        FSDPEngine(EngineRoleConfig(model=ModelConfig(path=str(model_dir), attn_implementation="my_kernel"),
                                    use_remove_padding=True), role="actor")
    with pytest.raises(ConfigError, match=r"target_modules=\['nothing_here'\] matches no module"):
        FSDPEngine(EngineRoleConfig(model=ModelConfig(path=str(model_dir),
                                                      lora=LoRAConfig(rank=2, target_modules=["nothing_here"]))),
                   role="actor")
    engine = make_engine(str(model_dir))
    engine.save_checkpoint(str(tmp_path / "ck"))
    other = tmp_path / "other"
    from polyrl.models.tiny import make_tiny_model

    make_tiny_model(other, size="tiny", num_hidden_layers=3)
    with pytest.raises(CheckpointError, match="different model"):
        make_engine(str(other)).load_checkpoint(str(tmp_path / "ck"))
    import json

    meta = json.loads((tmp_path / "ck" / "meta.json").read_text())
    meta["world_size"] = 4
    (tmp_path / "ck" / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="written by 4 ranks"):
        engine.load_checkpoint(str(tmp_path / "ck"))
    with pytest.raises(KeyError, match="position_ids"):
        engine.train_batch(batch().exclude("position_ids"), loss_fn)


def test_crash_mid_save_leaves_previous_checkpoint(model_dir, tmp_path, monkeypatch):
    engine = make_engine(str(model_dir))
    b = batch()
    engine.save_checkpoint(str(tmp_path / "ck"))
    saved = engine.infer_batch(b)["log_probs"]
    engine.train_batch(b, loss_fn)
    import torch.distributed.checkpoint as dcp

    def boom(*a, **k):
        raise RuntimeError("disk full")

    monkeypatch.setattr(dcp, "save", boom)
    with pytest.raises(RuntimeError, match="disk full"):
        engine.save_checkpoint(str(tmp_path / "ck"))
    monkeypatch.undo()
    engine.load_checkpoint(str(tmp_path / "ck"))
    assert torch.allclose(engine.infer_batch(b)["log_probs"], saved)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda(model_dir, tmp_path):
    """One CUDA device, nccl, in a fresh process: the same promises as on CPU, plus memory actually freed."""
    import json

    port = str(free_port())
    # prepend: the child must still find polyrl where this process does (a --target install, PYTHONPATH)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH", "")) if p))
    done = subprocess.run([sys.executable, str(HERE / "dist_worker.py"), "0", "1", port, str(model_dir), str(tmp_path),
                           "cuda"], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads((tmp_path / "cuda.json").read_text())
    assert found["device"].startswith("cuda")
    assert found["max_err_vs_cpu_transformers"] < 1e-3
    assert 0 < found["grad_norm"] < float("inf") and found["changed"]
    assert found["reload_err"] < 1e-6 and found["onload_err"] < 1e-6
    assert found["sent_on_device"] and found["offload_freed_bytes"] > 0
    assert 0 < found["bf16_packed_grad_norm"] < float("inf") and found["bf16_err_vs_fp32"] < 0.1
    assert found["offloaded_optimizer_state_devices"] == ["cpu"]


@pytest.mark.parametrize("size", [0, -2])
def test_bad_fsdp_size_names_the_key(model_dir, size):
    from polyrl_engine_fsdp.config import FSDPConfig

    with pytest.raises(ConfigError, match=rf"actor.fsdp.fsdp_size={size} must be -1 or divide"):
        make_engine(str(model_dir), plugin_config=FSDPConfig(fsdp_size=size))


class _Payload:
    """Unpickling this runs ``open(marker, 'w')``: what a planted checkpoint would do."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.mark.parametrize("planted", ["extra", "metadata"])
def test_malicious_checkpoint_is_refused_and_runs_nothing(model_dir, tmp_path, planted):
    import pickle

    engine = make_engine(str(model_dir))
    ck = tmp_path / "ck"
    engine.save_checkpoint(str(ck))
    marker = tmp_path / "pwned"
    if planted == "extra":
        torch.save({"rng": _Payload(str(marker)), "scheduler": None}, ck / "extra_rank0.pt")
    else:
        (ck / ".metadata").write_bytes(pickle.dumps(_Payload(str(marker))))
    with pytest.raises(CheckpointError, match="not loaded|refused"):
        engine.load_checkpoint(str(ck))
    assert not marker.exists(), "loading the checkpoint ran code stored in it"


def test_resume_restores_rng_and_applies_the_configs_lr(model_dir, tmp_path):
    import random

    engine = make_engine(str(model_dir))
    engine.train_batch(batch(), loss_fn)
    torch.manual_seed(123)
    random.seed(7)
    engine.save_checkpoint(str(tmp_path / "ck"))
    expected = (torch.rand(3), random.random())
    lr = engine.optimizer.param_groups[0]["lr"]
    other = make_engine(str(model_dir))
    other.config.optim.lr = engine.config.optim.lr * 10
    other.load_checkpoint(str(tmp_path / "ck"))
    assert torch.equal(torch.rand(3), expected[0]) and random.random() == expected[1]
    assert other.optimizer.param_groups[0]["lr"] == pytest.approx(lr * 10)
    assert other.scheduler.get_last_lr()[0] == pytest.approx(lr * 10)
