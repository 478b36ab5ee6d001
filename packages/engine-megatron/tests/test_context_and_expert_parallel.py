"""Context parallelism, mixtures of experts (expert parallelism), chunked log-probs and the memory options, on CPU:
real megatron-core through the CPU emulation, real gloo groups of 2 processes.

Every comparison is one step of the same batch from the same weights in two layouts: log-probs and entropy before
the step, loss, gradient norm, the updated weights (gathered to HF names) and log-probs after it. The batch has
rows of odd lengths (7 to 17 tokens), which context parallelism pads to a multiple of 2 x CP.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from polyrl.errors import ConfigError
from polyrl.testing import EngineConformance

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from engine_dist import batch, loss_fn, make_engine, role_config  # noqa: E402
from test_megatron_engine import LOSS_RTOL, WEIGHT_ATOL, _run_group  # noqa: E402

TWO_RANKS = ["train:cp2", "train:cp2packed", "critic:cp2", "train:tp2chunk3", "train:tp2unchunked",
             "moe:qwen3_moe:ep2", "moe:qwen3_moe:cp2packed", "moe:mixtral:tp2ep2sp", "export:qwen3_moe:ep2"]
ONE_RANK = ["train:tp1", "train:tp1packed", "critic:tp1", "train:tp1unchunked", "train:tp1chunk3",
            "widest:tp1chunk3", "widest:tp1unchunked", "train:tp1offload", "train:tp1recompute",
            "moe:qwen3_moe:tp1", "moe0:qwen3_moe:tp1", "moe:mixtral:tp1"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from polyrl.models.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("m") / "tiny", size="tiny", seed=0, num_key_value_heads=2)


@pytest.fixture(scope="module")
def runs_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("runs")


@pytest.fixture(scope="module")
def runs(model_dir, runs_dir):
    out = runs_dir
    results = _run_group(2, model_dir, out, TWO_RANKS)
    results.update(_run_group(1, model_dir, out, ONE_RANK))
    return results


def _same_step(got: list[dict], ref: dict, *, values: bool = False) -> None:
    """``got`` (every rank of a layout with one data-parallel group, or two DP ranks) made ``ref``'s step."""
    keys = ("values",) if values else ("log_probs", "entropy")
    dp2 = got[0]["dp_size"] == 2 if "dp_size" in got[0] else False
    before = {k: torch.cat([r["before"][k] for r in got]) for k in keys} if dp2 else got[0]["before"]
    after_key = "values" if values else "log_probs"
    after = torch.cat([r["after"][after_key] for r in got]) if dp2 else got[0]["after"][after_key]
    for k in keys:
        assert torch.allclose(before[k], ref["before"][k], atol=1e-5), k
    prefix = "critic" if values else "actor"
    loss = "vf_loss" if values else "loss"
    for r in got:
        assert r["metrics"][f"{prefix}/grad_norm"] == pytest.approx(ref["metrics"][f"{prefix}/grad_norm"], rel=LOSS_RTOL)
        if not dp2:
            assert r["metrics"][loss] == pytest.approx(ref["metrics"][loss], rel=LOSS_RTOL)
        assert set(r["weights"]) == set(ref["weights"])
        for name, w in ref["weights"].items():
            assert torch.allclose(r["weights"][name], w, atol=WEIGHT_ATOL), name
    assert torch.allclose(after, ref["after"][after_key], atol=1e-5)
    assert not torch.allclose(ref["after"][after_key], ref["before"][after_key]), "the step changed nothing"


# ---------------------------------------------------------------------------- context parallelism


@pytest.mark.parametrize("layout", ["cp2", "cp2packed"])
def test_context_parallel_gives_the_same_step(runs, layout):
    """CP=2 (padded rows, and packed sequences) = CP=1 with megatron's own attention on padded rows."""
    got = runs[f"train:{layout}"]
    assert [r["dp_size"] for r in got] == [1, 1] and [r["collects"] for r in got] == [True, False]
    for r in got[1:]:  # every context-parallel rank returns the whole result
        assert torch.equal(r["before"]["log_probs"], got[0]["before"]["log_probs"])
    _same_step(got, runs["train:tp1"][0])


def test_packed_sequences_without_context_parallelism(runs):
    _same_step(runs["train:tp1packed"], runs["train:tp1"][0])


def test_value_model_with_context_parallelism(runs):
    _same_step(runs["critic:cp2"], runs["critic:tp1"][0], values=True)


def test_context_parallel_chunks_are_load_balanced():
    """megatron's layout: rank r holds chunks r and 2 CP - 1 - r; a length that does not split is refused."""
    from polyrl_engine_megatron.attention import cp_chunk_positions

    assert cp_chunk_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert cp_chunk_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert sorted(torch.cat([cp_chunk_positions(12, 3, r) for r in range(3)]).tolist()) == list(range(12))
    with pytest.raises(ValueError, match="does not split"):
        cp_chunk_positions(6, 2, 0)


def test_packing_pads_each_sequence_for_context_parallelism():
    """The batch's rows have odd lengths; packed for CP=2 each is padded to a multiple of 4 and split in two."""
    from polyrl_engine_megatron.engine import _pack

    b = batch()[:4]
    lengths = b["attention_mask"].sum(-1)
    assert any(int(n) % 4 for n in lengths)
    parts = [_pack(b, cp=2, cp_rank=r, packed=True) for r in (0, 1)]
    cu = parts[0].cu_seqlens
    assert (cu[1:] - cu[:-1]).tolist() == [-(-int(n) // 4) * 4 for n in lengths]
    assert parts[0].input_ids.shape == parts[1].input_ids.shape == (1, int(cu[-1]) // 2)
    # every scored token is predicted on exactly one rank
    assert sorted(torch.cat([p.mine for p in parts]).tolist()) == list(range(len(parts[0].rows)))


# ---------------------------------------------------------------------------- chunked log-probs, memory options


def test_chunked_log_probs_equal_unchunked(runs):
    """Log-probs 3 tokens at a time (recomputed in the backward) = megatron's output layer over every position;
    with vocabulary parallelism (TP=2) too."""
    _same_step(runs["train:tp1chunk3"], runs["train:tp1unchunked"][0])
    _same_step(runs["train:tp2chunk3"], runs["train:tp2unchunked"][0])


def test_chunked_log_probs_never_hold_more_than_a_chunk_of_logits(runs):
    """Every tensor created during a train step that ends in the vocabulary: at most 3 rows with chunks of 3; the
    unchunked path holds the logits of every position of a micro-batch."""
    chunked, unchunked = runs["widest:tp1chunk3"][0], runs["widest:tp1unchunked"][0]
    assert chunked["widest"] == 3
    assert unchunked["widest"] >= 2 * 7  # 2 rows of at least 7 positions


@pytest.mark.parametrize("layout", ["tp1offload", "tp1recompute"])
def test_activation_offload_and_recomputation_give_the_same_step(runs, layout):
    _same_step(runs[f"train:{layout}"], runs["train:tp1"][0])


# ---------------------------------------------------------------------------- mixtures of experts


@pytest.mark.parametrize("layout", ["qwen3_moe:ep2", "qwen3_moe:cp2packed", "mixtral:tp2ep2sp"])
def test_expert_parallel_gives_the_same_step(runs, layout):
    """EP=2 (experts split, tokens exchanged all-to-all; the ranks are data-parallel for the rest), CP=2 with packed
    sequences (padding left out of the load-balancing loss), and TP=2 x EP=2 (expert TP 1, sequence parallel) = one
    rank holding every expert, load-balancing loss included."""
    arch = layout.split(":")[0]
    ref = runs[f"moe:{arch}:tp1"][0]
    got = runs[f"moe:{layout}"]
    _same_step(got, ref)
    name = "actor/moe_load_balancing_loss"
    assert 0.5 < ref["metrics"][name] < 4  # E * sum_i f_i P_i is 1 for a perfectly balanced router
    for r in got:
        assert r["metrics"][name] == pytest.approx(ref["metrics"][name], rel=1e-5)


def test_the_load_balancing_loss_is_trained(runs):
    with_loss, without = runs["moe:qwen3_moe:tp1"][0], runs["moe0:qwen3_moe:tp1"][0]
    assert "actor/moe_load_balancing_loss" not in without["metrics"]
    assert with_loss["metrics"]["actor/grad_norm"] != pytest.approx(without["metrics"]["actor/grad_norm"], rel=1e-6)
    router = "model.layers.0.mlp.gate.weight"
    assert not torch.allclose(with_loss["weights"][router], without["weights"][router], atol=1e-7)


def test_moe_step_matches_the_fsdp_engine(runs, runs_dir):
    """The same Qwen3-MoE step on engine-fsdp (transformers' own MoE blocks, no load-balancing loss, as HF trains
    unless output_router_logits): log-probs, entropy, loss, gradient norm and updated weights."""
    from safetensors.torch import load_file

    from polyrl.config.roles import EngineRoleConfig, ModelConfig
    from polyrl.platforms import CPUPlatform
    from polyrl_engine_fsdp.engine import FSDPEngine

    mega = runs["moe0:qwen3_moe:tp1"][0]
    folder = runs_dir / "qwen3_moe"
    cfg = role_config(str(folder))
    fsdp = FSDPEngine(EngineRoleConfig(model=ModelConfig(path=str(folder)), optim=cfg.optim,
                                       micro_batch_size=cfg.micro_batch_size), role="actor", platform=CPUPlatform())
    b = batch()
    before = fsdp.infer_batch(b, compute_entropy=True, temperature=0.9)
    assert torch.allclose(before["log_probs"], mega["before"]["log_probs"], atol=1e-5)
    assert torch.allclose(before["entropy"], mega["before"]["entropy"], atol=1e-5)
    metrics = fsdp.train_batch(b, loss_fn, temperature=0.9)
    assert metrics["loss"] == pytest.approx(mega["metrics"]["loss"], rel=1e-5)
    assert metrics["actor/grad_norm"] == pytest.approx(mega["metrics"]["actor/grad_norm"], rel=1e-5)
    # transformers keeps experts fused in memory (experts.gate_up_proj [E, 2I, H]); megatron streams checkpoint names
    from transformers import AutoModelForCausalLM
    from transformers.core_model_loading import revert_weight_conversion

    weights = revert_weight_conversion(AutoModelForCausalLM.from_pretrained(folder),
                                       {n: t for bucket in fsdp.weights_for_rollout() for n, t in bucket})
    initial = load_file(str(folder / "model.safetensors"))
    lr, wd = cfg.optim.lr, cfg.optim.weight_decay
    for name, w in mega["weights"].items():  # megatron exempts norms (1-D) from weight decay, fsdp does not
        expected = w - lr * wd * initial[name] if w.dim() == 1 else w
        assert torch.allclose(weights[name], expected, atol=1e-5), name


def test_moe_export_loads_in_transformers(runs):
    """After an EP=2 step, export_hf writes per-expert checkpoint names; transformers loads them and computes the
    engine's log-probs."""
    rank0 = runs["export:qwen3_moe:ep2"][0]
    assert "model.layers.0.mlp.experts.3.down_proj.weight" in rank0["names"]
    assert not any("gate_up_proj" in n for n in rank0["names"])
    ref = runs["moe:qwen3_moe:tp1"][0]  # the same step on one rank
    assert torch.allclose(rank0["hf_log_probs"], ref["after"]["log_probs"], atol=1e-5)


# ---------------------------------------------------------------------------- bad input, before any process group


def _size(model_dir, world, **kw):
    from polyrl_engine_megatron.engine import MegatronEngine

    return MegatronEngine.data_parallel_size(role_config(str(model_dir), **kw), world)


def test_context_parallel_layout_errors(model_dir):
    with pytest.raises(ConfigError, match=r"actor\.megatron\.context_parallel_size \(3\)"):
        _size(model_dir, 4, context_parallel_size=3)
    assert _size(model_dir, 4, context_parallel_size=2) == 2


def test_expert_parallel_layout_errors(model_dir, tmp_path):
    from polyrl.models.tiny import make_tiny_model

    moe = make_tiny_model(tmp_path / "moe", arch="qwen3_moe", num_key_value_heads=2)  # 4 experts
    with pytest.raises(ConfigError, match=r"^actor\.megatron\.expert_model_parallel_size \(3\) must divide the "
                                          r"model's num_experts \(4\)"):
        _size(moe, 3, expert_model_parallel_size=3)
    with pytest.raises(ConfigError, match=r"expert_model_parallel_size \(4\) x expert tensor parallel \(1\)"):
        _size(moe, 2, expert_model_parallel_size=4)
    with pytest.raises(ConfigError, match=r"actor\.megatron\.sequence_parallel must be true"):
        _size(moe, 2, tp=2)
    with pytest.raises(ConfigError, match=r"expert_model_parallel_size is set, but qwen2 is not a mixture"):
        _size(model_dir, 2, expert_model_parallel_size=2)
    with pytest.raises(ConfigError, match=r"actor\.megatron\.moe_aux_loss_coeff=0\.01 is set, but"):
        _size(model_dir, 1, moe_aux_loss_coeff=0.01)
    with pytest.raises(ConfigError, match=r"moe_token_dispatcher_type='flex'"):
        _size(moe, 1, moe_token_dispatcher_type="flex")
    assert _size(moe, 2, expert_model_parallel_size=2) == 2


def test_megatron_block_keys_are_checked(model_dir):
    from polyrl_engine_megatron.engine import MegatronEngine

    cfg = role_config(str(model_dir))
    cfg.plugin_config.override_transformer_config = {"no_such_field": 1}
    with pytest.raises(ConfigError, match=r"override_transformer_config\.no_such_field"):
        MegatronEngine.data_parallel_size(cfg, 1)
    with pytest.raises(ConfigError, match=r"recompute_granularity=full needs"):
        _size(model_dir, 1, recompute_granularity="full")


@pytest.mark.parametrize(("model_type", "words"), [("deepseek_v3", "multi-latent attention"),
                                                   ("qwen2_moe", "gated shared expert")])
def test_moe_family_without_converter(tmp_path, model_type, words):
    from transformers import AutoConfig

    AutoConfig.for_model(model_type).save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match=rf"model_type '{model_type}' has no HF <-> Megatron converter.*{words}"):
        _size(tmp_path, 1)


class TestMegatronMoEConformance(EngineConformance):
    """The Engine protocol on a tiny Qwen3-MoE: checkpoints, the rollout weight stream (per-expert names), value
    model, micro-batching (no load-balancing loss here: megatron's ``aux_loss`` is computed per micro-batch, so
    with it the micro-batch size changes the step, as in megatron-lm)."""

    @pytest.fixture(scope="class")
    def moe_dir(self, tmp_path_factory):
        from polyrl.models.tiny import make_tiny_model

        return make_tiny_model(tmp_path_factory.mktemp("moe") / "qwen3_moe", arch="qwen3_moe", num_key_value_heads=2)

    @pytest.fixture
    def model_dir(self, moe_dir):
        return moe_dir

    @pytest.fixture
    def engine_factory(self, moe_dir):
        return lambda role="actor", model_type="causal_lm", **kw: make_engine(str(moe_dir), role, model_type, **kw)
