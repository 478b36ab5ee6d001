"""Conformance suite for training engines (``fsdp``, ``megatron``, a plugin's own).

Subclass it and provide two fixtures::

    class TestMyEngine(EngineConformance):
        @pytest.fixture
        def model_dir(self, tmp_path_factory):        # a tiny causal LM's HF folder
            return make_tiny_model(tmp_path_factory.mktemp("m") / "tiny", size="tiny")

        @pytest.fixture
        def engine_factory(self, model_dir):
            return lambda role="actor", model_type="causal_lm", **overrides: MyEngine(...)

``engine_factory(role=..., model_type=..., **overrides)`` builds an engine over ``model_dir`` with
world size 1; ``overrides`` are :class:`polyrl.config.roles.EngineRoleConfig` fields
(``micro_batch_size``, ``use_dynamic_bsz``, ``max_token_len_per_gpu``). Engines built with the same
arguments must start from the same weights (those of ``model_dir``). Set ``supports_value_model =
False`` on the subclass for an engine without ``model_type="value"``.

The suite uses its own loss (no dependency on :mod:`polyrl.algorithms`), so it tests the engine alone.
"""

from __future__ import annotations

import pytest
import torch

from polyrl.protocols import AgentLoopOutput, Engine, LossScale


def _batch():
    """Four rows with prompts of 1-4 tokens and responses of 3-6, one masked (tool) token in row 2."""
    from polyrl.agent_loops import collate

    outs = []
    for k in range(4):
        mask = [1] * (3 + k)
        if k == 2:
            mask[1] = 0
        outs.append(AgentLoopOutput(prompt_ids=list(range(5, 6 + k)), response_ids=list(range(20 + k, 23 + 2 * k)),
                                    response_mask=mask))
    batch = collate(outs, pad_token_id=0, max_prompt_length=8, max_response_length=8)
    batch["advantages"] = torch.linspace(-1, 1, 4)[:, None].expand(4, 8).contiguous()
    batch["returns"] = torch.linspace(0.5, 1.5, 4)[:, None].expand(4, 8).contiguous()
    return batch


def _token_mean(loss_mat: torch.Tensor, mask: torch.Tensor, scale: LossScale) -> torch.Tensor:
    """Masked token mean normalised by the mini-batch's global token count (what agg_loss does)."""
    assert scale.batch_num_tokens is not None, "Engine.train_batch must pass the mini-batch's token count in LossScale"
    return (loss_mat * mask).sum() / scale.batch_num_tokens * scale.dp_size


def _loss(out, mb, scale):
    loss = _token_mean(-out["log_probs"] * mb["advantages"], mb["response_mask"].float(), scale)
    return loss, {"test/loss": float(loss.detach())}


def _value_loss(out, mb, scale):
    loss = _token_mean((out["values"] - mb["returns"]) ** 2, mb["response_mask"].float(), scale)
    return loss, {"test/vf_loss": float(loss.detach())}


def _hf_log_probs(model, batch, row: int, temperature: float = 1.0) -> torch.Tensor:
    """Log-probs of row ``row``'s response tokens under a transformers model, unpadded."""
    ids = batch["input_ids"][row][batch["attention_mask"][row].bool()][None]
    n = int(batch["attention_mask"][row][-batch["responses"].shape[1]:].sum())
    with torch.no_grad():
        logits = model(ids).logits[0, -n - 1 : -1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, ids[0, -n:, None]).squeeze(-1)


def _grad_key(metrics: dict[str, float]) -> str:
    return next(k for k in metrics if k.endswith("grad_norm"))


class EngineConformance:
    """What every engine promises (see :class:`polyrl.protocols.Engine`)."""

    supports_value_model = True
    #: ``False`` for an engine whose "response" is not tokens (the diffusion engine: trained denoising steps).
    #: The checks that compare with a transformers causal LM are then skipped, and :meth:`make_batch` must
    #: give the engine's own batch with ``response_mask`` and ``advantages`` ``[B, T]`` (and ``log_probs``
    #: are its per-step log-probs, which may be positive: densities).
    token_model = True
    #: A field the engine's forward pass needs (the missing-field test removes it).
    required_field = "responses"

    def make_batch(self):
        """The batch the suite trains and infers on (four rows; token rows by default)."""
        return _batch()

    def _token_only(self) -> None:
        if not self.token_model:
            pytest.skip("compares with a transformers causal LM; this engine's responses are not tokens")

    def test_is_an_engine(self, engine_factory):
        engine = engine_factory()
        assert isinstance(engine, Engine)
        assert engine.role == "actor"
        assert engine.dp_size >= 1 and 0 <= engine.dp_rank < engine.dp_size

    def test_infer_shapes_masking_and_validity(self, engine_factory):
        self._token_only()
        engine, batch = engine_factory(), self.make_batch()
        out = engine.infer_batch(batch, compute_entropy=True)
        mask = batch["response_mask"]
        assert out.batch_size == batch.batch_size
        assert out["log_probs"].shape == out["entropy"].shape == batch["responses"].shape
        assert torch.all(out["log_probs"][mask == 0] == 0) and torch.all(out["entropy"][mask == 0] == 0)
        assert torch.all(out["log_probs"][mask == 1] < 0) and torch.all(out["entropy"][mask == 1] > 0)

    def test_log_probs_match_transformers_at_a_temperature(self, engine_factory, model_dir):
        self._token_only()
        from transformers import AutoModelForCausalLM

        engine, batch = engine_factory(), self.make_batch()
        cold = engine.infer_batch(batch, temperature=0.8)["log_probs"]
        model = AutoModelForCausalLM.from_pretrained(model_dir)
        for row in (1, 3):  # rows without masked tokens
            n = int(batch["response_mask"][row].sum())
            assert torch.allclose(cold[row, :n], _hf_log_probs(model, batch, row, 0.8), atol=1e-4)
        assert not torch.allclose(cold, engine.infer_batch(batch)["log_probs"])

    def test_train_batch_uses_the_temperature_it_is_given(self, engine_factory):
        """``train_batch(..., temperature=t)`` computes the loss on log-probs at ``t``, the same ones
        ``infer_batch(temperature=t)`` returns (an engine that ignored it would train at temperature 1)."""
        self._token_only()
        engine, batch = engine_factory(micro_batch_size=4), self.make_batch()  # one micro-batch: rows in order
        seen: list[torch.Tensor] = []

        def record(out, mb, scale):
            seen.append(out["log_probs"].detach().cpu().clone())
            return _loss(out, mb, scale)

        cold = engine.infer_batch(batch, temperature=0.7)["log_probs"]
        warm = engine.infer_batch(batch)["log_probs"]
        engine.train_batch(batch, record, temperature=0.7)
        assert len(seen) == 1
        got = seen[0]
        width = min(got.shape[1], cold.shape[1])  # engines may trim all-padding columns
        m = batch["response_mask"].bool()[:, :width]
        assert torch.allclose(got[:, :width][m], cold[:, :width][m], atol=1e-5)
        assert not torch.allclose(got[:, :width][m], warm[:, :width][m], atol=1e-3)

    def test_micro_batch_size_does_not_change_results(self, engine_factory):
        batch = self.make_batch()
        one, four = engine_factory(micro_batch_size=1), engine_factory(micro_batch_size=4)
        assert torch.allclose(one.infer_batch(batch)["log_probs"], four.infer_batch(batch)["log_probs"], atol=1e-5)
        # the loss is normalised by global counts, so accumulation over 4 micro-batches equals 1 of 4 rows
        g1, g4 = one.train_batch(batch, _loss), four.train_batch(batch, _loss)
        assert g1[_grad_key(g1)] == pytest.approx(g4[_grad_key(g4)], rel=1e-4)
        assert g1["test/loss"] * 4 == pytest.approx(g4["test/loss"], rel=1e-4)  # mean over micro-batches

    def test_train_step_changes_weights_and_reports(self, engine_factory):
        engine, batch = engine_factory(), self.make_batch()
        before = engine.infer_batch(batch)["log_probs"]
        metrics = engine.train_batch(batch, _loss)
        assert metrics[_grad_key(metrics)] > 0 and "test/loss" in metrics
        assert any(k == "lr" or k.endswith("/lr") for k in metrics)
        assert all(isinstance(v, float) for v in metrics.values())
        after = engine.infer_batch(batch)["log_probs"]
        assert not torch.allclose(before, after)
        # the step followed the gradient: the advantage-weighted log-likelihood went up
        adv = batch["advantages"] * batch["response_mask"]
        assert (after * adv).sum() > (before * adv).sum()

    def test_weights_for_rollout_cover_the_hf_model(self, engine_factory, model_dir):
        self._token_only()
        from transformers import AutoModelForCausalLM

        engine = engine_factory()
        buckets = list(engine.weights_for_rollout(1 << 16))
        sent = {n: t for bucket in buckets for n, t in bucket}
        assert sum(len(b) for b in buckets) == len(sent), "a parameter was sent twice"
        expected = {n: p.shape for n, p in AutoModelForCausalLM.from_pretrained(model_dir).named_parameters()}
        assert {n: t.shape for n, t in sent.items()} == expected
        assert len(buckets) > 1, "a 64 KiB bucket size must split a model of several MiB"
        assert len(list(engine.weights_for_rollout(1 << 40))) == 1

    def test_weights_for_rollout_reproduce_the_trained_model(self, engine_factory, model_dir):
        self._token_only()
        from transformers import AutoModelForCausalLM

        engine, batch = engine_factory(), self.make_batch()
        engine.train_batch(batch, _loss)
        model = AutoModelForCausalLM.from_pretrained(model_dir)
        sent = {n: t.detach().cpu() for bucket in engine.weights_for_rollout() for n, t in bucket}
        model.load_state_dict(sent, strict=False)
        assert torch.allclose(engine.infer_batch(batch)["log_probs"][3, :6], _hf_log_probs(model, batch, 3), atol=1e-4)

    def test_save_load_round_trip_and_continue(self, engine_factory, tmp_path):
        engine, batch = engine_factory(), self.make_batch()
        engine.train_batch(batch, _loss)
        engine.save_checkpoint(str(tmp_path / "ckpt"))
        saved = engine.infer_batch(batch)["log_probs"]
        second = engine.train_batch(batch, _loss)
        after_second = engine.infer_batch(batch)["log_probs"]
        fresh = engine_factory()
        fresh.load_checkpoint(str(tmp_path / "ckpt"))
        assert torch.allclose(fresh.infer_batch(batch)["log_probs"], saved, atol=1e-6)
        # optimizer and schedule came back too: the next step is the same step
        again = fresh.train_batch(batch, _loss)
        assert again[_grad_key(again)] == pytest.approx(second[_grad_key(second)], rel=1e-5)
        assert torch.allclose(fresh.infer_batch(batch)["log_probs"], after_second, atol=1e-6)

    def test_load_runs_no_code_planted_in_the_checkpoint(self, engine_factory, tmp_path):
        """Each pickle-based file of a saved checkpoint (``.metadata``, ``*.pt``, ``*.pkl``, ``*.bin``) replaced by a
        pickle whose loading would create a file: loading must fail and create nothing (docs/security.md;
        ``polyrl.checkpoint_io`` is the loader that does this)."""
        import pickle
        import shutil

        engine, batch = engine_factory(), self.make_batch()
        engine.train_batch(batch, _loss)
        engine.save_checkpoint(str(tmp_path / "ckpt"))
        planted = [p for p in sorted((tmp_path / "ckpt").rglob("*")) if p.is_file() and (
            p.name.endswith(".metadata") or p.suffix in (".pt", ".pkl", ".bin"))]
        marker = tmp_path / "pwned"
        for target in planted:
            copy = tmp_path / f"planted_{target.name}"
            shutil.copytree(tmp_path / "ckpt", copy)
            (copy / target.relative_to(tmp_path / "ckpt")).write_bytes(pickle.dumps(_Payload(str(marker))))
            with pytest.raises(Exception):  # noqa: B017 - any refusal will do; running the payload will not
                engine.load_checkpoint(str(copy))
            assert not marker.exists(), f"loading a checkpoint ran code planted in its {target.name}"

    def test_load_checkpoint_of_nothing_is_an_error(self, engine_factory, tmp_path):
        (tmp_path / "empty").mkdir()
        with pytest.raises(ValueError, match="empty"):
            engine_factory().load_checkpoint(str(tmp_path / "empty"))

    def test_export_hf_loads_in_transformers(self, engine_factory, tmp_path):
        self._token_only()
        from transformers import AutoModelForCausalLM

        engine, batch = engine_factory(), self.make_batch()
        engine.train_batch(batch, _loss)
        engine.export_hf(str(tmp_path / "hf"))
        model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
        assert torch.allclose(engine.infer_batch(batch)["log_probs"][3, :6], _hf_log_probs(model, batch, 3), atol=1e-4)

    def test_offload_onload_keeps_the_model(self, engine_factory):
        engine, batch = engine_factory(), self.make_batch()
        engine.train_batch(batch, _loss)
        before = engine.infer_batch(batch)["log_probs"]
        engine.offload()
        engine.onload()
        assert torch.allclose(engine.infer_batch(batch)["log_probs"], before)
        engine.train_batch(batch, _loss)  # the optimizer state came back with it

    def test_ref_role_infers_like_the_actor(self, engine_factory):
        batch = self.make_batch()
        ref = engine_factory(role="ref")
        assert ref.role == "ref"
        actor = engine_factory()
        assert torch.allclose(ref.infer_batch(batch)["log_probs"], actor.infer_batch(batch)["log_probs"], atol=1e-6)

    def test_value_model_infers_and_trains(self, engine_factory):
        if not self.supports_value_model:
            pytest.skip("this engine has no value model")
        critic, batch = engine_factory(role="critic", model_type="value"), self.make_batch()
        values = critic.infer_batch(batch)["values"]
        assert values.shape == batch["responses"].shape
        assert torch.all(values[batch["response_mask"] == 0] == 0)
        first = critic.train_batch(batch, _value_loss)["test/vf_loss"]
        for _ in range(3):
            last = critic.train_batch(batch, _value_loss)["test/vf_loss"]
        assert last < first

    @pytest.mark.parametrize("method", ["infer_batch", "train_batch"])
    def test_missing_field_names_it(self, engine_factory, method):
        batch = self.make_batch().exclude(self.required_field)
        engine = engine_factory()
        call = engine.infer_batch if method == "infer_batch" else lambda b: engine.train_batch(b, _loss)
        with pytest.raises(KeyError, match=self.required_field):
            call(batch)


class _Payload:
    """Unpickling this runs ``open(marker, "w")``: what a planted checkpoint file would do."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (open, (self.marker, "w"))

