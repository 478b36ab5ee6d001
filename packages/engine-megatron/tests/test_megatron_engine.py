"""The megatron engine on CPU: real megatron-core, real gloo process groups of up to 2 processes.

The 2-process runs start once per test module (``two_ranks``) and run several layouts in a row, each with its
own megatron parallel state: process start-up (importing megatron-core, transformers) is the slow part.
"""

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

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from engine_dist import batch, loss_fn, make_engine, role_config, value_loss_fn  # noqa: E402

#: same batch, same weights: how far two layouts (or two engines) may differ. Float32 sums in another order
#: (TP splits matmuls and the vocabulary, PP sends activations, DP all-reduces gradients).
LOSS_RTOL = 1e-5
WEIGHT_ATOL = 1e-6
#: megatron vs the fsdp engine: different kernels (megatron's attention and fused QKV vs transformers' sdpa),
#: and Adam's for-loop vs fused implementation
FSDP_LOSS_RTOL = 1e-5
FSDP_WEIGHT_ATOL = 1e-5


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from polyrl.models.tiny import make_tiny_model

    # two KV heads, so TP=2 splits them
    return make_tiny_model(tmp_path_factory.mktemp("m") / "tiny", size="tiny", seed=0, num_key_value_heads=2)


def _run_group(world: int, model_dir: Path, out: Path, scenarios: list[str]) -> dict[str, list[dict]]:
    """Run ``scenarios`` in a fresh gloo group of ``world`` processes; ``{scenario: [rank results]}``."""
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH", "")) if p))
    out.mkdir(parents=True, exist_ok=True)
    for _attempt in range(3):  # the free port can be taken before rank 0 binds it
        port = str(free_port())
        procs = [subprocess.Popen([sys.executable, str(HERE / "engine_dist.py"), str(r), str(world), port,
                                   str(model_dir), str(out), ",".join(scenarios)], env=env, stderr=subprocess.PIPE,
                                  text=True) for r in range(world)]
        errs = []
        for p in procs:
            try:
                errs.append(p.communicate(timeout=600)[1])
            except subprocess.TimeoutExpired:
                p.kill()
                errs.append(p.communicate()[1] + "\n(timed out)")
        if all(p.returncode == 0 for p in procs):
            return {s: [torch.load(out / f"{s.replace(':', '_')}_rank{r}.pt", weights_only=True) for r in range(world)]
                    for s in scenarios}
        if not any("address already in use" in e.lower() for e in errs):
            break
    raise AssertionError("\n".join(f"rank {r} exited {p.returncode}:\n{e[-4000:]}"
                                   for r, (p, e) in enumerate(zip(procs, errs)) if p.returncode))


LAYOUTS = ["train:tp2", "train:tp2sp", "train:pp2", "train:dp2", "train:dp2dist"]


@pytest.fixture(scope="module")
def runs_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("runs")


@pytest.fixture(scope="module")
def two_ranks(model_dir, runs_dir):
    """Every 2-process scenario, in one group start (``save:tp2`` writes the checkpoint the loads read)."""
    return _run_group(2, model_dir, runs_dir, ["vocab", *LAYOUTS, "critic:tp2sp", "qwen3:tp2sp", "qwen3:dp2",
                                                  "save:tp2", "load:pp2"])


@pytest.fixture(scope="module")
def one_rank(model_dir, runs_dir, two_ranks):
    return _run_group(1, model_dir, runs_dir, ["train:tp1", "critic:tp1", "load:tp1"])


# ---------------------------------------------------------------------------- vocabulary-parallel log-softmax


def test_vocab_parallel_log_probs_match_the_full_softmax(two_ranks):
    ranks = two_ranks["vocab"]
    full, targets = ranks[0]["full"].clone().requires_grad_(True), ranks[0]["targets"]
    logp = torch.log_softmax(full / 0.7, -1)
    lp = logp.gather(-1, targets[:, None]).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    (lp.sum() + 0.5 * ent.sum()).backward()
    for rank, result in enumerate(ranks):
        assert torch.allclose(result["log_probs"], lp.detach(), atol=1e-6)
        assert torch.allclose(result["entropy"], ent.detach(), atol=1e-6)
        assert torch.allclose(result["grad"], full.grad[:, rank * 5 : (rank + 1) * 5], atol=1e-6)


# ---------------------------------------------------------------------------- layouts agree


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layouts_give_the_same_step(two_ranks, one_rank, layout):
    """TP=2 (also with sequence parallelism), PP=2, DP=2 (also with the distributed optimizer) = TP=1 on the same
    batch. Sequence parallelism: the norms' gradients are partial sums over the tensor-parallel ranks (without
    megatron's all-reduce of them the gradient norm differs by 4e-5 relative and the weights by 2e-3)."""
    ref = one_rank["train:tp1"][0]
    results = two_ranks[layout]
    sp = layout.endswith("sp")
    # 2 norms per layer and the final one, ours only under sequence parallelism
    assert all(r["sequence_parallel"] == sp and r["sp_norms"] == (5 if sp else 0) for r in results)
    if layout.startswith("train:dp2"):
        assert [r["dp_rank"] for r in results] == [0, 1] and all(r["collects"] for r in results)
        # each DP rank computed its own half of the rows
        got = {k: torch.cat([r["before"][k] for r in results]) for k in ref["before"]}
        after = torch.cat([r["after"]["log_probs"] for r in results])
    else:
        assert [r["dp_size"] for r in results] == [1, 1] and sum(r["collects"] for r in results) == 1
        got, after = results[0]["before"], results[0]["after"]["log_probs"]
        for r in results[1:]:  # every rank returns the collector's result
            assert torch.equal(r["after"]["log_probs"], after)
    for key in ("log_probs", "entropy"):
        assert torch.allclose(got[key], ref["before"][key], atol=1e-5), key
    for r in results:
        m = r["metrics"]
        assert m["actor/grad_norm"] == pytest.approx(ref["metrics"]["actor/grad_norm"], rel=LOSS_RTOL)
        if r["collects"] and not layout.startswith("train:dp2"):
            assert m["loss"] == pytest.approx(ref["metrics"]["loss"], rel=LOSS_RTOL)
        assert set(r["weights"]) == set(ref["weights"])
        for name, w in ref["weights"].items():
            assert torch.allclose(r["weights"][name], w, atol=WEIGHT_ATOL), name
    if layout.startswith("train:dp2"):
        # a metric is the mean of the micro-batches' shares of the loss: the shares of both ranks sum to the loss
        # TP=1: 4 micro-batches, metric = S / (4 G); DP=2: 2 per rank, each share x dp_size, metric = S_rank / G
        total = sum(r["metrics"]["loss"] for r in results)
        assert total == pytest.approx(ref["metrics"]["loss"] * 4, rel=LOSS_RTOL)
    assert torch.allclose(after, ref["after"]["log_probs"], atol=1e-5)
    assert not torch.allclose(ref["after"]["log_probs"], ref["before"]["log_probs"]), "the step changed nothing"


def test_value_model_with_sequence_parallelism_gives_the_same_step(two_ranks, one_rank):
    """The critic's value head gathers the sequence-parallel hidden states: TP=2 with SP = TP=1."""
    ref = one_rank["critic:tp1"][0]
    for r in two_ranks["critic:tp2sp"]:
        assert torch.allclose(r["before"]["values"], ref["before"]["values"], atol=1e-5)
        assert r["metrics"]["vf_loss"] == pytest.approx(ref["metrics"]["vf_loss"], rel=LOSS_RTOL)
        assert r["metrics"]["critic/grad_norm"] == pytest.approx(ref["metrics"]["critic/grad_norm"], rel=LOSS_RTOL)
        for name, w in ref["weights"].items():
            assert torch.allclose(r["weights"][name], w, atol=WEIGHT_ATOL), name
        assert torch.allclose(r["after"]["values"], ref["after"]["values"], atol=1e-5)
    assert not torch.allclose(ref["after"]["values"], ref["before"]["values"]), "the step changed nothing"


def test_qwen3_query_key_norms_with_sequence_parallelism(two_ranks):
    """Qwen3's q/k norms (plain RMSNorm, gradients summed over TP by megatron) under TP=2 with sequence
    parallelism = DP=2 (the layout test shows DP=2 = TP=1)."""
    sp, dp = two_ranks["qwen3:tp2sp"], two_ranks["qwen3:dp2"]
    before = {k: torch.cat([r["before"][k] for r in dp]) for k in ("log_probs", "entropy")}
    for key in before:
        assert torch.allclose(sp[0]["before"][key], before[key], atol=1e-5), key
    assert sp[0]["metrics"]["actor/grad_norm"] == pytest.approx(dp[0]["metrics"]["actor/grad_norm"], rel=LOSS_RTOL)
    assert any("q_norm" in n for n in dp[0]["weights"])
    for name, w in dp[0]["weights"].items():
        assert torch.allclose(sp[0]["weights"][name], w, atol=WEIGHT_ATOL), name
    assert torch.allclose(sp[0]["after"]["log_probs"], torch.cat([r["after"]["log_probs"] for r in dp]), atol=1e-5)


def test_the_batch_has_micro_batches_sequence_parallelism_must_pad():
    """train:tp2sp covers lengths that TP=2 does not divide (the engine pads them to a multiple of TP)."""
    from polyrl_engine_megatron.engine import _pack, _split

    b = batch()
    cfg = role_config("unused")
    packed = [_pack(b[rows], 1).input_ids.shape[1] for rows in _split(b, cfg)]
    assert any(n % 2 for n in packed), packed
    assert all(_pack(b[rows], 2).input_ids.shape[1] % 2 == 0 for rows in _split(b, cfg))


def test_same_step_as_the_fsdp_engine(one_rank, model_dir):
    """Same weights, batch and optimizer settings: the megatron step = the fsdp engine's step."""
    from polyrl.config.roles import EngineRoleConfig, ModelConfig
    from polyrl.platforms import CPUPlatform
    from polyrl_engine_fsdp.engine import FSDPEngine

    mega = one_rank["train:tp1"][0]
    cfg = role_config(str(model_dir))
    fsdp = FSDPEngine(EngineRoleConfig(model=ModelConfig(path=str(model_dir)), optim=cfg.optim,
                                       micro_batch_size=cfg.micro_batch_size), role="actor", platform=CPUPlatform())
    b = batch()
    before = fsdp.infer_batch(b, compute_entropy=True, temperature=0.9)
    assert torch.allclose(before["log_probs"], mega["before"]["log_probs"], atol=1e-5)
    assert torch.allclose(before["entropy"], mega["before"]["entropy"], atol=1e-5)
    metrics = fsdp.train_batch(b, loss_fn, temperature=0.9)
    assert metrics["loss"] == pytest.approx(mega["metrics"]["loss"], rel=FSDP_LOSS_RTOL)
    assert metrics["actor/grad_norm"] == pytest.approx(mega["metrics"]["actor/grad_norm"], rel=FSDP_LOSS_RTOL)
    weights = {n: t for bucket in fsdp.weights_for_rollout() for n, t in bucket}
    # megatron exempts biases and norm weights (the 1-D parameters) from weight decay, the fsdp engine's AdamW
    # decays every parameter: there AdamW's decoupled decay took lr * weight_decay * (initial weight) more
    initial = _initial_weights(model_dir)
    lr, wd = cfg.optim.lr, cfg.optim.weight_decay
    assert wd > 0 and any(w.dim() == 1 for w in initial.values())
    for name, w in mega["weights"].items():
        expected = w - lr * wd * initial[name] if w.dim() == 1 else w
        assert torch.allclose(weights[name], expected, atol=FSDP_WEIGHT_ATOL), name


def _initial_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {n: t for f in sorted(Path(model_dir).glob("*.safetensors")) for n, t in load_file(str(f)).items()}


# ---------------------------------------------------------------------------- checkpoints


def test_checkpoint_resumes_into_another_layout(two_ranks, one_rank):
    """Saved with TP=2, loaded with PP=2 and with TP=1: same weights, and the next step is the same step."""
    saved = two_ranks["save:tp2"][0]
    for loaded in (two_ranks["load:pp2"][0], one_rank["load:tp1"][0]):
        assert loaded["step"] == 2  # the saved step, then one more
        assert torch.allclose(loaded["loaded"]["log_probs"], saved["saved"]["log_probs"], atol=1e-6)
        # the optimizer state came back too
        assert loaded["second"]["actor/grad_norm"] == pytest.approx(saved["second"]["actor/grad_norm"], rel=1e-5)
        assert torch.allclose(loaded["after_second"]["log_probs"], saved["after_second"]["log_probs"], atol=1e-5)


def test_load_refuses_another_model(model_dir, tmp_path):
    from polyrl.models.tiny import make_tiny_model

    engine = make_engine(str(model_dir))
    engine.save_checkpoint(str(tmp_path / "ckpt"))
    other = make_tiny_model(tmp_path / "other", size="tiny", seed=0, num_key_value_heads=2, intermediate_size=96)
    with pytest.raises(CheckpointError, match="different model"):
        make_engine(str(other)).load_checkpoint(str(tmp_path / "ckpt"))


def test_load_refuses_an_fsdp_checkpoint(model_dir, tmp_path):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "meta.json").write_text('{"format": "polyrl-fsdp-1"}')
    with pytest.raises(CheckpointError, match="another engine"):
        make_engine(str(model_dir)).load_checkpoint(str(tmp_path / "ckpt"))


class _Payload:
    """Unpickling this runs ``open(marker, 'w')``: what a planted checkpoint would do."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.fixture(scope="module")
def trained_checkpoint(model_dir, tmp_path_factory):
    """A one-rank engine after one step and its checkpoint (megatron writes optimizer state once it exists)."""
    engine = make_engine(str(model_dir))
    engine.train_batch(batch(), loss_fn)
    ck = tmp_path_factory.mktemp("mg") / "ckpt"
    engine.save_checkpoint(str(ck))
    return engine, ck


@pytest.mark.parametrize("planted", [".metadata", "common.pt", "extra_rank0.pt"])
def test_planted_pickle_payload_is_refused_and_runs_nothing(trained_checkpoint, tmp_path, planted):
    """megatron-core's own loaders unpickle the DCP metadata (and, by default settings, common.pt) without an
    allow-list: a payload there ran on resume. Every file now goes through polyrl.checkpoint_io."""
    import pickle
    import shutil

    engine, saved = trained_checkpoint
    ck = tmp_path / "ckpt"
    shutil.copytree(saved, ck)
    marker = tmp_path / "pwned"
    if planted == ".metadata":
        (ck / planted).write_bytes(pickle.dumps(_Payload(str(marker))))
    elif planted == "common.pt":
        torch.save({"optimizer": _Payload(str(marker))}, ck / planted)
    else:
        torch.save({"rng": _Payload(str(marker)), "schedulers": []}, ck / planted)
    with pytest.raises(CheckpointError, match=rf"{planted}.*(not allowed|not plain data|refused)"):
        engine.load_checkpoint(str(ck))
    assert not marker.exists(), "loading the checkpoint ran code stored in it"


def test_intact_checkpoint_still_loads_through_the_safe_loader(trained_checkpoint):
    from polyrl.checkpoint_io import verify_files

    engine, ck = trained_checkpoint
    assert verify_files(ck)  # sizes and digests recorded at save
    before = engine.infer_batch(batch())["log_probs"]
    engine.train_batch(batch(), loss_fn)
    engine.load_checkpoint(str(ck))
    assert torch.allclose(engine.infer_batch(batch())["log_probs"], before, atol=1e-6)


# ---------------------------------------------------------------------------- bad input, before any group


def test_bad_layouts_are_config_errors_naming_the_key(model_dir):
    from polyrl_engine_megatron.engine import MegatronEngine

    with pytest.raises(ConfigError, match="tensor_model_parallel_size"):
        MegatronEngine.data_parallel_size(role_config(str(model_dir), tp=4), 4)  # 2 heads
    with pytest.raises(ConfigError, match="pipeline_model_parallel_size"):
        MegatronEngine.data_parallel_size(role_config(str(model_dir), pp=4), 4)  # 2 layers
    with pytest.raises(ConfigError, match="sequence_parallel"):
        MegatronEngine.data_parallel_size(role_config(str(model_dir), sequence_parallel=True), 2)
    assert MegatronEngine.data_parallel_size(role_config(str(model_dir), tp=2), 4) == 2


def test_layout_errors_name_the_role_the_trainer_asks_for(model_dir):
    from polyrl_engine_megatron.engine import MegatronEngine

    with pytest.raises(ConfigError, match=r"^critic\.megatron\.tensor_model_parallel_size \(4\)"):
        MegatronEngine.data_parallel_size(role_config(str(model_dir), tp=4), 4, role="critic")
    with pytest.raises(ConfigError, match=r"^ref\.megatron\.pipeline_model_parallel_size \(4\)"):
        MegatronEngine.data_parallel_size(role_config(str(model_dir), pp=4), 4, role="ref")


def test_lora_is_a_config_error(model_dir):
    from polyrl_engine_megatron.engine import MegatronEngine

    cfg = role_config(str(model_dir))
    cfg.model.lora.rank = 8
    with pytest.raises(ConfigError, match="lora.rank"):
        MegatronEngine.data_parallel_size(cfg, 1)


def test_unsupported_family_is_a_config_error(tmp_path):
    from polyrl_engine_megatron.engine import MegatronEngine
    from transformers import GPT2Config

    GPT2Config(n_layer=2, n_head=2, n_embd=16, vocab_size=64).save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match="gpt2"):
        MegatronEngine.data_parallel_size(role_config(str(tmp_path)), 1)


def test_registered_through_the_plugin_manager():
    from polyrl.plugins import get_plugin_manager

    pm = get_plugin_manager()
    assert pm.get("engine", "megatron").__name__ == "MegatronEngine"


# ---------------------------------------------------------------------------- the protocol


class TestMegatronConformance(EngineConformance):
    @pytest.fixture
    def engine_factory(self, model_dir):
        return lambda role="actor", model_type="causal_lm", **kw: make_engine(str(model_dir), role, model_type, **kw)

    def test_value_model_layouts(self, model_dir):
        critic = make_engine(str(model_dir), role="critic", model_type="value")
        b = batch()
        first = critic.train_batch(b, value_loss_fn)["vf_loss"]
        assert critic.train_batch(b, value_loss_fn)["vf_loss"] < first
