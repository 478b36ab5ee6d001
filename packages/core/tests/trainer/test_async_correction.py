"""The off-policy correction the async modes switch on (docs/async.md, "Off-policy correction"), checked against
numbers computed by hand from the formula: token-level truncated importance sampling ``min(pi_train / pi_rollout,
cap)`` on the policy gap, inside the on-policy update (ratio 1), and which settings ``configure_async_mode`` picks.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from tensordict import TensorDict

from polyrl.algorithms.rollout_correction import compute_rollout_correction_weights
from polyrl.config.schema import PolyrlConfig
from polyrl.errors import ConfigError
from polyrl.protocols import LossScale
from polyrl.trainer.losses import make_actor_loss
from polyrl.trainer.sample_sources import configure_async_mode

# Two responses of three tokens, the second with one padding token. Probabilities under the policy being trained
# and under the (older) policy that generated the tokens.
P_TRAIN = torch.tensor([[0.5, 0.3, 0.9], [0.2, 0.8, 0.1]])
P_ROLLOUT = torch.tensor([[0.25, 0.6, 0.3], [0.4, 0.2, 0.7]])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
# p_train / p_rollout = [[2.0, 0.5, 3.0], [0.5, 4.0, -]], truncated at 2; padding 0
EXPECTED_WEIGHTS = torch.tensor([[2.0, 0.5, 2.0], [0.5, 2.0, 0.0]])


def test_token_tis_weights_are_the_truncated_probability_ratio():
    weights, metrics = compute_rollout_correction_weights(P_TRAIN.log() - P_ROLLOUT.log(), MASK, "token", 2.0)
    torch.testing.assert_close(weights, EXPECTED_WEIGHTS)
    assert metrics["rollout_is_mean"] == pytest.approx(7.0 / 5)  # (2 + 0.5 + 2 + 0.5 + 2) / 5 tokens
    assert metrics["rollout_is_ratio_fraction_high"] == pytest.approx(2 / 5)  # 3.0 and 4.0 were truncated
    assert not weights.requires_grad


def test_sequence_tis_weight_is_the_truncated_product_over_the_response():
    weights, _ = compute_rollout_correction_weights(P_TRAIN.log() - P_ROLLOUT.log(), MASK, "sequence", 2.0)
    # products: 2 * 0.5 * 3 = 3 -> 2 (truncated); 0.5 * 4 = 2 (the padding token's ratio is left out)
    torch.testing.assert_close(weights, torch.tensor([[2.0, 2.0, 2.0], [2.0, 2.0, 0.0]]))


def _async_actor_config(cap: float = 2.0):
    """The actor config the trainer hands the workers in an async mode: correction as ``configure_async_mode`` and
    the trainer's rollout-correction step set it."""
    from polyrl.algorithms.rollout_correction import rollout_correction_settings

    cfg = PolyrlConfig()
    cfg.actor.policy_loss.rollout_correction = rollout_correction_settings(
        {"rollout_is": "token", "rollout_is_threshold": cap})
    return cfg.actor


def test_on_policy_update_of_stale_samples_weights_each_tokens_gradient_by_its_truncated_ratio():
    """One update pass (ratio 1 against the policy being trained): the loss is the token mean of ``-w A`` and
    d loss / d log p_t = ``-w_t A_t / tokens``, ``w_t = min(p_train / p_rollout, 2)``."""
    advantages = torch.tensor([[1.0, 1.0, 1.0], [-0.5, -0.5, -0.5]])
    log_prob = P_TRAIN.log().clone().requires_grad_(True)
    mb = TensorDict({"response_mask": MASK, "advantages": advantages, "rollout_log_probs": P_ROLLOUT.log()},
                    batch_size=[2])
    loss_fn = make_actor_loss(_async_actor_config(), on_policy=True)
    loss, metrics = loss_fn({"log_probs": log_prob}, mb, LossScale(dp_size=1, batch_num_tokens=5, global_batch_size=2))
    loss.backward()
    # by hand: -(2*1 + 0.5*1 + 2*1 + 0.5*(-0.5) + 2*(-0.5)) / 5 = -(4.5 - 1.25) / 5 = -0.65
    assert float(loss.detach()) == pytest.approx(-0.65)
    torch.testing.assert_close(log_prob.grad, -EXPECTED_WEIGHTS * advantages / 5)
    assert metrics["rollout_corr/rollout_is_mean"] == pytest.approx(7.0 / 5)


def test_without_the_correction_stale_samples_count_as_fresh():
    """The same batch with ``trainer.async_tis_cap=0`` (no correction): every token's gradient is ``-A / tokens``,
    so the test above is sensitive to the weights."""
    cfg = PolyrlConfig()
    advantages = torch.tensor([[1.0, 1.0, 1.0], [-0.5, -0.5, -0.5]])
    log_prob = P_TRAIN.log().clone().requires_grad_(True)
    mb = TensorDict({"response_mask": MASK, "advantages": advantages, "rollout_log_probs": P_ROLLOUT.log()},
                    batch_size=[2])
    loss, _ = make_actor_loss(cfg.actor, on_policy=True)({"log_probs": log_prob}, mb,
                                                          LossScale(dp_size=1, batch_num_tokens=5, global_batch_size=2))
    loss.backward()
    torch.testing.assert_close(log_prob.grad, -advantages * MASK / 5)


# ---------------------------------------------------------------------- what configure_async_mode picks


def _trainer(mode: str, **trainer_keys) -> SimpleNamespace:
    cfg = PolyrlConfig()
    cfg.trainer.async_mode = mode
    cfg.trainer.executor = "ray"
    cfg.trainer.placement = "split"
    for key, value in trainer_keys.items():
        setattr(cfg.trainer, key, value)
    placement = SimpleNamespace(spelling="split", shares=lambda a, b: False)
    return SimpleNamespace(config=cfg, placement=placement)


@pytest.mark.parametrize("mode", ["one_step_off_policy", "fully_async"])
def test_async_modes_switch_token_tis_on_with_the_configured_cap(mode):
    trainer = _trainer(mode, async_tis_cap=3.0)
    assert configure_async_mode(trainer) == mode
    rc = trainer.config.algorithm.rollout_correction
    assert (rc.rollout_is, rc.rollout_is_threshold, rc.bypass_mode) == ("token", 3.0, False)


def test_a_users_rollout_correction_wins_and_cap_zero_turns_it_off():
    trainer = _trainer("fully_async")
    trainer.config.algorithm.rollout_correction.rollout_is = "sequence"
    trainer.config.algorithm.rollout_correction.rollout_is_threshold = 5.0
    configure_async_mode(trainer)
    rc = trainer.config.algorithm.rollout_correction
    assert (rc.rollout_is, rc.rollout_is_threshold) == ("sequence", 5.0)
    off = _trainer("fully_async", async_tis_cap=0.0)
    configure_async_mode(off)
    assert off.config.algorithm.rollout_correction.rollout_is is None
    assert _trainer("sync").config.algorithm.rollout_correction.rollout_is is None


def test_async_mode_refuses_a_negative_staleness_bound():
    with pytest.raises(ConfigError, match="async_max_staleness"):
        configure_async_mode(_trainer("fully_async", async_max_staleness=-1))


def test_weights_match_exp_of_the_log_ratio_for_random_inputs():
    g = torch.Generator().manual_seed(0)
    log_ratio = torch.randn(4, 7, generator=g)
    mask = (torch.rand(4, 7, generator=g) > 0.2).float()
    weights, _ = compute_rollout_correction_weights(log_ratio, mask, "token", 1.5)
    for i in range(4):
        for j in range(7):
            want = min(math.exp(float(log_ratio[i, j])), 1.5) if mask[i, j] else 0.0
            assert float(weights[i, j]) == pytest.approx(want, rel=1e-6)
