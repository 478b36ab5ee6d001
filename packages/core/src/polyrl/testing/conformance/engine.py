"""Conformance suite for training engines (``fsdp``, ``megatron``, a plugin's own).

Subclass and provide an ``engine_factory`` fixture: ``factory(role="actor",
model_type="causal_lm", **overrides) -> Engine`` over a tiny causal LM, and a
``model_dir`` fixture (that model's HF folder). Runs in one process (world size 1).
"""

from __future__ import annotations

import pytest
import torch

from polyrl.protocols import AgentLoopOutput, Engine


def _batch():
    from polyrl.agent_loops import collate

    outs = [AgentLoopOutput(prompt_ids=list(range(5, 5 + k)), response_ids=list(range(20, 23 + k)),
                            response_mask=[1] * (3 + k)) for k in range(4)]
    batch = collate(outs, pad_token_id=0, max_prompt_length=8, max_response_length=8)
    batch["advantages"] = torch.linspace(-1, 1, 4)[:, None].expand(4, 8).contiguous()
    return batch


def _loss(out, mb, scale):
    from polyrl.algorithms import agg_loss

    loss = agg_loss(-out["log_probs"] * mb["advantages"], mb["response_mask"], "token-mean", loss_scale=scale)
    return loss, {"test/loss": float(loss.detach())}


class EngineConformance:
    """What every engine promises (see :class:`polyrl.protocols.Engine`)."""

    def test_is_an_engine(self, engine_factory):
        engine = engine_factory()
        assert isinstance(engine, Engine)
        assert engine.dp_size >= 1 and 0 <= engine.dp_rank < engine.dp_size

    def test_infer_shapes_masking_and_validity(self, engine_factory):
        engine, batch = engine_factory(), _batch()
        out = engine.infer_batch(batch, compute_entropy=True)
        assert out["log_probs"].shape == batch["responses"].shape
        assert torch.all(out["log_probs"][batch["response_mask"] == 0] == 0)
        valid = out["log_probs"][batch["response_mask"] == 1]
        assert torch.all(valid <= 0) and torch.all(out["entropy"][batch["response_mask"] == 1] > 0)

    def test_log_probs_match_transformers(self, engine_factory, model_dir):
        from transformers import AutoModelForCausalLM

        engine, batch = engine_factory(), _batch()
        out = engine.infer_batch(batch, temperature=0.8)
        model = AutoModelForCausalLM.from_pretrained(model_dir)
        mask = batch["attention_mask"][3].bool()
        ids = batch["input_ids"][3][mask][None]
        n = int(batch["response_mask"][3].sum())
        logits = model(ids).logits[0, -n - 1 : -1] / 0.8
        ref = torch.log_softmax(logits, -1).gather(-1, ids[0, -n:, None]).squeeze(-1)
        assert torch.allclose(out["log_probs"][3, :n], ref, atol=1e-4)

    def test_train_step_changes_weights_and_reports(self, engine_factory):
        engine, batch = engine_factory(), _batch()
        before = engine.infer_batch(batch)["log_probs"]
        metrics = engine.train_batch(batch, _loss)
        grad_key = next(k for k in metrics if k.endswith("grad_norm"))
        assert metrics[grad_key] > 0 and "test/loss" in metrics
        after = engine.infer_batch(batch)["log_probs"]
        assert not torch.allclose(before, after)

    def test_weights_for_rollout_cover_the_hf_model(self, engine_factory, model_dir):
        from transformers import AutoModelForCausalLM

        engine = engine_factory()
        sent = {n: t for bucket in engine.weights_for_rollout(1 << 16) for n, t in bucket}
        expected = {n: p.shape for n, p in AutoModelForCausalLM.from_pretrained(model_dir).named_parameters()}
        assert {n: t.shape for n, t in sent.items()} == expected

    def test_save_load_round_trip(self, engine_factory, tmp_path):
        engine, batch = engine_factory(), _batch()
        engine.train_batch(batch, _loss)
        engine.save_checkpoint(str(tmp_path / "ckpt"))
        saved = engine.infer_batch(batch)["log_probs"]
        engine.train_batch(batch, _loss)
        engine.load_checkpoint(str(tmp_path / "ckpt"))
        assert torch.allclose(engine.infer_batch(batch)["log_probs"], saved, atol=1e-6)

    def test_export_hf_loads_in_transformers(self, engine_factory, tmp_path):
        from transformers import AutoModelForCausalLM

        engine, batch = engine_factory(), _batch()
        engine.train_batch(batch, _loss)
        engine.export_hf(str(tmp_path / "hf"))
        model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
        ids = batch["input_ids"][3][batch["attention_mask"][3].bool()][None]
        n = int(batch["response_mask"][3].sum())
        ref = torch.log_softmax(model(ids).logits[0, -n - 1 : -1], -1).gather(-1, ids[0, -n:, None]).squeeze(-1)
        assert torch.allclose(engine.infer_batch(batch)["log_probs"][3, :n], ref, atol=1e-4)

    def test_missing_field_names_it(self, engine_factory):
        batch = _batch().exclude("responses")
        with pytest.raises(KeyError, match="responses"):
            engine_factory().infer_batch(batch)
