"""``polyrl export`` on a diffusion run's checkpoint writes a pipeline folder with the trained transformer.

A two-step ``flow_grpo`` run (``executor=local``, one process) saves a checkpoint; the core's ``export``
builds the actor with the run's trainer's worker (the diffusion worker: no text tokenizer, model type
``diffusion``) and the ``diffusers`` engine writes the folder. The exported weights are compared with the
checkpoint itself, read back independently of the engine (``dcp_to_torch_save``).
"""

from __future__ import annotations

import json

import torch
from polyrl_diffusion.models import load_flow_model, make_tiny_diffusers_pipeline, make_tiny_pipeline
from polyrl_diffusion.quickstart import flow_grpo_overrides
from safetensors.torch import load_file

from polyrl.trainer.commands import export, train


def _train(root, model, extra=()):
    rows = [{"prompt": p, "data_source": "brightness"} for p in ["a red cat", "a blue sea"]]
    (root / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows * 2))
    (root / "polyrl.toml").write_text('[plugins]\nrequire = ["polyrl-engine-fsdp", "polyrl-diffusion"]\n')
    run = root / "run"
    train(root / "polyrl.toml", [], [
        *flow_grpo_overrides(model, root / "train.jsonl", run, batch=2, n=2, lr=1e-2, steps=2, micro_batch=8,
                             sampler_steps=4),
        "trainer.save_freq=2", "trainer.flow_grpo.sde_window_size=2", "trainer.resume=disable", *extra,
    ])
    return run / "checkpoints" / "step_2"


def _checkpoint_weights(ckpt, tmp_path):
    """The actor's saved parameters, read from the DCP checkpoint without the engine."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(ckpt / "actor"), str(tmp_path / "ckpt.pt"))
    model = torch.load(tmp_path / "ckpt.pt", weights_only=True)["model"]
    return {k.removeprefix("model."): v for k, v in model.items()}


def _transformer(folder):
    return load_file(str(next((folder / "transformer").glob("*.safetensors"))))


def test_export_of_a_real_sd3_run_is_a_diffusers_pipeline_with_the_trained_weights(tmp_path):
    model = make_tiny_diffusers_pipeline(tmp_path / "model", family="sd3", seed=0)
    ckpt = _train(tmp_path, model)
    out = export(ckpt, tmp_path / "out")
    exported, initial = _transformer(out), _transformer(model)
    saved = _checkpoint_weights(ckpt, tmp_path)
    assert set(exported) == set(saved) == set(initial)
    for name, tensor in exported.items():
        assert torch.equal(tensor, saved[name]), name
    assert any(not torch.equal(exported[k], initial[k]) for k in initial)  # the run trained
    assert json.loads((out / "polyrl_export.json").read_text())["step"] == 2
    # polyrl and diffusers both load it; the text encoders and VAE are the source's
    flow = load_flow_model(out)
    assert (flow.family, flow.tiny) == ("sd3", False)
    from diffusers import DiffusionPipeline, StableDiffusion3Pipeline

    pipe = DiffusionPipeline.from_pretrained(str(out))
    assert isinstance(pipe, StableDiffusion3Pipeline)
    assert torch.equal(dict(pipe.transformer.named_parameters())["proj_out.weight"], saved["proj_out.weight"])
    assert pipe("a red cat", num_inference_steps=2, output_type="np").images.shape == (1, 16, 16, 3)


def test_lora_run_exports_merged_weights(tmp_path):
    model = make_tiny_pipeline(tmp_path / "model", family="flux", seed=0)
    ckpt = _train(tmp_path, model, ["actor.model.lora.rank=4", "actor.model.lora.alpha=8", "actor.optim.lr=5e-2"])
    out = export(ckpt, tmp_path / "out")
    exported, initial = _transformer(out), _transformer(model)
    saved = _checkpoint_weights(ckpt, tmp_path)
    assert set(exported) == set(initial) and not any("lora" in k for k in exported)
    changed = set()
    for name, base in initial.items():  # W + (alpha / r) B A where peft put an adapter, W elsewhere
        layer = name.removesuffix(".weight")
        a = saved.get(f"base_model.model.{layer}.lora_A.default.weight")
        if a is None:
            assert torch.equal(exported[name], base), name
            continue
        b = saved[f"base_model.model.{layer}.lora_B.default.weight"]
        assert torch.equal(saved[f"base_model.model.{layer}.base_layer.weight"], base)  # frozen
        assert torch.allclose(exported[name], base + 2.0 * b @ a, atol=1e-6), name
        if not torch.equal(exported[name], base):
            changed.add(name)
    assert changed  # the adapters trained and were merged
    assert load_flow_model(out).family == "flux"
    # lora_export=adapter: the source's transformer plus a peft adapter folder that merges to the same weights
    adapter_out = export(ckpt, tmp_path / "adapter", overrides=["actor.diffusers.lora_export=adapter"])
    assert _transformer(adapter_out).keys() == initial.keys()
    assert all(torch.equal(v, initial[k]) for k, v in _transformer(adapter_out).items())
    from peft import PeftModel
    from polyrl_diffusion.models import load_transformer

    merged = PeftModel.from_pretrained(load_transformer(adapter_out), str(adapter_out / "transformer_lora"))
    merged = dict(merged.merge_and_unload().named_parameters())
    for name in changed:
        assert torch.allclose(merged[name], exported[name], atol=1e-6), name

