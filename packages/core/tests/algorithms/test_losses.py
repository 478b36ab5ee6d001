"""Policy losses, KL estimators and controllers, loss aggregation, value loss: hand-computed cases and invariants."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from polyrl.algorithms import (
    AdaptiveKLController,
    FixedKLController,
    agg_loss,
    apply_kl_penalty,
    compute_value_loss,
    entropy_from_logits,
    get_kl_controller,
    get_policy_loss_fn,
    kl_penalty,
    masked_mean,
    masked_whiten,
)
from polyrl.protocols import LossScale

LOSSES = ["vanilla", "gspo", "gpg", "clip_cov", "kl_cov", "cispo", "sapo", "geo_mean"]
CFG = {"clip_ratio": 0.2, "clip_ratio_c": 3.0}


def log(*values):
    return torch.log(torch.tensor([values]))


def leaf(t):
    return t.clone().requires_grad_(True)


# ---------------------------------------------------------------- vanilla PPO


def test_vanilla_hand_computed_clip_and_dual_clip():
    old = torch.zeros(1, 4)
    new = leaf(log(1.5, 0.5, 1.1, 5.0))
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0]])
    loss, m = get_policy_loss_fn("vanilla")(old, new, adv, torch.ones(1, 4), "token-mean", CFG)
    # per token: -min(1.5, 1.2) ; max(0.5, 0.8) ; -1.1 ; dual clip: min(3, max(5, 1.2)) = 3
    assert loss.item() == pytest.approx((-1.2 + 0.8 - 1.1 + 3.0) / 4, abs=1e-6)
    assert m["pg_clipfrac"] == pytest.approx(0.5)
    assert m["pg_clipfrac_lower"] == pytest.approx(0.25)
    assert m["ppo_kl"] == pytest.approx(-new.mean().item(), abs=1e-6)
    loss.backward()
    # clipped tokens (1, 2 and the dual-clipped 4) get no gradient; token 3 gets -A r / 4
    assert torch.allclose(new.grad, torch.tensor([[0.0, 0.0, -1.1 / 4, 0.0]]), atol=1e-6)


def test_asymmetric_clip_higher():
    old, new = torch.zeros(1, 2), log(1.5, 0.5)
    loss, _ = get_policy_loss_fn("vanilla")(old, new, torch.ones(1, 2), torch.ones(1, 2), "token-mean",
                                           {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28})
    assert loss.item() == pytest.approx(-(1.28 + 0.5) / 2, abs=1e-6)  # A > 0: the low clip never binds


def test_config_object_with_none_fields_falls_back_like_verl():
    cfg = SimpleNamespace(clip_ratio=0.1, clip_ratio_low=None, clip_ratio_high=None, clip_ratio_c=3.0, policy_loss=None)
    loss, _ = get_policy_loss_fn("vanilla")(torch.zeros(1, 1), log(1.5), torch.ones(1, 1), torch.ones(1, 1),
                                           "token-mean", cfg)
    assert loss.item() == pytest.approx(-1.1, abs=1e-6)


def test_dual_clip_bound_must_exceed_one():
    with pytest.raises(ValueError, match="clip_ratio_c must be > 1"):
        get_policy_loss_fn("vanilla")(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1),
                                      "token-mean", {"clip_ratio_c": 1.0})


def test_truncated_importance_sampling_from_rollout_log_probs():
    old = torch.zeros(1, 2)
    rollout = log(0.5, 2.0)  # weights exp(old - rollout) = 2.0 and 0.5, capped at 1.5
    for cfg in (dict(CFG, policy_loss={"tis_imp_ratio_cap": 1.5}), dict(CFG, tis_imp_ratio_cap=1.5)):
        loss, _ = get_policy_loss_fn("vanilla")(old, old.clone(), torch.ones(1, 2), torch.ones(1, 2), "token-mean",
                                               cfg, rollout_log_probs=rollout)
        assert loss.item() == pytest.approx(-(1.5 + 0.5) / 2)
    # off unless a cap is set; precomputed weights (verl >= 0.6) are used as given
    loss, _ = get_policy_loss_fn("vanilla")(old, old.clone(), torch.ones(1, 2), torch.ones(1, 2), "token-mean", CFG,
                                           rollout_log_probs=rollout)
    assert loss.item() == pytest.approx(-1.0)
    loss, _ = get_policy_loss_fn("gpg")(old, old.clone(), torch.ones(1, 2), torch.ones(1, 2), "token-mean", CFG,
                                       rollout_is_weights=torch.tensor([[2.0, 0.0]]))
    assert loss.item() == pytest.approx(0.0)  # -A log p = 0 at log p = 0, times any weight


@pytest.mark.parametrize("name", LOSSES)
def test_every_loss_applies_truncated_is(name):
    torch.manual_seed(0)
    old, adv = -torch.rand(3, 4), torch.randn(3, 1).expand(3, 4).contiguous()
    new = old + 0.01 * torch.randn(3, 4) - 0.5
    mask = torch.ones(3, 4)
    cfg = dict(CFG, policy_loss={"tis_imp_ratio_cap": 3.0, "clip_cov_ratio": 1e-6, "kl_cov_ratio": 1e-6})
    fn = get_policy_loss_fn(name)
    torch.manual_seed(1)
    plain, _ = fn(old, new, adv, mask, "token-mean", cfg)
    torch.manual_seed(1)
    weighted, _ = fn(old, new, adv, mask, "token-mean", cfg, rollout_log_probs=old - math.log(2.0))
    assert weighted.item() == pytest.approx(2.0 * plain.item(), rel=1e-5)  # every weight is exactly 2


# ---------------------------------------------------------------- the other losses, by hand


def test_gspo_uses_the_sequence_ratio():
    old = torch.zeros(2, 2)
    new = leaf(torch.cat([log(2.0, 0.5), log(1.5, 1.5)]))
    adv = torch.ones(2, 2)
    loss, m = get_policy_loss_fn("gspo")(old, new, adv, torch.ones(2, 2), "token-mean", CFG)
    # row 0: geometric mean ratio 1 -> -1 ; row 1: ratio 1.5 clipped to 1.2 -> -1.2
    assert loss.item() == pytest.approx((-1.0 - 1.2) / 2, abs=1e-6)
    assert m["pg_clipfrac"] == pytest.approx(0.5)
    loss.backward()
    # row 0: d(-s_t)/d log p_t = -s = -1, seq-mean-token-mean over 2 rows of 2 tokens; row 1 clipped
    assert torch.allclose(new.grad, torch.tensor([[-0.25, -0.25], [0.0, 0.0]]), atol=1e-6)


def test_gpg_is_the_plain_policy_gradient():
    logp = leaf(log(0.5, 0.25))
    loss, _ = get_policy_loss_fn("gpg")(torch.zeros(1, 2), logp, torch.tensor([[2.0, -1.0]]), torch.ones(1, 2),
                                       "token-mean", CFG)
    assert loss.item() == pytest.approx((-2 * math.log(0.5) + math.log(0.25)) / 2, abs=1e-6)


def test_clip_cov_cuts_the_gradient_of_a_high_covariance_token():
    old = torch.tensor([[-1.0, -2.0, -3.0]])
    new = leaf(old)
    adv = torch.tensor([[2.0, 0.0, 1.0]])
    # centred A = (1, -1, 0), centred log p = (1, 0, -1): cov = (1, 0, 0); only token 0 lies in (0.5, 5)
    cfg = dict(CFG, policy_loss={"clip_cov_ratio": 0.1, "clip_cov_lb": 0.5, "clip_cov_ub": 5.0})
    loss, m = get_policy_loss_fn("clip_cov")(old, new, adv, torch.ones(1, 3), "token-mean", cfg)
    assert loss.item() == pytest.approx(-1.0 / 3, abs=1e-6)  # token 0's -2 is cut
    assert m["pg_clipfrac"] == pytest.approx(1 / 3)
    loss.backward()
    assert torch.allclose(new.grad, torch.tensor([[0.0, 0.0, -1 / 3]]), atol=1e-6)


def test_kl_cov_penalises_the_top_covariance_token():
    old = torch.tensor([[-1.0, -2.0, -3.0]])
    new = old + torch.tensor([[0.1, 0.0, 0.0]])
    adv = torch.tensor([[2.0, 0.0, 1.0]])
    cfg = {"policy_loss": {"kl_cov_ratio": 0.1, "ppo_kl_coef": 1.0}}
    loss, m = get_policy_loss_fn("kl_cov")(old, new, adv, torch.ones(1, 3), "token-mean", cfg)
    expected = (-2 * math.exp(0.1) + 1.0 * 0.1 + 0.0 - 1.0) / 3
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert m["ppo_kl_abs"] == pytest.approx(0.1 / 3, abs=1e-6)


def test_cispo_clips_the_weight_not_the_update():
    old = torch.zeros(1, 2)
    new = leaf(log(1.5, 0.5))
    adv = torch.ones(1, 2)
    loss, m = get_policy_loss_fn("cispo")(old, new, adv, torch.ones(1, 2), "token-mean",
                                         {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28})
    assert loss.item() == pytest.approx(-(1.28 * math.log(1.5) + 0.8 * math.log(0.5)) / 2, abs=1e-6)
    assert m["pg_clipfrac"] == pytest.approx(1.0)
    loss.backward()
    assert torch.allclose(new.grad, torch.tensor([[-1.28 / 2, -0.8 / 2]]), atol=1e-6)  # clipped tokens still learn


def test_sapo_gate():
    old = torch.zeros(1, 2)
    new = log(1.0, 1.5)
    adv = torch.tensor([[1.0, -1.0]])
    loss, _ = get_policy_loss_fn("sapo")(old, new, adv, torch.ones(1, 2), "token-mean", {"tau_pos": 1.0,
                                                                                          "tau_neg": 2.0})
    gate_pos = 4 * torch.sigmoid(torch.tensor(0.0))  # tau 1, r 1
    gate_neg = 4 / 2.0 * torch.sigmoid(torch.tensor(2.0 * 0.5))
    assert loss.item() == pytest.approx(float((-gate_pos + gate_neg) / 2), abs=1e-6)
    # temperatures also come from policy_loss.extra (polyrl's schema)
    loss2, _ = get_policy_loss_fn("sapo")(old, new, adv, torch.ones(1, 2), "token-mean",
                                         {"policy_loss": {"extra": {"tau_pos": 1.0, "tau_neg": 2.0}}})
    assert loss2.item() == pytest.approx(loss.item())


@pytest.mark.parametrize("a", [1.0, -1.0])
def test_geo_mean_clips_pessimistically_in_log_space(a):
    old = torch.zeros(1, 2)
    new = log(2.0, 0.5)
    loss, m = get_policy_loss_fn("geo_mean")(old, new, torch.full((1, 2), a), torch.ones(1, 2), "token-mean", CFG)
    ln2 = math.log(2.0)
    # A > 0: min(x, clip(x)) = (0.2, -ln2) ; A < 0: max(x, clip(x)) = (ln2, -0.2)
    mean_log = (0.2 - ln2) / 2 if a > 0 else (ln2 - 0.2) / 2
    assert loss.item() == pytest.approx(-a * math.exp(mean_log), abs=1e-6)
    assert m["pg_clipfrac" if a > 0 else "pg_clipfrac_lower"] == pytest.approx(1.0)


# ---------------------------------------------------------------- invariants


@settings(max_examples=50, deadline=None)
@given(seed=st.integers(0, 10_000), name=st.sampled_from(["vanilla", "gpg", "cispo", "kl_cov"]),
       mode=st.sampled_from(["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]))
def test_ratio_one_gives_the_plain_policy_gradient(seed, name, mode):
    torch.manual_seed(seed)
    logp = torch.randn(3, 5)
    adv = torch.randn(3, 5)  # token-level advantages too
    mask = (torch.rand(3, 5) > 0.3).float()
    mask[:, 0] = 1
    new = leaf(logp)
    loss, _ = get_policy_loss_fn(name)(logp, new, adv, mask, mode, CFG)
    loss.backward()
    ref = leaf(logp)
    agg_loss(-adv * ref, mask, mode).backward()
    assert torch.allclose(new.grad, ref.grad, atol=1e-6)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), name=st.sampled_from(LOSSES))
def test_masked_tokens_never_contribute(seed, name):
    torch.manual_seed(seed)
    old, adv = torch.randn(2, 6), torch.randn(2, 6)
    mask = torch.ones(2, 6)
    mask[:, 4:] = 0
    new = leaf(old + 0.1 * torch.randn(2, 6))
    loss, _ = get_policy_loss_fn(name)(old, new, adv, mask, "token-mean", CFG)
    loss.backward()
    assert torch.all(new.grad[:, 4:] == 0)
    assert torch.isfinite(loss)


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize("name", LOSSES)
def test_all_zero_mask_is_an_error_without_loss_scale(name):
    with pytest.raises(ValueError, match="response_mask is all zero"):
        get_policy_loss_fn(name)(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), torch.zeros(1, 2))


@pytest.mark.parametrize("name", LOSSES)
def test_non_finite_advantages_are_an_error(name):
    adv = torch.ones(1, 3)
    adv[0, 1] = float("nan")
    with pytest.raises(ValueError, match="advantages holds 1 NaN/inf"):
        get_policy_loss_fn(name)(torch.zeros(1, 3), torch.zeros(1, 3), adv, torch.ones(1, 3), "token-mean", CFG)


def test_shape_mismatch_names_the_arguments():
    with pytest.raises(ValueError, match=r"log_prob=\(1, 3\)"):
        get_policy_loss_fn("vanilla")(torch.zeros(1, 2), torch.zeros(1, 3), torch.ones(1, 2), torch.ones(1, 2))


def test_unknown_loss_lists_names():
    from polyrl.errors import RegistryError

    with pytest.raises(RegistryError, match="vanilla"):
        get_policy_loss_fn("vanila")


# ---------------------------------------------------------------- agg_loss


def test_agg_loss_modes_by_hand():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [9.0, 9.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])  # row 2 is padding
    assert float(agg_loss(loss, mask, "token-mean")) == pytest.approx(10 / 4)
    assert float(agg_loss(loss, mask, "seq-mean-token-sum")) == pytest.approx((6 + 4) / 2)
    assert float(agg_loss(loss, mask, "seq-mean-token-mean")) == pytest.approx((2 + 4) / 2)
    assert float(agg_loss(loss, mask, "seq-mean-token-sum-norm")) == pytest.approx((6 / 3 + 4 / 3) / 2)
    assert float(agg_loss(loss, mask, "seq-mean-token-sum-norm", loss_scale_factor=10)) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="loss_agg_mode='nope' is unknown"):
        agg_loss(loss, mask, "nope")


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_agg_loss_global_normalisation_by_hand(mode):
    loss, mask = torch.tensor([[1.0, 2.0], [3.0, 0.0]]), torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    scale = LossScale(dp_size=4, batch_num_tokens=30, global_batch_size=20)
    expected = {"token-mean": 6 / 30 * 4, "seq-mean-token-sum": 6 / 20 * 4, "seq-mean-token-mean": 4.5 / 20 * 4,
                "seq-mean-token-sum-norm": 3 / 20 * 4}[mode]
    assert float(agg_loss(loss, mask, mode, loss_scale=scale)) == pytest.approx(expected)


def test_agg_loss_rejects_an_empty_global_batch():
    with pytest.raises(ValueError, match="batch_num_tokens=0"):
        agg_loss(torch.ones(1, 2), torch.zeros(1, 2), "token-mean", loss_scale=LossScale(1, 0, 1))


# ---------------------------------------------------------------- KL


def test_kl_estimators():
    logp, ref = torch.tensor([0.0, -1.0]), torch.tensor([-1.0, 0.0])
    assert torch.allclose(kl_penalty(logp, ref, "k1"), torch.tensor([1.0, -1.0]))
    assert torch.allclose(kl_penalty(logp, ref, "kl"), kl_penalty(logp, ref, "k1"))
    assert torch.allclose(kl_penalty(logp, ref, "abs"), torch.tensor([1.0, 1.0]))
    assert torch.allclose(kl_penalty(logp, ref, "mse"), torch.tensor([0.5, 0.5]))
    k3 = torch.exp(ref - logp) - (ref - logp) - 1
    assert torch.allclose(kl_penalty(logp, ref, "low_var_kl"), k3)
    assert torch.allclose(kl_penalty(logp, ref, "k3"), k3)
    assert float(kl_penalty(torch.tensor([-30.0]), torch.tensor([0.0]), "k3")) == 10.0  # clamped like verl


@pytest.mark.parametrize("name", ["k1+", "k3+", "low_var_kl+", "abs+", "k2+"])
def test_straight_through_variants_have_the_value_of_the_name_and_the_gradient_of_k2(name):
    logp, ref = torch.tensor([0.0, -1.0, 0.3]), torch.tensor([-1.0, 0.0, 0.3])
    x = leaf(logp)
    value = kl_penalty(x, ref, name)
    assert torch.allclose(value, kl_penalty(logp, ref, name[:-1]))
    value.sum().backward()
    assert torch.allclose(x.grad, logp - ref)


def test_unknown_kl_names_the_argument():
    with pytest.raises(ValueError, match="kl_penalty='k9'"):
        kl_penalty(torch.zeros(1), torch.zeros(1), "k9")
    with pytest.raises(ValueError, match="'full' needs the whole vocabulary"):
        kl_penalty(torch.zeros(1), torch.zeros(1), "full")


def test_apply_kl_penalty_in_the_reward():
    scores = torch.tensor([[0.0, 1.0], [0.0, 2.0]])
    old, ref = torch.tensor([[0.5, 0.5], [1.0, 9.0]]), torch.zeros(2, 2)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    ctrl = FixedKLController(0.1)
    rewards, m = apply_kl_penalty(scores, old, ref, mask, ctrl, kl_penalty="kl")
    assert torch.allclose(rewards, torch.tensor([[-0.05, 0.95], [-0.1, 2.0]]))
    assert m["actor/reward_kl_penalty"] == pytest.approx((0.5 + 1.0) / 2)
    assert m["actor/reward_kl_penalty_coeff"] == pytest.approx(0.1)
    assert ctrl.value == 0.1  # the trainer updates the controller, not apply_kl_penalty


def test_kl_controllers():
    ctrl = get_kl_controller({"type": "adaptive", "kl_coef": 0.2, "target_kl": 0.1, "horizon": 100})
    assert isinstance(ctrl, AdaptiveKLController)
    ctrl.update(current_kl=0.15, n_steps=10)  # error clipped to +0.2
    assert ctrl.value == pytest.approx(0.2 * (1 + 0.2 * 10 / 100))
    ctrl.update(current_kl=0.09, n_steps=10)  # error -0.1
    assert ctrl.value == pytest.approx(0.2 * 1.02 * (1 - 0.1 * 0.1))
    fixed = get_kl_controller(SimpleNamespace(type="fixed", kl_coef=0.3))
    fixed.update(1.0, 10)
    assert fixed.value == 0.3
    with pytest.raises(ValueError, match="kl_ctrl.type='pid'"):
        get_kl_controller({"type": "pid"})
    with pytest.raises(ValueError, match="horizon must be > 0"):
        get_kl_controller({"type": "adaptive", "horizon": 0})


# ---------------------------------------------------------------- value loss, entropy, whitening


def test_value_loss_clips():
    v_old, ret = torch.zeros(1, 2), torch.ones(1, 2)
    vpred = torch.tensor([[2.0, 0.5]])
    loss, m = compute_value_loss(vpred, ret, v_old, torch.ones(1, 2), cliprange_value=0.2)
    # token 1: max((2-1)^2, (0.2-1)^2) = 1 ; token 2: max(0.25, 0.64) = 0.64
    assert loss.item() == pytest.approx(0.5 * (1 + 0.64) / 2)
    assert m["critic/vf_clipfrac"] == pytest.approx(0.5)
    scale = LossScale(dp_size=2, batch_num_tokens=4, global_batch_size=2)
    loss, _ = compute_value_loss(vpred, ret, v_old, torch.ones(1, 2), 0.2, loss_scale=scale)
    assert loss.item() == pytest.approx(0.5 * 1.64 / 4 * 2)


def test_entropy_from_logits():
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [100.0, 0.0, 0.0, 0.0]])
    assert torch.allclose(entropy_from_logits(logits), torch.tensor([math.log(4), 0.0]), atol=1e-6)


def test_masked_helpers():
    x, m = torch.tensor([1.0, 3.0, 100.0]), torch.tensor([1.0, 1.0, 0.0])
    assert float(masked_mean(x, m)) == 2.0
    assert float(masked_mean(x, torch.zeros(3))) == 0.0  # not NaN
    w = masked_whiten(x, m)
    assert torch.allclose(w[:2], torch.tensor([-1.0, 1.0]) / math.sqrt(2.0), atol=1e-6)
