"""Every built-in estimator and policy loss passes the conformance suite of its protocol."""

from __future__ import annotations

import pytest
import torch

from polyrl.algorithms import get_adv_estimator_fn, get_policy_loss_fn
from polyrl.testing import AdvantageEstimatorConformance, PolicyLossConformance

EXTRA_KWARGS = {
    "gae": {"values": lambda b, r: torch.randn(b, r), "gamma": 0.9, "lam": 0.95},
    "remax": {"reward_baselines": lambda b, r: torch.rand(b)},
    "optimal_token_baseline": {"old_log_probs": lambda b, r: -torch.rand(b, r),
                               "sum_pi_squared": lambda b, r: torch.rand(b, r) * 0.5},
    "tir_optimal_token_baseline": {"old_log_probs": lambda b, r: -torch.rand(b, r),
                                   "sum_pi_squared": lambda b, r: torch.rand(b, r) * 0.5,
                                   "rollout_is_weights": lambda b, r: torch.rand(b, r) + 0.5},
    # episodes of two steps; anchor states shared across episodes
    "gigpo": {"step_rewards": lambda b, r: torch.rand(b), "anchor_key": lambda b, r: torch.arange(b) % 3,
              "episode_id": lambda b, r: torch.arange(b) // 2, "step_index": lambda b, r: torch.arange(b) % 2},
}


@pytest.fixture(params=["gae", "grpo", "grpo_passk", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline",
                        "remax", "opo", "gpg", "grpo_vectorized", "rloo_vectorized", "gdpo", "optimal_token_baseline",
                        "tir_optimal_token_baseline", "gigpo"])
def estimator_name(request):
    return request.param


class TestBuiltinEstimators(AdvantageEstimatorConformance):
    @pytest.fixture
    def estimator(self, estimator_name):
        return get_adv_estimator_fn(estimator_name)

    @pytest.fixture
    def estimator_kwargs(self, estimator_name):
        return EXTRA_KWARGS.get(estimator_name, {})


class TestVanilla(PolicyLossConformance):
    config = {"clip_ratio": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": 3.0}

    @pytest.fixture
    def policy_loss(self):
        return get_policy_loss_fn("vanilla")


class TestVanillaWithTruncatedIS(TestVanilla):
    config = {"clip_ratio": 0.2, "policy_loss": {"tis_imp_ratio_cap": 2.0}}


class TestGSPO(PolicyLossConformance):
    config = {"clip_ratio_low": 3e-4, "clip_ratio_high": 4e-4}
    on_policy_agg_mode = "seq-mean-token-mean"

    @pytest.fixture
    def policy_loss(self):
        return get_policy_loss_fn("gspo")


class TestGPG(PolicyLossConformance):
    @pytest.fixture
    def policy_loss(self):
        return get_policy_loss_fn("gpg")


class TestClipCov(PolicyLossConformance):
    # a ratio large enough that some tokens are cut in these small batches
    config = {"clip_ratio": 0.2, "policy_loss": {"clip_cov_ratio": 0.2, "clip_cov_lb": 0.0, "clip_cov_ub": 5.0}}
    split_invariant = False
    on_policy_agg_mode = None

    @pytest.fixture
    def policy_loss(self):
        return get_policy_loss_fn("clip_cov")


class TestKLCov(PolicyLossConformance):
    config = {"policy_loss": {"kl_cov_ratio": 0.2, "ppo_kl_coef": 1.0}}
    split_invariant = False

    @pytest.fixture
    def policy_loss(self):
        return get_policy_loss_fn("kl_cov")


class TestCISPO(PolicyLossConformance):
    config = {"clip_ratio_low": 1.0, "clip_ratio_high": 0.28}

    @pytest.fixture
    def policy_loss(self):
        return get_policy_loss_fn("cispo")


class TestSAPO(PolicyLossConformance):
    config = {"tau_pos": 1.0, "tau_neg": 1.05}
    on_policy_agg_mode = "seq-mean-token-mean"

    @pytest.fixture
    def policy_loss(self):
        return get_policy_loss_fn("sapo")


class TestGeoMean(PolicyLossConformance):
    config = {"clip_ratio": 0.4}
    on_policy_agg_mode = "seq-mean-token-mean"

    @pytest.fixture
    def policy_loss(self):
        return get_policy_loss_fn("geo_mean")


class TestDRO(PolicyLossConformance):
    config = {"policy_loss": {"dro_beta": 0.5}}

    @pytest.fixture
    def policy_loss(self):
        return get_policy_loss_fn("dro")


class TestDPPOTV(PolicyLossConformance):
    config = {"clip_ratio": 0.1, "clip_ratio_c": 20.0}

    @pytest.fixture
    def policy_loss(self):
        return get_policy_loss_fn("dppo_tv")


class TestDPPOKL(TestDPPOTV):
    @pytest.fixture
    def policy_loss(self):
        return get_policy_loss_fn("dppo_kl")


class TestBypassMode(PolicyLossConformance):
    config = {"clip_ratio": 0.2, "policy_loss": {"rollout_correction": {"rollout_is": "token",
                                                                        "rollout_is_threshold": 2.0}}}
    is_weights_scale_the_loss = False  # computes its own weights from the current log-probs (verl's bypass)

    @pytest.fixture
    def policy_loss(self):
        return get_policy_loss_fn("bypass_mode")


class TestBypassModeReinforce(TestBypassMode):
    config = {"policy_loss": {"rollout_correction": {"loss_type": "reinforce", "rollout_is": "sequence",
                                                     "rollout_is_threshold": 2.0}}}
    on_policy_agg_mode = None  # sequence weights are not 1 at ratio 1 of this call's old/new
