"""DiffusionNFT's actor update with several epochs and mini-batches (``actor.ppo_epochs > 1``): the sampling
policy's velocity ``v_old`` is computed once, before the first optimiser step, and every later epoch trains
against that same ``v_old``; the forward-process draws follow ``trainer.seed`` and the training step."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from polyrl_diffusion.config import DiffusersRolloutConfig, FlowGRPOConfig
from polyrl_diffusion.models import make_tiny_pipeline
from polyrl_diffusion.nft import DiffusionNFTConfig, update_actor_nft
from polyrl_diffusion.worker import collate_images

from polyrl.config.roles import EngineRoleConfig, ModelConfig, OptimConfig, RolloutConfig
from polyrl.platforms import CPUPlatform
from polyrl.protocols import GenerationRequest, SamplingParams


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_pipeline(tmp_path_factory.mktemp("nft") / "m", family="sd3", seed=0)


def _engine(path):
    from polyrl_diffusion.engine import DiffusersEngine

    cfg = EngineRoleConfig(engine="diffusers", model=ModelConfig(path=str(path)), optim=OptimConfig(lr=3e-2),
                           micro_batch_size=2)
    return DiffusersEngine(cfg, role="actor", model_type="diffusion", platform=CPUPlatform())


def _batch(path, train_step: int = 3):
    from polyrl_diffusion.rollout import DiffusersRollout

    sampler = FlowGRPOConfig(train_steps=4, noise_level=0.0, sde_window_size=1)
    rollout = DiffusersRollout(RolloutConfig(name="diffusers", plugin_config=DiffusersRolloutConfig(sampler=sampler)),
                               model_path=str(path))
    reqs = [GenerationRequest([], SamplingParams(n=1, seed=1), request_id=f"g{i // 4}",
                              multi_modal={"prompt": ["a red house", "a dark sky"][i // 4], "train_step": train_step})
            for i in range(8)]
    batch = collate_images([SimpleNamespace(extra=r.extra) for r in rollout.generate(reqs)])
    batch["advantages"] = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0, 0.0, 0.3])[:, None].contiguous()
    return batch


def _worker(engine, seed: int = 5, epochs: int = 3):
    nft = DiffusionNFTConfig(beta=1.0, kl_coef=0.0)  # the reference's times: 3 of the 4 sampler steps per image
    config = SimpleNamespace(
        actor=SimpleNamespace(ppo_mini_batch_size=1, ppo_epochs=epochs, shuffle=True),  # 4 rows: 2 mini-batches
        rollout=SimpleNamespace(n=4),
        trainer=SimpleNamespace(seed=seed, plugin_config=FlowGRPOConfig(algorithm="diffusion_nft", nft=nft)))
    return SimpleNamespace(actor=engine, ref=None, config=config)


def _spy(engine):
    """Record every mini-batch the update trains on and count the no-grad forward passes."""
    seen, calls = [], {"infer": 0}
    train, infer = engine.train_batch, engine.infer_batch

    def train_batch(mb, loss_fn, **kw):
        seen.append(mb.clone())
        return train(mb, loss_fn, **kw)

    def infer_batch(mb, **kw):
        calls["infer"] += 1
        return infer(mb, **kw)

    engine.train_batch, engine.infer_batch = train_batch, infer_batch
    return seen, calls


def test_v_old_is_computed_once_and_reused_by_every_epoch(model_dir):
    batch = _batch(model_dir)
    actor, frozen = _engine(model_dir), _engine(model_dir)  # frozen: the sampling policy, never updated
    seen, calls = _spy(actor)
    update_actor_nft(_worker(actor), batch)
    assert len(seen) == 6, "3 epochs x 2 mini-batches of 4 rows"
    assert calls["infer"] == 1, "v_old must be computed once per update, not per epoch or mini-batch"
    for i, mb in enumerate(seen):
        v_sampling = frozen.infer_batch(mb)["velocity"]
        # epochs 2 and 3 train against the velocity of the policy that sampled, not of the updated actor
        assert torch.allclose(mb["nft_old_velocity"], v_sampling, atol=1e-6), f"mini-batch {i}: v_old moved"
    last = seen[-1]
    moved = (actor.infer_batch(last)["velocity"] - last["nft_old_velocity"]).abs().max()
    assert float(moved) > 1e-3, "the actor did not train: the test could not tell v_old from the current velocity"


def test_forward_process_draws_follow_trainer_seed_and_step(model_dir):
    def draws(seed: int, step: int) -> torch.Tensor:
        engine = _engine(model_dir)
        seen, _ = _spy(engine)
        update_actor_nft(_worker(engine, seed=seed, epochs=1), _batch(model_dir, train_step=step))
        return torch.cat([mb["sigmas"] for mb in seen])

    first = draws(5, 3)
    assert torch.equal(first, draws(5, 3))
    assert not torch.equal(first, draws(6, 3)), "trainer.seed does not reach the forward-process draws"
    assert not torch.equal(first, draws(5, 4)), "two training steps drew the same forward-process times"
