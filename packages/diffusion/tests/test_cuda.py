"""CUDA variants (run when a GPU is at hand: `pytest -m gpu packages/diffusion/tests`)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_rollout_and_engine_on_cuda_agree(tmp_path):
    from polyrl_diffusion.config import DiffusersRolloutConfig, FlowGRPOConfig
    from polyrl_diffusion.engine import DiffusersEngine
    from polyrl_diffusion.models import make_tiny_pipeline
    from polyrl_diffusion.rollout import DiffusersRollout
    from polyrl_diffusion.worker import collate_images

    from polyrl.config.roles import EngineRoleConfig, ModelConfig, OptimConfig, RolloutConfig
    from polyrl.platforms import CUDAPlatform
    from polyrl.protocols import GenerationRequest, SamplingParams

    model = make_tiny_pipeline(tmp_path / "m", family="sd3", seed=0)
    platform = CUDAPlatform()
    platform.set_device(0)
    cfg = FlowGRPOConfig(train_steps=6, sde_window_size=3, cfg_scale=2.0)
    rollout = DiffusersRollout(RolloutConfig(name="diffusers", plugin_config=DiffusersRolloutConfig(sampler=cfg)),
                               model_path=str(model), platform=platform)
    reqs = [GenerationRequest([], SamplingParams(n=1, seed=0), request_id=f"u{i}", multi_modal={"prompt": "a red house"})
            for i in range(8)]
    batch = collate_images([type("O", (), {"extra": r.extra})() for r in rollout.generate(reqs)])
    engine = DiffusersEngine(EngineRoleConfig(engine="diffusers", model=ModelConfig(path=str(model)),
                                              optim=OptimConfig(lr=1e-3)), role="actor", model_type="diffusion",
                             platform=platform)
    assert torch.allclose(engine.infer_batch(batch)["log_probs"], batch["rollout_log_probs"], atol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_rollout_sleep_releases_the_cuda_memory_and_wake_up_restores_the_images(tmp_path):
    """A real-format SD3 folder (transformer, three text encoders, VAE) on the GPU: sleep must hand back at least
    the bytes of every module's parameters; wake-up must give the same images bit for bit."""
    from types import SimpleNamespace

    from polyrl_diffusion.config import DiffusersRolloutConfig, FlowGRPOConfig
    from polyrl_diffusion.models import make_tiny_diffusers_pipeline
    from polyrl_diffusion.rollout import DiffusersRollout
    from polyrl_diffusion.worker import collate_images

    from polyrl.config.roles import RolloutConfig
    from polyrl.platforms import CUDAPlatform
    from polyrl.protocols import GenerationRequest, SamplingParams

    platform = CUDAPlatform()
    platform.set_device(0)
    rollout = DiffusersRollout(
        RolloutConfig(name="diffusers", plugin_config=DiffusersRolloutConfig(sampler=FlowGRPOConfig(train_steps=4))),
        model_path=str(make_tiny_diffusers_pipeline(tmp_path / "m", family="sd3", seed=0)), platform=platform)
    reqs = [GenerationRequest([], SamplingParams(n=1, seed=0), request_id=f"u{i}", multi_modal={"prompt": "a red house"})
            for i in range(4)]

    def images():
        return collate_images([SimpleNamespace(extra=r.extra) for r in rollout.generate(reqs)])["images"]

    first = images()
    modules = [m for m in rollout.model.pipeline.components.values() if isinstance(m, torch.nn.Module)]
    weights = sum(p.numel() * p.element_size() for m in modules for p in m.parameters())
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    rollout.sleep(1)
    torch.cuda.synchronize()
    after = torch.cuda.memory_allocated()
    assert before - after >= weights, (before, after, weights)
    assert all(p.device.type == "cpu" for m in modules for p in m.parameters())
    rollout.wake_up()
    assert all(p.device.type == "cuda" for m in modules for p in m.parameters())
    assert torch.equal(images(), first)
