"""Real-format diffusers pipeline folders (``StableDiffusion3Pipeline``, ``FluxPipeline``, ``QwenImagePipeline``)
against diffusers itself.

The folders are written by :func:`polyrl_diffusion.models.make_tiny_diffusers_pipeline`: every component is the
real class (three / two text encoders with their real tokenizers, or QwenImage's Qwen2.5-VL encoder with its
byte-level BPE tokenizer, a VAE, the flow-matching scheduler), random init and tiny, nothing downloaded.
polyrl's rollout must draw the *same image* as the diffusers pipeline from the same initial latents with the ODE
sampler: that checks the sigma schedule and shift (QwenImage's exponential dynamic shift and terminal stretch),
the timestep scale, FLUX's and QwenImage's packing, position ids and image shapes, classifier-free guidance
(QwenImage's norm-preserving true CFG), the text encoding (QwenImage's template, dropped prefix and masks) and the
VAE decode.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from polyrl_diffusion.config import DiffusersRolloutConfig, FlowGRPOConfig
from polyrl_diffusion.models import (
    QwenPromptLengths,
    _unpack,
    load_flow_model,
    make_tiny_diffusers_pipeline,
    pixels_per_latent,
)
from polyrl_diffusion.sampler import sigma_schedule
from polyrl_diffusion.worker import collate_images

from polyrl.config.roles import EngineRoleConfig, ModelConfig, OptimConfig, RolloutConfig
from polyrl.platforms import CPUPlatform
from polyrl.protocols import GenerationRequest, SamplingParams

PIXELS = 16  # image side; latents are 8 x 8 (the tiny VAE downsamples by 2)
PROMPTS = ["a bright red cat", "a dark sea at night"]
NEGATIVES = ["dull grey", ""]


FAMILIES = {"StableDiffusion3Pipeline": "sd3", "FluxPipeline": "flux", "QwenImagePipeline": "qwenimage"}


@pytest.fixture(scope="module", params=["sd3", "flux", "qwenimage"])
def real_dir(request, tmp_path_factory):
    return make_tiny_diffusers_pipeline(tmp_path_factory.mktemp(request.param) / "m", family=request.param, seed=0)


def _rollout(path, **sampler):
    from polyrl_diffusion.rollout import DiffusersRollout

    cfg = FlowGRPOConfig(**{"height": PIXELS, "width": PIXELS, **sampler})
    return DiffusersRollout(RolloutConfig(name="diffusers", plugin_config=DiffusersRolloutConfig(sampler=cfg)),
                            model_path=str(path))


def _requests(validate, negatives=None):
    return [GenerationRequest([], SamplingParams(n=1, seed=5), request_id=f"u{i}",
                              multi_modal={"prompt": p, "train_step": 0, "validate": validate,
                                           **({"negative_prompt": negatives[i]} if negatives else {})})
            for i, p in enumerate(PROMPTS)]


def test_folder_loads_as_what_it_is(real_dir):
    index = json.loads((real_dir / "model_index.json").read_text())
    family = FAMILIES[index["_class_name"]]
    model = load_flow_model(real_dir)
    assert (model.family, model.tiny) == (family, False)
    assert pixels_per_latent(real_dir) == model.pipeline.vae_scale_factor == 2
    assert model.latent_shape(PIXELS, 2 * PIXELS) == (4, PIXELS // 2, PIXELS)
    # the default image size is the pipeline's (SD3: the transformer's sample_size; FLUX, QwenImage: 128 latents)
    assert model.latent_shape()[1] == model.pipeline.default_sample_size
    emb = model.encode(PROMPTS)
    pooled = 0 if family == "qwenimage" else model.transformer.config.pooled_projection_dim
    assert emb.prompt_embeds.shape[0] == 2 and emb.pooled.shape == (2, pooled)
    assert not torch.allclose(emb.prompt_embeds[0], emb.prompt_embeds[1])  # the prompts reach the encoders
    if family == "qwenimage":  # each prompt its own length: the rows after the template's 34-token prefix
        count = QwenPromptLengths.from_folder(real_dir)
        assert emb.mask.sum(-1).tolist() == [count(p) for p in PROMPTS]
        assert count(PROMPTS[1]) > count(PROMPTS[0])


@pytest.mark.parametrize("scale", [1.0, 3.0])
def test_ode_rollout_draws_the_diffusers_pipelines_image(real_dir, scale):
    steps = 4
    negatives = NEGATIVES if scale > 1 else None
    rollout = _rollout(real_dir, eval_steps=steps, cfg_scale=scale)
    results = rollout.generate(_requests(validate=True, negatives=negatives))
    batch = collate_images([type("O", (), {"extra": r.extra})() for r in results])
    noise, x0, images = batch["initial_noise"], batch["x0"], batch["images"]
    pipe = rollout.model.pipeline
    sd3 = rollout.model.family == "sd3"
    c, h, w = noise.shape[1:]
    kw = {"negative_prompt": negatives} if negatives else {}
    if sd3:
        kw["guidance_scale"] = scale
    else:  # FLUX's and QwenImage's true CFG
        kw["true_cfg_scale"] = scale
    latents = noise if sd3 else noise.view(2, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(2, -1, 4 * c)

    def run(output_type):
        return pipe(PROMPTS, latents=latents.clone(), num_inference_steps=steps, height=PIXELS, width=PIXELS,
                    output_type=output_type, **kw).images

    ref_latents = run("latent")
    if not sd3:
        ref_latents = _unpack(ref_latents, c, h, w)
    assert torch.allclose(x0, ref_latents.float(), atol=1e-4, rtol=0), (x0 - ref_latents).abs().max()
    ref_images = torch.from_numpy(np.round(run("np") * 255)).permute(0, 3, 1, 2)
    assert (images.float() - ref_images).abs().max() <= 1
    assert images.float().std() > 5  # not a saturated constant image that any sampler would reproduce
    # the check can fail: SD3's schedule is the scheduler's, not polyrl's uniform one (FLUX's is uniform, shifted)
    if sd3:
        assert not torch.allclose(rollout.model.sigma_schedule(steps, (h, w)), sigma_schedule(steps, 3.0))


def _engine(path):
    from polyrl_diffusion.engine import DiffusersEngine

    cfg = EngineRoleConfig(engine="diffusers", model=ModelConfig(path=str(path)), optim=OptimConfig(lr=1e-2),
                           micro_batch_size=2)
    return DiffusersEngine(cfg, role="actor", model_type="diffusion", platform=CPUPlatform())


def test_engine_on_the_real_transformer_recomputes_the_rollout_log_probs(real_dir):
    rollout = _rollout(real_dir, train_steps=4, sde_window_size=2, sde_window_start=1, cfg_scale=2.0)
    batch = collate_images([type("O", (), {"extra": r.extra})() for r in
                            rollout.generate(_requests(validate=False, negatives=NEGATIVES))])
    assert batch["latents"].shape == (2, 2, 4, PIXELS // 2, PIXELS // 2)
    engine = _engine(real_dir)
    out = engine.infer_batch(batch)
    assert torch.allclose(out["log_probs"], batch["rollout_log_probs"], atol=1e-5)
    before = {k: v.clone() for k, v in rollout.model.transformer.named_parameters()}
    batch["advantages"] = torch.tensor([1.0, -1.0])[:, None].expand(2, 2).contiguous()
    seen = {}

    def loss(o, mb, scale):
        seen["ratio"] = torch.exp(o["log_probs"].detach() - mb["rollout_log_probs"])
        return -(o["log_probs"] * mb["advantages"]).sum() / scale.batch_num_tokens, {}

    metrics = engine.train_batch(batch, loss)
    assert torch.allclose(seen["ratio"], torch.ones(2, 2), atol=1e-5) and metrics["actor/grad_norm"] > 0
    for bucket in engine.weights_for_rollout(1 << 14):
        rollout.update_weights(bucket)
    after = dict(rollout.model.transformer.named_parameters())
    assert any(not torch.equal(before[k], after[k]) for k in before)  # the step changed the weights
    again = collate_images([type("O", (), {"extra": r.extra})() for r in
                            rollout.generate(_requests(validate=False, negatives=NEGATIVES))])
    assert torch.allclose(engine.infer_batch(again)["log_probs"], again["rollout_log_probs"], atol=1e-5)


@pytest.mark.parametrize("embedded", [1.0, 3.5])
def test_guidance_distilled_flux_matches_diffusers_at_the_configured_guidance(tmp_path, embedded):
    """A FLUX transformer with a guidance embedding (FLUX.1-dev's kind): polyrl feeds it
    ``trainer.flow_grpo.embedded_guidance``, as diffusers' pipeline feeds its ``guidance_scale``; the engine
    recomputes the rollout's log-probs with the same value (it rides in the batch)."""
    folder = make_tiny_diffusers_pipeline(tmp_path / "m", family="flux", seed=1, guidance_embeds=True)
    rollout = _rollout(folder, eval_steps=3, train_steps=3, embedded_guidance=embedded)
    batch = collate_images([type("O", (), {"extra": r.extra})() for r in rollout.generate(_requests(validate=True))])
    noise, c = batch["initial_noise"], batch["initial_noise"].shape[1]
    h, w = noise.shape[2:]
    packed = noise.view(2, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(2, -1, 4 * c)
    pipe = rollout.model.pipeline

    def ref(scale):
        out = pipe(PROMPTS, latents=packed.clone(), num_inference_steps=3, height=PIXELS, width=PIXELS,
                   guidance_scale=scale, output_type="latent").images
        return _unpack(out, c, h, w).float()

    assert torch.allclose(batch["x0"], ref(embedded), atol=1e-4, rtol=0)
    other = 3.5 if embedded == 1.0 else 1.0
    assert not torch.allclose(batch["x0"], ref(other), atol=1e-3)  # the embedding is used: another value differs
    train = collate_images([type("O", (), {"extra": r.extra})() for r in rollout.generate(_requests(validate=False))])
    assert torch.equal(train["embedded_guidance"], torch.full((2,), embedded))
    engine = _engine(folder)
    assert torch.allclose(engine.infer_batch(train)["log_probs"], train["rollout_log_probs"], atol=1e-5)
    train["embedded_guidance"] = torch.full((2,), other)  # the engine reads the field: a wrong value moves them
    assert not torch.allclose(engine.infer_batch(train)["log_probs"], train["rollout_log_probs"], atol=1e-3)
