"""Padding never changes a result; multi-turn masks (tool tokens between turns) follow verl main."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from polyrl.algorithms import agg_loss, get_adv_estimator_fn, get_policy_loss_fn, masked_mean, masked_whiten
from polyrl.algorithms.torch_functional import masked_sum, masked_var

CFG = {"clip_ratio": 0.2, "clip_ratio_c": 3.0, "policy_loss": {"dro_beta": 0.5}}


# ---------------------------------------------------------------- multi-turn REINFORCE++ (verl #7300)


def test_reinforce_plus_plus_carries_the_return_over_tool_tokens_and_zeroes_them():
    mask = torch.tensor([[1.0, 1, 0, 0, 1, 1]])
    rewards = torch.tensor([[0.0, 0, 0, 0, 0, 1]])
    _, returns = get_adv_estimator_fn("reinforce_plus_plus")(rewards, mask, config={"gamma": 1.0})
    assert returns.tolist() == [[1.0, 1.0, 0.0, 0.0, 1.0, 1.0]]


def test_reinforce_plus_plus_discounts_only_over_model_tokens():
    mask = torch.tensor([[1.0, 1, 0, 0, 1, 1]])
    rewards = torch.tensor([[0.0, 0, 0, 0, 0, 1]])
    _, returns = get_adv_estimator_fn("reinforce_plus_plus")(rewards, mask, config={"gamma": 0.5})
    # the tool span is skipped, not counted as time steps: 0.5^3, 0.5^2, -, -, 0.5, 1
    assert torch.allclose(returns, torch.tensor([[0.125, 0.25, 0, 0, 0.5, 1.0]]))


# ---------------------------------------------------------------- NaN / inf in padding


def _poison(t: torch.Tensor, mask: torch.Tensor, value: float = float("nan")) -> torch.Tensor:
    return torch.where(mask == 0, torch.full_like(t, value), t)


MASK = torch.tensor([[1.0, 1, 1, 0], [1, 1, 0, 0], [1, 0, 1, 1]])


@pytest.mark.parametrize("fn", [masked_mean, masked_sum])
def test_masked_reductions_ignore_nan_in_padding(fn):
    x = torch.arange(12.0).reshape(3, 4)
    assert torch.equal(fn(_poison(x, MASK), MASK), fn(x, MASK))
    assert torch.equal(fn(_poison(x, MASK, float("inf")), MASK, -1), fn(x, MASK, -1))


def test_masked_var_and_whiten_ignore_nan_in_padding():
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    assert torch.equal(masked_var(_poison(x, MASK), MASK), masked_var(x, MASK))
    clean = masked_whiten(x, MASK)
    dirty = masked_whiten(_poison(x, MASK), MASK)
    assert torch.equal(dirty[MASK == 1], clean[MASK == 1])
    assert torch.isfinite(dirty).all()


@pytest.mark.parametrize("mode", ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean",
                                  "seq-mean-token-sum-norm"])
def test_agg_loss_ignores_nan_in_padding(mode):
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    assert torch.equal(agg_loss(_poison(x, MASK), MASK, mode), agg_loss(x, MASK, mode))


@pytest.mark.parametrize("name", ["vanilla", "gspo", "gpg", "clip_cov", "kl_cov", "cispo", "sapo", "geo_mean", "dro",
                                  "dppo_tv", "dppo_kl"])
@pytest.mark.parametrize("field", ["old_log_prob", "advantages", "log_prob", "rollout_log_probs"])
def test_policy_loss_and_gradient_ignore_nan_in_padding(name, field):
    g = torch.Generator().manual_seed(2)
    inputs = {"old_log_prob": -torch.rand(3, 4, generator=g) - 0.1, "advantages": torch.randn(3, 4, generator=g)}
    inputs["log_prob"] = inputs["old_log_prob"] + 0.1 * torch.randn(3, 4, generator=g)
    inputs["rollout_log_probs"] = inputs["old_log_prob"] + 0.1 * torch.randn(3, 4, generator=g)
    cfg = {**CFG, "policy_loss": {**CFG["policy_loss"], "tis_imp_ratio_cap": 2.0}}
    results = []
    for poison in (False, True):
        args = {k: (_poison(v, MASK) if poison and k == field else v.clone()) for k, v in inputs.items()}
        torch.manual_seed(0)  # clip_cov picks tokens at random
        log_prob = args.pop("log_prob").requires_grad_(True)
        loss, metrics = get_policy_loss_fn(name)(args["old_log_prob"], log_prob, args["advantages"], MASK,
                                                 "token-mean", cfg, rollout_log_probs=args["rollout_log_probs"])
        loss.backward()
        results.append((loss.detach(), log_prob.grad, metrics))
    (clean, clean_grad, clean_m), (dirty, dirty_grad, dirty_m) = results
    assert torch.isfinite(dirty) and torch.equal(dirty, clean)
    assert torch.isfinite(dirty_grad).all() and torch.equal(dirty_grad, clean_grad)
    assert all(np.isfinite(v) for v in dirty_m.values()), dirty_m


@pytest.mark.parametrize("name", ["grpo", "grpo_vectorized", "rloo", "rloo_vectorized", "opo", "gpg", "grpo_passk",
                                  "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax", "gdpo", "gae"])
def test_estimators_ignore_nan_rewards_and_values_in_padding(name):
    g = torch.Generator().manual_seed(3)
    rewards = torch.zeros(3, 4)
    rewards[0, 2], rewards[1, 1], rewards[2, 3] = 1.0, 0.0, 0.5
    extra = {"index": ["a", "a", "a"], "config": {"gamma": 0.9, "lam": 0.95}}
    if name == "remax":
        extra["reward_baselines"] = torch.tensor([0.5, 0.5, 0.5])
    values = torch.randn(3, 4, generator=g)
    clean = get_adv_estimator_fn(name)(token_level_rewards=rewards, response_mask=MASK,
                                       **({"values": values} if name == "gae" else {}), **extra)
    dirty = get_adv_estimator_fn(name)(token_level_rewards=_poison(rewards, MASK), response_mask=MASK,
                                       **({"values": _poison(values, MASK)} if name == "gae" else {}), **extra)
    for c, d in zip(clean, dirty, strict=True):
        assert torch.isfinite(d).all()
        assert torch.equal(d[MASK == 1], c[MASK == 1])


def test_value_loss_ignores_nan_in_padding():
    from polyrl.algorithms import compute_value_loss

    g = torch.Generator().manual_seed(4)
    vpreds, returns, values = (torch.randn(3, 4, generator=g) for _ in range(3))
    out = []
    for poison in (False, True):
        v = (_poison(vpreds, MASK) if poison else vpreds.clone()).requires_grad_(True)
        loss, _ = compute_value_loss(v, _poison(returns, MASK) if poison else returns,
                                     _poison(values, MASK) if poison else values, MASK, 0.2)
        loss.backward()
        out.append((loss.detach(), v.grad))
    assert torch.equal(out[0][0], out[1][0]) and torch.equal(out[0][1], out[1][1])
