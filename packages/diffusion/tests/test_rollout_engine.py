"""Rollout `diffusers` and engine `diffusers` on tiny pipelines built in code (SD3 and FLUX families)."""

from __future__ import annotations

import json

import pytest
import torch
from polyrl_diffusion.config import DanceGRPOConfig, DiffusersRolloutConfig, FlowGRPOConfig, MixGRPOConfig
from polyrl_diffusion.models import make_tiny_pipeline, pipeline_family
from polyrl_diffusion.worker import collate_images

from polyrl.config.roles import EngineRoleConfig, LoRAConfig, ModelConfig, OptimConfig, RolloutConfig
from polyrl.errors import ConfigError
from polyrl.platforms import CPUPlatform
from polyrl.protocols import GenerationRequest, Rollout, SamplingParams


@pytest.fixture(scope="module", params=["sd3", "flux"])
def model_dir(request, tmp_path_factory):
    return make_tiny_pipeline(tmp_path_factory.mktemp(request.param) / "m", family=request.param, seed=0)


def _rollout(path, **sampler):
    from polyrl_diffusion.rollout import DiffusersRollout

    cfg = FlowGRPOConfig(**{"train_steps": 6, "eval_steps": 8, "sde_window_size": 3, "sde_window_start": 1,
                            "sde_window_random": False, **sampler})
    return DiffusersRollout(RolloutConfig(name="diffusers", plugin_config=DiffusersRolloutConfig(sampler=cfg)),
                            model_path=str(path))


def _requests(groups=2, n=2, prompt="a bright red photo"):
    return [GenerationRequest([], SamplingParams(n=1, seed=3), request_id=f"u{i // n}",
                              multi_modal={"prompt": prompt, "train_step": 0}) for i in range(groups * n)]


def _engine(path, role="actor", **kw):
    from polyrl_diffusion.engine import DiffusersEngine

    cfg = EngineRoleConfig(engine="diffusers", model=ModelConfig(path=str(path), **kw.pop("model", {})),
                           optim=OptimConfig(lr=1e-3), micro_batch_size=kw.pop("micro_batch_size", 2), **kw)
    return DiffusersEngine(cfg, role=role, model_type="diffusion", platform=CPUPlatform())


def test_rollout_batch_fields_and_engine_recomputes_the_log_probs(model_dir):
    rollout = _rollout(model_dir, cfg_scale=2.0, timestep_fraction=0.34)  # int(0.34 * 6) = 2: window steps 1, 2
    assert isinstance(rollout, Rollout)
    batch = collate_images([type("O", (), {"extra": r.extra})() for r in rollout.generate(_requests())])
    assert batch["latents"].shape == (4, 2, 3, 8, 8) and batch["rollout_log_probs"].shape == (4, 2)
    assert batch["images"].dtype == torch.uint8 and batch["images"].shape == (4, 3, 8, 8)
    assert batch["step_index"].tolist() == [[1, 2]] * 4  # Flow-GRPO trains the first steps, in order
    assert "negative_prompt_embeds" in batch.keys() and torch.all(batch["guidance_scale"] == 2.0)
    engine = _engine(model_dir)
    out = engine.infer_batch(batch)
    # the same weights and the same step code: the recomputed log-probs are the rollout's
    assert torch.allclose(out["log_probs"], batch["rollout_log_probs"], atol=1e-5)
    # on-policy the Flow-GRPO ratio is exactly 1, so the clipped loss is plain -A
    from polyrl_diffusion.algorithms import compute_policy_loss_flow_grpo

    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])[:, None].expand(4, 2)
    seen = {}

    def loss(o, mb, scale):
        value, metrics = compute_policy_loss_flow_grpo(mb["rollout_log_probs"], o["log_probs"], mb["advantages"],
                                                       mb["response_mask"], "token-mean", None)
        seen["ratio"] = torch.exp(o["log_probs"].detach() - mb["rollout_log_probs"])
        return value, {}

    batch["advantages"] = adv.contiguous()
    metrics = engine.train_batch(batch, loss)
    assert torch.equal(seen["ratio"], torch.ones_like(seen["ratio"])) or torch.allclose(seen["ratio"], torch.ones(2, 2))
    assert metrics["actor/grad_norm"] > 0
    # weights go back to the rollout: a new draw's log-probs again match the engine
    for bucket in engine.weights_for_rollout(1 << 14):
        rollout.update_weights(bucket)
    again = collate_images([type("O", (), {"extra": r.extra})() for r in rollout.generate(_requests())])
    assert torch.allclose(engine.infer_batch(again)["log_probs"], again["rollout_log_probs"], atol=1e-5)


def test_dance_grpo_shares_the_initial_noise_within_a_group(model_dir):
    rollout = _rollout(model_dir, sde_window_size=0, dance_grpo=DanceGRPOConfig(enable=True, noise_level=0.3,
                                                                                timestep_fraction=0.5))
    batch = collate_images([type("O", (), {"extra": r.extra})() for r in rollout.generate(_requests(groups=2, n=3))])
    noise = batch["initial_noise"]
    assert torch.equal(noise[0], noise[1]) and torch.equal(noise[1], noise[2]) and torch.equal(noise[3], noise[5])
    assert not torch.equal(noise[0], noise[3])
    assert batch["latents"].shape[1] == 2  # int(0.5 * 5): the last of the 6 steps is never trained
    assert torch.all(batch["noise_levels"] == 0.3)
    assert not torch.equal(batch["x0"][0], batch["x0"][1])  # same start, different SDE paths


def test_lora_reference_is_the_adapter_disabled_model(model_dir):
    rollout = _rollout(model_dir)
    batch = collate_images([type("O", (), {"extra": r.extra})() for r in rollout.generate(_requests())])
    engine = _engine(model_dir, model={"lora": LoRAConfig(rank=4, alpha=8)})
    batch["advantages"] = torch.tensor([1.0, -1.0, 1.0, -1.0])[:, None].expand(4, 3).contiguous()

    def loss(o, mb, scale):
        return -(o["log_probs"] * mb["advantages"]).sum() / scale.batch_num_tokens, {}

    for _ in range(3):
        engine.train_batch(batch, loss)
    ref = engine.infer_batch(batch, disable_adapter=True)["log_probs"]
    assert torch.allclose(ref, batch["rollout_log_probs"], atol=1e-5)  # the base weights
    assert not torch.allclose(engine.infer_batch(batch)["log_probs"], ref, atol=1e-4)  # the adapter trained


def test_unsupported_pipeline_and_long_prompt_are_clear_errors(model_dir, tmp_path):
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusionXLPipeline"}))
    with pytest.raises(ConfigError, match="actor.model.path=.*StableDiffusionXLPipeline.*supported"):
        pipeline_family(tmp_path)
    rollout = _rollout(model_dir)
    with pytest.raises(ValueError, match="tokens long; the text encoder .* takes 12"):
        rollout.generate(_requests(prompt="a " * 20))
    with pytest.raises(KeyError, match="nope"):
        rollout.update_weights([("nope", torch.zeros(1))])


@pytest.mark.parametrize("sampler", [
    {"dance_grpo": DanceGRPOConfig(enable=True, noise_level=0.3, timestep_fraction=0.5), "sde_window_size": 0},
    {"sde_type": "cps", "noise_level": 0.8},
], ids=["dance", "cps"])
def test_engine_recomputes_the_log_probs_of_dance_and_cps_steps(model_dir, sampler):
    """The batch's ``sde_type`` tells the engine which step the rollout drew: on-policy the ratio is 1."""
    rollout = _rollout(model_dir, **sampler)
    batch = collate_images([type("O", (), {"extra": r.extra})() for r in rollout.generate(_requests())])
    out = _engine(model_dir).infer_batch(batch)
    assert torch.allclose(out["log_probs"], batch["rollout_log_probs"], atol=1e-5)
    wrong = batch.clone()
    wrong["sde_type"] = torch.zeros_like(batch["sde_type"])  # read as Flow-GRPO's SDE: other log-probs
    assert not torch.allclose(_engine(model_dir).infer_batch(wrong)["log_probs"], batch["rollout_log_probs"], atol=1e-3)


@pytest.mark.parametrize("sampler, shared", [
    ({}, False),
    ({"same_initial_noise": True}, True),
    ({"sde_window_size": 0, "mix_grpo": MixGRPOConfig(enable=True, window_size=2)}, True),
    ({"sde_window_size": 0, "mix_grpo": MixGRPOConfig(enable=True, window_size=2), "same_initial_noise": False}, False),
], ids=["flow_grpo", "same_initial_noise", "mix_grpo", "mix_grpo_off"])
def test_shared_initial_noise_per_prompt_group(model_dir, sampler, shared):
    noise = collate_images([type("O", (), {"extra": r.extra})()
                            for r in _rollout(model_dir, **sampler).generate(_requests(groups=2, n=3))])["initial_noise"]
    assert torch.equal(noise[0], noise[1]) is shared and torch.equal(noise[3], noise[5]) is shared
    assert not torch.equal(noise[0], noise[3])  # never across groups
