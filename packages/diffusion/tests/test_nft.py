"""DiffusionNFT's data path: the forward-process batch from clean samples, and the engine loss's split invariance."""

from __future__ import annotations

import pytest
import torch
from polyrl_diffusion.algorithms import compute_diffusion_nft_loss
from polyrl_diffusion.nft import DiffusionNFTConfig, check_nft_config, make_nft_loss, nft_batch
from tensordict import TensorDict

from polyrl.errors import ConfigError
from polyrl.protocols import LossScale


def rollout_batch(b: int = 4) -> TensorDict:
    g = torch.Generator().manual_seed(0)
    return TensorDict({
        "x0": torch.randn(b, 2, 4, 4, generator=g),
        "advantages": torch.tensor([[2.0], [-2.0], [0.5], [0.0]]),
        "response_mask": torch.ones(b, 1, dtype=torch.long),
        "prompt_embeds": torch.randn(b, 3, 8, generator=g),
        "negative_prompt_embeds": torch.randn(b, 3, 8, generator=g),
    }, batch_size=[b])


def test_forward_process_batch():
    cfg = DiffusionNFTConfig(times="uniform", num_timesteps=3, adv_clip_max=1.0)
    batch = rollout_batch()
    data = nft_batch(batch, cfg, generator=torch.Generator().manual_seed(1))
    x0 = batch["x0"].unsqueeze(1)
    t = data["sigmas"].reshape(4, 3, 1, 1, 1)
    eps = data["nft_target"] + x0
    assert data["latents"].shape == (4, 3, 2, 4, 4)
    assert torch.allclose(data["latents"], (1 - t) * x0 + t * eps, atol=1e-6)
    assert bool(((data["sigmas"] >= cfg.t_min) & (data["sigmas"] <= cfg.t_max)).all())
    assert data["nft_reward_prob"].tolist() == [1.0, 0.0, 0.75, 0.5]
    assert "negative_prompt_embeds" not in data.keys(), "NFT trains CFG-free: no negative branch"
    assert torch.equal(data["prompt_embeds"], batch["prompt_embeds"])
    with pytest.raises(KeyError, match="x0"):
        nft_batch(TensorDict({"advantages": torch.zeros(2, 1)}, batch_size=[2]), cfg)


def test_engine_loss_adds_up_over_micro_batches():
    cfg = DiffusionNFTConfig(times="uniform", num_timesteps=2, beta=0.5)
    data = nft_batch(rollout_batch(), cfg, generator=torch.Generator().manual_seed(2))
    data["nft_old_velocity"] = torch.randn_like(data["latents"])
    v = torch.randn_like(data["latents"])
    loss_fn = make_nft_loss(cfg)
    scale = LossScale(batch_num_tokens=8)
    whole, _ = loss_fn({"velocity": v}, data, scale)
    parts = sum(loss_fn({"velocity": v[i:i + 1]}, data[i:i + 1], scale)[0] for i in range(4))
    assert float(parts) == pytest.approx(float(whole), rel=1e-6)
    flat = (8, 2, 4, 4)
    direct, _ = compute_diffusion_nft_loss(v.reshape(flat), data["nft_old_velocity"].reshape(flat),
                                           data["nft_target"].reshape(flat),
                                           data["nft_reward_prob"].repeat_interleave(2), beta=0.5, adaptive_weight=True,
                                           t=data["sigmas"].reshape(-1), policy_scale=cfg.adv_clip_max)
    assert float(whole) == pytest.approx(float(direct), rel=1e-6)


@pytest.mark.parametrize("field, value", [("beta", 0.0), ("num_timesteps", 0), ("t_max", 1.0), ("adv_clip_max", 0.0)])
def test_bad_nft_config_names_the_key(field, value):
    with pytest.raises(ConfigError, match=f"trainer.flow_grpo.nft.{field}"):
        check_nft_config(DiffusionNFTConfig(**{field: value}))


@pytest.mark.parametrize("extra, match", [
    (["trainer.flow_grpo.algorithm=dpo"], r"trainer.flow_grpo.algorithm='dpo': choose 'flow_grpo' or 'diffusion_nft'"),
    (["trainer.flow_grpo.algorithm=diffusion_nft", "trainer.flow_grpo.nft.beta=0"], r"trainer.flow_grpo.nft.beta=0"),
])
def test_trainer_refuses_bad_algorithm_config_before_workers_start(tmp_path, extra, match):
    import json

    from polyrl_diffusion.models import make_tiny_pipeline

    from polyrl.trainer.commands import train

    model = make_tiny_pipeline(tmp_path / "model", family="sd3", seed=0)
    (tmp_path / "p.jsonl").write_text("\n".join(json.dumps({"prompt": "a red house"}) for _ in range(4)))
    (tmp_path / "m.toml").write_text('[plugins]\nrequire = ["polyrl-engine-fsdp", "polyrl-diffusion"]\n')
    with pytest.raises(ConfigError, match=match):
        train(tmp_path / "m.toml", [], [
            f"model.path={model}", f"data.train_files=[{tmp_path / 'p.jsonl'}]", "data.train_batch_size=4",
            "actor.engine=diffusers", "rollout.name=diffusers", "trainer.name=flow_grpo", "trainer.executor=local",
            "algorithm.adv_estimator=flow_grpo", "reward.function=brightness", "actor.ppo_mini_batch_size=4",
            "rollout.n=2", "trainer.total_steps=1", f"trainer.run_dir={tmp_path / 'run'}", *extra])
