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
