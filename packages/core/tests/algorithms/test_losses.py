"""Policy losses, KL estimators and loss aggregation."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from polyrl.algorithms import agg_loss, compute_value_loss, get_policy_loss_fn, kl_penalty
from polyrl.protocols import LossScale

LOSSES = ["vanilla", "gspo", "gpg", "clip_cov", "kl_cov", "cispo", "sapo", "geo_mean"]
CFG = {"clip_ratio": 0.2, "clip_ratio_c": 3.0}


def test_vanilla_hand_computed_clip_and_dual_clip():
    old = torch.zeros(1, 4)
    new = torch.log(torch.tensor([[1.5, 0.5, 1.1, 5.0]]))
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0]])
    loss, m = get_policy_loss_fn("vanilla")(old, new, adv, torch.ones(1, 4), "token-mean", CFG)
    # per token: min(1.5,1.2)*1 -> -1.2 ; max(-0.5*-1, -0.8*-1)=0.8 ; -1.1 ; dual clip: min(3, max(5,1.2))=3
    expected = (-1.2 + 0.8 - 1.1 + 3.0) / 4
    assert float(loss) == pytest.approx(expected, abs=1e-5)
    assert m["pg_clipfrac"] == pytest.approx(0.5)
    assert m["pg_clipfrac_lower"] == pytest.approx(0.25)


def test_asymmetric_clip():
    old = torch.zeros(1, 1)
    new = torch.log(torch.tensor([[1.5]]))
    loss, _ = get_policy_loss_fn("vanilla")(old, new, torch.ones(1, 1), torch.ones(1, 1), "token-mean",
                                           {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28})
    assert float(loss) == pytest.approx(-1.28, abs=1e-5)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), name=st.sampled_from(["vanilla", "gspo", "cispo", "gpg"]))
def test_on_policy_gradient_is_plain_policy_gradient(seed, name):
    torch.manual_seed(seed)
    logp = torch.randn(3, 5)
    adv = torch.randn(3, 1).expand(3, 5).contiguous()
    mask = (torch.rand(3, 5) > 0.3).float()
    mask[:, 0] = 1
    mode = "seq-mean-token-mean" if name == "gspo" else "token-mean"
    new = logp.clone().requires_grad_(True)
    loss, _ = get_policy_loss_fn(name)(logp, new, adv, mask, mode, CFG)
    loss.backward()
    ref = logp.clone().requires_grad_(True)
    agg_loss(-adv * ref, mask, mode).backward()
    assert torch.allclose(new.grad, ref.grad, atol=1e-5)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), name=st.sampled_from(LOSSES))
def test_masked_tokens_never_contribute(seed, name):
    torch.manual_seed(seed)
    old, adv = torch.randn(2, 6), torch.randn(2, 6)
    mask = torch.ones(2, 6)
    mask[:, 4:] = 0
    new = (old + 0.1 * torch.randn(2, 6)).requires_grad_(True)
    loss, _ = get_policy_loss_fn(name)(old, new, adv, mask, "token-mean", CFG)
    loss.backward()
    assert torch.all(new.grad[:, 4:] == 0)
    assert torch.isfinite(loss)


def test_truncated_importance_sampling_weights():
    old = torch.zeros(1, 2)
    rollout = torch.log(torch.tensor([[0.5, 2.0]]))  # IS weights exp(old - rollout) = 2.0 and 0.5
    cfg = dict(CFG, policy_loss={"tis_imp_ratio_cap": 1.5})
    loss, _ = get_policy_loss_fn("vanilla")(old, old.clone(), torch.ones(1, 2), torch.ones(1, 2), "token-mean", cfg,
                                           rollout_log_probs=rollout)
    assert float(loss) == pytest.approx(-(1.5 + 0.5) / 2)


def test_all_zero_mask_is_an_error():
    with pytest.raises(ValueError, match="response_mask is all zero"):
        get_policy_loss_fn("vanilla")(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), torch.zeros(1, 2))


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_agg_loss_split_into_micro_batches_sums_to_whole(mode):
    torch.manual_seed(0)
    loss, mask = torch.randn(6, 5), (torch.rand(6, 5) > 0.4).float()
    mask[:, 0] = 1
    whole = agg_loss(loss, mask, mode)
    scale = LossScale(dp_size=1, batch_num_tokens=int(mask.sum()), global_batch_size=6)
    parts = sum(agg_loss(loss[i : i + 2], mask[i : i + 2], mode, loss_scale=scale) for i in range(0, 6, 2))
    assert float(parts) == pytest.approx(float(whole), abs=1e-5)


def test_agg_loss_modes_by_hand():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    assert float(agg_loss(loss, mask, "token-mean")) == pytest.approx(10 / 4)
    assert float(agg_loss(loss, mask, "seq-mean-token-sum")) == pytest.approx((6 + 4) / 2)
    assert float(agg_loss(loss, mask, "seq-mean-token-mean")) == pytest.approx((2 + 4) / 2)
    assert float(agg_loss(loss, mask, "seq-mean-token-sum-norm")) == pytest.approx((6 / 3 + 4 / 3) / 2)
    with pytest.raises(ValueError, match="loss_agg_mode='nope'"):
        agg_loss(loss, mask, "nope")


def test_kl_estimators():
    logp, ref = torch.tensor([0.0, -1.0]), torch.tensor([-1.0, 0.0])
    assert torch.allclose(kl_penalty(logp, ref, "k1"), torch.tensor([1.0, -1.0]))
    assert torch.allclose(kl_penalty(logp, ref, "abs"), torch.tensor([1.0, 1.0]))
    assert torch.allclose(kl_penalty(logp, ref, "k2"), torch.tensor([0.5, 0.5]))
    k3 = torch.exp(ref - logp) - (ref - logp) - 1
    assert torch.allclose(kl_penalty(logp, ref, "low_var_kl"), k3)
    x = logp.clone().requires_grad_(True)
    st_value = kl_penalty(x, ref, "k3+")
    assert torch.allclose(st_value, k3)
    st_value.sum().backward()
    assert torch.allclose(x.grad, logp - ref)  # the gradient of k2
    with pytest.raises(ValueError, match="kl_penalty='k9'"):
        kl_penalty(logp, ref, "k9")


def test_value_loss_clips():
    v_old, ret = torch.zeros(1, 2), torch.ones(1, 2)
    vpred = torch.tensor([[2.0, 0.5]])
    loss, m = compute_value_loss(vpred, ret, v_old, torch.ones(1, 2), cliprange_value=0.2)
    # token 1: max((2-1)^2, (0.2-1)^2) = 1 ; token 2: max(0.25, 0.64) = 0.64
    assert float(loss) == pytest.approx(0.5 * (1 + 0.64) / 2)
    assert m["critic/vf_clipfrac"] == pytest.approx(0.5)
