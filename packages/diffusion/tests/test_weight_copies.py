"""The diffusers engine's copies of its trained weights: DiffusionNFT's old policy (it gives ``v_old``, the rollout
samples with it, and it follows the trained weights by the reference's soft update), what the rollout is served,
and checkpoints that keep the copies."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from polyrl_diffusion.config import DiffusersRolloutConfig, FlowGRPOConfig
from polyrl_diffusion.models import make_tiny_pipeline
from polyrl_diffusion.nft import OLD_POLICY, DiffusionNFTConfig, update_actor_nft
from polyrl_diffusion.worker import collate_images

from polyrl.config.roles import EngineRoleConfig, ModelConfig, OptimConfig, RolloutConfig
from polyrl.platforms import CPUPlatform
from polyrl.protocols import GenerationRequest, SamplingParams


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_pipeline(tmp_path_factory.mktemp("copies") / "m", family="sd3", seed=0)


def _engine(path, lr=3e-2):
    from polyrl_diffusion.engine import DiffusersEngine

    cfg = EngineRoleConfig(engine="diffusers", model=ModelConfig(path=str(path)), optim=OptimConfig(lr=lr),
                           micro_batch_size=4)
    return DiffusersEngine(cfg, role="actor", model_type="diffusion", platform=CPUPlatform())


def _batch(path):
    from polyrl_diffusion.rollout import DiffusersRollout

    sampler = FlowGRPOConfig(train_steps=4, algorithm="diffusion_nft")
    rollout = DiffusersRollout(RolloutConfig(name="diffusers", plugin_config=DiffusersRolloutConfig(sampler=sampler)),
                               model_path=str(path))
    reqs = [GenerationRequest([], SamplingParams(n=1, seed=1), request_id=f"g{i // 2}",
                              multi_modal={"prompt": ["a red house", "a dark sky"][i // 2], "train_step": 2})
            for i in range(4)]
    batch = collate_images([SimpleNamespace(extra=r.extra) for r in rollout.generate(reqs)])
    batch["advantages"] = torch.tensor([1.0, -1.0, 0.5, -0.5])[:, None].contiguous()
    return batch


def _worker(engine, nft):
    config = SimpleNamespace(
        actor=SimpleNamespace(ppo_mini_batch_size=2, ppo_epochs=2, shuffle=False),
        rollout=SimpleNamespace(n=2),
        trainer=SimpleNamespace(seed=0, plugin_config=FlowGRPOConfig(algorithm="diffusion_nft", nft=nft)))
    return SimpleNamespace(actor=engine, ref=None, config=config)


def _params(engine):
    return {n: p.detach().clone() for n, p in engine.trainable_parameters()}


def test_nft_old_policy_gives_v_old_and_follows_the_weights_by_the_soft_update(model_dir):
    batch = _batch(model_dir)
    nft = DiffusionNFTConfig(kl_coef=0.0, old_decay_rate=0.3, old_decay_max=0.8)
    actor, sampler = _engine(model_dir), _engine(model_dir)  # sampler: the old policy's weights, kept apart
    actor.add_weight_copy(OLD_POLICY)
    w0 = _params(actor)
    update_actor_nft(_worker(actor, DiffusionNFTConfig(kl_coef=0.0, old_decay_rate=0.0)), batch)  # rate 0: old = w1
    w1 = _params(actor)
    assert all(torch.equal(actor.weight_copies[OLD_POLICY].tensors[n], w1[n]) for n in w1), "rate 0: on-policy"
    assert any(not torch.equal(w0[n], w1[n]) for n in w0)
    with torch.no_grad():  # now make the trained weights differ from the old policy: one more step, old kept
        for name, p in sampler.trainable_parameters():
            p.copy_(w1[name])
    seen = []
    train = actor.train_batch

    def spy(mb, loss_fn, **kw):
        seen.append(mb.clone())
        return train(mb, loss_fn, **kw)

    actor.train_batch = spy
    with torch.no_grad():
        for _, p in actor.trainable_parameters():
            p.add_(0.05)  # the trained weights move away from the old policy (w1)
    w2 = _params(actor)
    metrics = update_actor_nft(_worker(actor, nft), batch)
    # v_old is the old policy's velocity (the sampler's weights), not the trained weights'
    for mb in seen:
        assert torch.allclose(mb["nft_old_velocity"], sampler.infer_batch(mb)["velocity"], atol=1e-6)
    decay = min(actor.step * 0.3, 0.8)
    assert metrics["nft/old_policy_decay"] == pytest.approx(decay) and decay == 0.8  # 4 optimizer steps so far
    w3 = _params(actor)
    old = actor.weight_copies[OLD_POLICY].tensors
    for name in w3:  # old = d old + (1 - d) w, the reference's soft update
        assert torch.allclose(old[name], decay * w1[name] + (1 - decay) * w3[name], atol=1e-6), name
    assert any(not torch.equal(w2[n], w3[n]) for n in w2)


def test_rollout_is_served_the_named_copy_and_the_weights_come_back(model_dir):
    engine = _engine(model_dir)
    engine.add_weight_copy("ema")
    with torch.no_grad():
        for _, p in engine.trainable_parameters():
            p.mul_(0.5)
    live = _params(engine)
    engine.rollout_weights = "ema"
    served = {n: t for bucket in engine.weights_for_rollout(1 << 12) for n, t in bucket}
    copy = engine.weight_copies["ema"].tensors
    for name, tensor in copy.items():
        assert torch.equal(served[name.removeprefix("model.")], tensor), name
    assert all(torch.equal(p.detach(), live[n]) for n, p in engine.trainable_parameters()), "weights not restored"
    assert any(not torch.equal(copy[n], live[n]) for n in live)
    engine.rollout_weights = None
    served = {n: t for bucket in engine.weights_for_rollout(1 << 12) for n, t in bucket}
    assert all(torch.equal(served[n.removeprefix("model.")], live[n]) for n in live)


def test_checkpoints_keep_the_weight_copies(model_dir, tmp_path):
    engine = _engine(model_dir)
    engine.add_weight_copy("ema", ema=(0.9, 1))
    engine.add_weight_copy(OLD_POLICY)
    batch = _batch(model_dir)
    data = batch.select("latents", "sigmas", "prompt_embeds", "pooled_prompt_embeds", "response_mask")
    for _ in range(2):
        engine.train_batch(data, lambda out, mb, scale: ((out["velocity"] ** 2).mean(), {}))
    engine.update_weight_copy(OLD_POLICY, 0.5)
    saved = {k: {n: t.clone() for n, t in c.tensors.items()} for k, c in engine.weight_copies.items()}
    engine.save_checkpoint(str(tmp_path / "ckpt"))
    assert (tmp_path / "ckpt" / "weight_copies_rank0.pt").is_file()
    other = _engine(model_dir)
    other.add_weight_copy("ema", ema=(0.9, 1))
    other.add_weight_copy(OLD_POLICY)
    other.load_checkpoint(str(tmp_path / "ckpt"))
    for key, tensors in saved.items():
        for name, tensor in tensors.items():
            assert torch.equal(other.weight_copies[key].tensors[name], tensor), (key, name)
    assert any(not torch.equal(saved["ema"][n], saved[OLD_POLICY][n]) for n in saved["ema"])
