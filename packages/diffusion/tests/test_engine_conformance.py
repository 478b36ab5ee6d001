"""The diffusers engine passes polyrl.testing's EngineConformance (the non-token form of the suite)."""

from __future__ import annotations

import pytest
import torch
from polyrl_diffusion.config import DiffusersRolloutConfig, FlowGRPOConfig
from polyrl_diffusion.models import make_tiny_pipeline
from polyrl_diffusion.worker import collate_images

from polyrl.config.roles import EngineRoleConfig, ModelConfig, OptimConfig, RolloutConfig
from polyrl.platforms import CPUPlatform
from polyrl.protocols import GenerationRequest, SamplingParams
from polyrl.testing import EngineConformance

_BATCH: dict = {}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_pipeline(tmp_path_factory.mktemp("sd3") / "m", family="sd3", seed=0)


class TestDiffusersEngineConformance(EngineConformance):
    supports_value_model = False
    token_model = False
    required_field = "latents"

    @pytest.fixture(autouse=True)
    def _rollout_batch(self, model_dir):
        if str(model_dir) not in _BATCH:
            from polyrl_diffusion.rollout import DiffusersRollout

            cfg = FlowGRPOConfig(train_steps=4, sde_window_size=2, sde_window_start=1)
            rollout = DiffusersRollout(RolloutConfig(name="diffusers", plugin_config=DiffusersRolloutConfig(sampler=cfg)),
                                       model_path=str(model_dir))
            reqs = [GenerationRequest([], SamplingParams(n=1, seed=0), request_id=f"u{i}",
                                      multi_modal={"prompt": "a red house"}) for i in range(4)]
            batch = collate_images([type("O", (), {"extra": r.extra})() for r in rollout.generate(reqs)])
            batch["advantages"] = torch.linspace(-1, 1, 4)[:, None].expand(4, 2).contiguous()
            _BATCH[str(model_dir)] = batch
        self._batch = _BATCH[str(model_dir)]

    def make_batch(self):
        return self._batch.clone()

    @pytest.fixture
    def engine_factory(self, model_dir):
        from polyrl_diffusion.engine import DiffusersEngine

        def make(role="actor", model_type="diffusion", **kw):
            cfg = EngineRoleConfig(engine="diffusers", model=ModelConfig(path=str(model_dir)),
                                   optim=OptimConfig(lr=1e-3, grad_clip=1.0, eps=1e-6),
                                   micro_batch_size=kw.pop("micro_batch_size", 2), **kw)
            return DiffusersEngine(cfg, role=role, model_type="diffusion", platform=CPUPlatform())

        return make


class _Payload:
    """Unpickling this runs ``open(marker, 'w')``: what a planted checkpoint would do."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_planted_checkpoint_metadata_is_refused_and_runs_nothing(model_dir, tmp_path):
    """The diffusers engine loads its checkpoints through polyrl.checkpoint_io (its fsdp base's loader)."""
    import pickle

    from polyrl_diffusion.engine import DiffusersEngine

    from polyrl.errors import CheckpointError

    cfg = EngineRoleConfig(engine="diffusers", model=ModelConfig(path=str(model_dir)), optim=OptimConfig(lr=1e-3))
    engine = DiffusersEngine(cfg, role="actor", model_type="diffusion", platform=CPUPlatform())
    ck = tmp_path / "ck"
    engine.save_checkpoint(str(ck))
    marker = tmp_path / "pwned"
    (ck / ".metadata").write_bytes(pickle.dumps(_Payload(str(marker))))
    with pytest.raises(CheckpointError, match=r"ck/\.metadata .*not allowed"):
        engine.load_checkpoint(str(ck))
    assert not marker.exists(), "loading the checkpoint ran code stored in it"
