"""The FSDP2 engine on CPU with real gloo process groups."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from polyrl.controller.distributed import free_port
from polyrl.errors import CheckpointError, ConfigError
from polyrl.testing import EngineConformance

sys.path.insert(0, str(Path(__file__).parent))
from dist_worker import batch, loss_fn, make_engine  # noqa: E402

HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from polyrl.models.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("m") / "tiny", size="tiny", seed=0)


class TestFSDPConformance(EngineConformance):
    @pytest.fixture
    def engine_factory(self, model_dir):
        return lambda role="actor", model_type="causal_lm", **kw: make_engine(str(model_dir), **kw)


def _run_group(world: int, model_dir: Path, out: Path, scenario: str = "plain") -> dict:
    port = str(free_port())
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(HERE))
    procs = [subprocess.Popen([sys.executable, str(HERE / "dist_worker.py"), str(r), str(world), port, str(model_dir),
                               str(out), scenario], env=env, stderr=subprocess.PIPE, text=True) for r in range(world)]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
    return torch.load(out / f"result_{world}.pt")


def test_two_processes_match_one(model_dir, tmp_path):
    one = _run_group(1, model_dir, tmp_path)
    two = _run_group(2, model_dir, tmp_path)
    assert one["results"]["grad_norm"] == pytest.approx(two["results"]["grad_norm"], rel=1e-6)
    assert set(one["weights"]) == set(two["weights"])
    for name, w in one["weights"].items():
        assert torch.allclose(w, two["weights"][name], atol=1e-6), name


def test_save_load_continue_equals_uninterrupted(model_dir, tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    straight = _run_group(2, model_dir, tmp_path / "a")
    resumed = _run_group(2, model_dir, tmp_path / "b", "resume")
    assert straight["results"]["grad_norm"] == pytest.approx(resumed["results"]["grad_norm"], abs=1e-6)
    for name, w in straight["weights"].items():
        assert torch.allclose(w, resumed["weights"][name], atol=1e-6), name


def test_dynamic_micro_batches_give_the_same_gradients(model_dir):
    b = batch(seed=4)
    fixed = make_engine(str(model_dir), micro_batch_size=3)
    dynamic = make_engine(str(model_dir), use_dynamic_bsz=True, max_token_len_per_gpu=24)
    m1, m2 = fixed.train_batch(b, loss_fn), dynamic.train_batch(b, loss_fn)
    assert m1["actor/grad_norm"] == pytest.approx(m2["actor/grad_norm"], rel=1e-5)
    w1 = dict(p for bucket in fixed.weights_for_rollout() for p in bucket)
    w2 = dict(p for bucket in dynamic.weights_for_rollout() for p in bucket)
    assert all(torch.allclose(w1[n], w2[n], atol=1e-6) for n in w1)
    assert len(dynamic._micro_batches(b)) > 1


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


def test_value_model_trains(model_dir):
    from polyrl.config.roles import EngineRoleConfig, ModelConfig, OptimConfig
    from polyrl_engine_fsdp.engine import FSDPEngine

    critic = FSDPEngine(EngineRoleConfig(model=ModelConfig(path=str(model_dir)), optim=OptimConfig(lr=1e-2)),
                        role="critic", model_type="value")
    b = batch(seed=2)
    b["returns"] = torch.ones(8, 10)

    def vloss(out, mb, scale):
        from polyrl.algorithms import agg_loss

        loss = agg_loss((out["values"] - mb["returns"]) ** 2, mb["response_mask"], "token-mean", loss_scale=scale)
        return loss, {"vf": float(loss.detach())}

    first = critic.train_batch(b, vloss)["vf"]
    for _ in range(10):
        last = critic.train_batch(b, vloss)["vf"]
    assert last < first * 0.6
    assert critic.infer_batch(b)["values"].shape == (8, 10)


def test_bad_inputs(model_dir, tmp_path):
    from polyrl.config.roles import EngineRoleConfig, LoRAConfig, ModelConfig
    from polyrl_engine_fsdp.engine import FSDPEngine

    with pytest.raises(ConfigError, match="config.json is missing"):
        FSDPEngine(EngineRoleConfig(model=ModelConfig(path=str(tmp_path / "nope"))), role="actor")
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
def test_trains_on_cuda(model_dir):
    from polyrl.platforms import CUDAPlatform

    engine = make_engine(str(model_dir))
    assert engine.platform.name == CUDAPlatform.name
    b = batch()
    before = engine.infer_batch(b)["log_probs"]
    engine.train_batch(b, loss_fn)
    assert not torch.allclose(before, engine.infer_batch(b)["log_probs"])
