"""VAPO's decoupled, length-adaptive GAE against its formula (python loops over the recursion, no shared code),
the core's ``gae`` where they coincide, the estimator conformance suite, and the trainer's configuration."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from polyrl_recipes.vapo import compute_vapo_advantage_return, length_adaptive_lambda

from polyrl.algorithms import compute_gae_advantage_return, masked_whiten
from polyrl.errors import ConfigError
from polyrl.testing import AdvantageEstimatorConformance


def _gae_by_hand(rewards: list[float], values: list[float], gamma: float, lam: float) -> list[float]:
    """``A_t = sum_l (gamma lam)^l delta_{t+l}``, ``delta_t = r_t + gamma V_{t+1} - V_t`` (``V_T = 0``)."""
    n = len(rewards)
    deltas = [rewards[t] + gamma * (values[t + 1] if t + 1 < n else 0.0) - values[t] for t in range(n)]
    return [sum((gamma * lam) ** k * deltas[t + k] for k in range(n - t)) for t in range(n)]


def _inputs():
    g = torch.Generator().manual_seed(0)
    lengths = [6, 3, 1, 5]
    mask = torch.tensor([[1.0] * n + [0.0] * (6 - n) for n in lengths])
    rewards = torch.zeros(4, 6)
    for i, n in enumerate(lengths):
        rewards[i, n - 1] = float(torch.rand((), generator=g)) * 2 - 0.5
    values = torch.randn(4, 6, generator=g) * mask
    return rewards, values, mask, lengths


def test_decoupled_lambdas_follow_the_formula():
    rewards, values, mask, lengths = _inputs()
    gamma, lam_critic, lam_actor = 0.9, 1.0, 0.7
    adv, ret = compute_vapo_advantage_return(rewards, values, mask, gamma=gamma, lam_critic=lam_critic,
                                             lam_actor=lam_actor, length_adaptive=False)
    raw_actor = torch.zeros(4, 6, dtype=torch.float64)
    for i, n in enumerate(lengths):
        r, v = rewards[i, :n].tolist(), values[i, :n].tolist()
        critic = _gae_by_hand(r, v, gamma, lam_critic)
        assert ret[i, :n].tolist() == pytest.approx([a + b for a, b in zip(critic, v)], abs=1e-5)
        raw_actor[i, :n] = torch.tensor(_gae_by_hand(r, v, gamma, lam_actor), dtype=torch.float64)
    # the actor's advantages are whitened over the batch's response tokens
    valid = mask.bool()
    expected = (raw_actor[valid] - raw_actor[valid].mean()) / raw_actor[valid].std()
    assert adv[valid].double().tolist() == pytest.approx(expected.tolist(), abs=1e-4)
    assert not adv[~valid].any() and not ret[~valid].any()


def test_length_adaptive_lambda_per_response():
    mask = torch.zeros(4, 120)
    for i, n in enumerate([100, 40, 10, 0]):
        mask[i, :n] = 1
    lam = length_adaptive_lambda(mask, alpha=0.05)
    # 1 - 1/(0.05 * l): l=100 -> 0.8, l=40 -> 0.5, l=10 -> -1 clamped to 0, empty -> 0
    assert lam.tolist() == pytest.approx([0.8, 0.5, 0.0, 0.0])


def test_length_adaptive_advantages_use_each_rows_lambda():
    rewards, values, mask, lengths = _inputs()
    adv, _ = compute_vapo_advantage_return(rewards, values, mask, gamma=1.0, length_adaptive=True, alpha=0.25)
    raw = torch.zeros(4, 6, dtype=torch.float64)
    for i, n in enumerate(lengths):
        lam = min(1.0, max(0.0, 1 - 1 / (0.25 * n)))
        raw[i, :n] = torch.tensor(_gae_by_hand(rewards[i, :n].tolist(), values[i, :n].tolist(), 1.0, lam),
                                  dtype=torch.float64)
    assert torch.allclose(adv.double(), masked_whiten(raw, mask.double()), atol=1e-5)


def test_equal_lambdas_are_the_cores_gae():
    rewards, values, mask, _ = _inputs()
    adv, ret = compute_vapo_advantage_return(rewards, values, mask, gamma=0.95, lam_critic=0.8, lam_actor=0.8,
                                             length_adaptive=False)
    core_adv, core_ret = compute_gae_advantage_return(rewards, values, mask, gamma=0.95, lam=0.8)
    assert torch.allclose(adv, core_adv, atol=1e-6) and torch.allclose(ret, core_ret, atol=1e-6)


def test_options_come_from_the_configs_extra():
    rewards, values, mask, _ = _inputs()
    config = {"gamma": 1.0, "extra": {"lam_critic": 0.5, "lam_actor": 0.9, "length_adaptive": False}}
    by_config = compute_vapo_advantage_return(rewards, values, mask, config=config)
    by_keyword = compute_vapo_advantage_return(rewards, values, mask, gamma=1.0, lam_critic=0.5, lam_actor=0.9,
                                               length_adaptive=False)
    assert torch.equal(by_config[0], by_keyword[0]) and torch.equal(by_config[1], by_keyword[1])


class TestVAPOConformance(AdvantageEstimatorConformance):
    @pytest.fixture
    def estimator(self):
        return compute_vapo_advantage_return

    @pytest.fixture
    def estimator_kwargs(self):
        return {"values": lambda b, r: torch.randn(b, r)}


def test_the_trainer_runs_value_pretraining_as_the_critic_warm_up(base_overrides, manifest, tmp_path):
    from polyrl_recipes.vapo import VAPOTrainer

    from polyrl.config.loader import load_config
    from polyrl.config.schema import PolyrlConfig
    from polyrl.plugins import activate

    pm = activate(None)
    config = load_config(PolyrlConfig, [], base_overrides + ["trainer.name=vapo", "trainer.vapo.value_pretrain_steps=3",
                                                             "trainer.vapo.alpha=0.1"], plugins=pm)
    trainer = VAPOTrainer(config, plugins=pm)
    assert trainer.use_critic and config.critic.warmup_steps == 3 and config.algorithm.adv_estimator == "vapo"
    assert config.algorithm.extra["alpha"] == 0.1
    bad = load_config(PolyrlConfig, [], base_overrides + ["trainer.name=vapo", "critic.warmup_steps=5"], plugins=pm)
    with pytest.raises(ConfigError, match="critic.warmup_steps=5 and trainer.vapo.value_pretrain_steps=50"):
        VAPOTrainer(bad, plugins=pm)
    other = load_config(PolyrlConfig, [], base_overrides + ["trainer.name=vapo", "algorithm.adv_estimator=rloo"],
                        plugins=pm)
    with pytest.raises(ConfigError, match="algorithm.adv_estimator=rloo: trainer.name=vapo runs"):
        VAPOTrainer(other, plugins=pm)
    assert np.isfinite(config.algorithm.extra["lam_critic"])


def test_vapo_run_without_a_critic_is_refused_at_start_up(base_overrides, manifest, tmp_path):
    """A recipe needing a critic, run without one: one line at start-up naming the key."""
    from polyrl.trainer.commands import train

    with pytest.raises(ConfigError, match="critic.enable=false: trainer.name=vapo trains a critic"):
        train(manifest, [], base_overrides + ["trainer.name=vapo", "critic.enable=false"])
    # and in the core: an estimator that needs values with the critic turned off
    with pytest.raises(ConfigError, match="algorithm.adv_estimator=gae needs a critic's values but critic.enable=false"):
        train(manifest, [], base_overrides + ["algorithm.adv_estimator=gae", "critic.enable=false"])
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
