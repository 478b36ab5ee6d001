"""A ``flow_grpo`` run with ``trainer.flow_grpo.ema``: validation samples with the EMA's weights and training with
the trained ones, the checkpoint keeps the EMA and ``polyrl export`` writes it (as Flow-GRPO evaluates and saves
its EMA). ``executor=local`` runs every role in this process, so the test watches the real rollout and engine."""

from __future__ import annotations

import json

import torch
from polyrl_diffusion.engine import DiffusersEngine
from polyrl_diffusion.models import make_tiny_pipeline
from polyrl_diffusion.quickstart import flow_grpo_overrides
from polyrl_diffusion.rollout import DiffusersRollout
from safetensors.torch import load_file

from polyrl.trainer.commands import export, train


def test_validation_uses_the_ema_and_export_writes_it(tmp_path, monkeypatch):
    model = make_tiny_pipeline(tmp_path / "model", family="sd3", seed=0)
    rows = [{"prompt": p, "data_source": "brightness"} for p in ["a red cat", "a blue sea"]]
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows * 2))
    (tmp_path / "polyrl.toml").write_text('[plugins]\nrequire = ["polyrl-engine-fsdp", "polyrl-diffusion"]\n')
    seen: list[tuple[bool, dict[str, torch.Tensor]]] = []  # (validation?, the rollout's weights) per generation
    after_step: list[tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]] = []  # (trained, EMA) per step
    generate, train_batch = DiffusersRollout._generate_rows, DiffusersEngine.train_batch

    def spy_generate(self, rows, idents, validate, train_step, seed):
        seen.append((validate, {n: p.detach().clone() for n, p in self.model.transformer.named_parameters()}))
        return generate(self, rows, idents, validate, train_step, seed)

    def spy_train(self, batch, loss_fn, **kw):
        out = train_batch(self, batch, loss_fn, **kw)
        strip = len("model.")
        after_step.append(({n[strip:]: p.detach().clone() for n, p in self.trainable_parameters()},
                           {n[strip:]: t.clone() for n, t in self.weight_copies["ema"].tensors.items()}))
        return out

    monkeypatch.setattr(DiffusersRollout, "_generate_rows", spy_generate)
    monkeypatch.setattr(DiffusersEngine, "train_batch", spy_train)
    run = tmp_path / "run"
    train(tmp_path / "polyrl.toml", [], [
        *flow_grpo_overrides(model, tmp_path / "train.jsonl", run, batch=2, n=2, lr=2e-2, steps=2, micro_batch=8,
                             sampler_steps=4),
        f"data.val_files=[{tmp_path / 'train.jsonl'}]", "trainer.test_freq=1", "trainer.val_before_train=false",
        "trainer.save_freq=2", "trainer.resume=disable", "trainer.flow_grpo.ema.enable=true",
        "trainer.flow_grpo.ema.update_interval=1",
    ])
    assert [v for v, _ in seen] == [False, True, False, True]  # step 1, its validation, step 2, its validation
    for i, (trained, ema) in enumerate(after_step):
        val_weights, next_train = seen[2 * i + 1][1], seen[2 * i + 2][1] if 2 * i + 2 < len(seen) else None
        assert all(torch.equal(val_weights[n], ema[n]) for n in ema), f"validation {i + 1} did not use the EMA"
        assert any(not torch.equal(ema[n], trained[n]) for n in ema), "the EMA equals the trained weights"
        if next_train is not None:
            assert all(torch.equal(next_train[n], trained[n]) for n in trained), "training sampled with the EMA"
    out = export(run / "checkpoints" / "step_2", tmp_path / "out", manifest=tmp_path / "polyrl.toml")
    exported = load_file(str(next((out / "transformer").glob("*.safetensors"))))
    ema = after_step[-1][1]
    assert all(torch.equal(exported[n], ema[n]) for n in ema)
