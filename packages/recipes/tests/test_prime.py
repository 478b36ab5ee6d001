"""PRIME's pieces against verl's recipe formulas (recomputed here with plain loops on fixed tensors), the
estimator conformance suite, and its start-up checks."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from polyrl_recipes.prime import (
    compute_prime_advantage,
    implicit_token_rewards,
    masked_rloo,
    prime_norm,
    prm_cross_entropy,
    prm_pairwise_accuracy,
)

from polyrl.errors import ConfigError
from polyrl.testing import AdvantageEstimatorConformance

N = 3  # samples per prompt
LENGTHS = [4, 2, 5, 1, 3, 5]


def _mask() -> torch.Tensor:
    return torch.tensor([[1.0] * n + [0.0] * (5 - n) for n in LENGTHS])


def _rloo_by_hand(rewards: list[list[float]], mask: list[list[int]], n: int) -> list[list[float]]:
    """verl's ``masked_rloo``, written out: groups of ``n`` consecutive samples; each masked entry ``r`` becomes
    ``r n/(n-1) - (sum of the group's per-sample masked means) / (n-1)``."""
    out = [row[:] for row in rewards]
    for start in range(0, len(rewards), n):
        means = []
        for i in range(start, start + n):
            vals = [rewards[i][t] for t in range(len(rewards[i])) if mask[i][t]]
            means.append(sum(vals) / len(vals))
        baseline = sum(means) / (n - 1)
        for i in range(start, start + n):
            for t in range(len(rewards[i])):
                out[i][t] = rewards[i][t] * n / (n - 1) - baseline if mask[i][t] else 0.0
    return out


def test_masked_rloo_is_verls():
    g = torch.Generator().manual_seed(0)
    mask = _mask()
    rewards = torch.randn(6, 5, generator=g)
    gid = torch.tensor([0, 0, 0, 1, 1, 1])
    got = masked_rloo(rewards, mask, gid)
    expected = _rloo_by_hand(rewards.tolist(), mask.long().tolist(), N)
    assert torch.allclose(got, torch.tensor(expected, dtype=torch.float64), atol=1e-9)


def test_implicit_rewards_leave_the_last_token_and_normalise_by_the_largest_reward_to_go():
    q = torch.arange(30, dtype=torch.float32).view(6, 5) / 10 - 1
    mask = _mask()
    r = implicit_token_rewards(q, mask, beta=0.05)
    for i, n in enumerate(LENGTHS):
        assert r[i, : n - 1].tolist() == pytest.approx((0.05 * q[i, : n - 1]).tolist())
        assert not r[i, n - 1 :].any()  # the last response token carries the outcome reward instead
    normed = prime_norm(r)
    biggest = max(abs(sum(r[i, t:].tolist())) for i in range(6) for t in range(5))
    assert torch.allclose(normed, r / (biggest + 1e-6))


def test_the_advantage_sums_rloo_of_both_rewards_then_whitens():
    g = torch.Generator().manual_seed(1)
    mask = _mask()
    prm = implicit_token_rewards(torch.randn(6, 5, generator=g), mask, 0.05)
    outcome = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 1.0])
    rewards = torch.zeros(6, 5)
    for i, n in enumerate(LENGTHS):
        rewards[i, n - 1] = outcome[i]
    index = np.array(["a"] * 3 + ["b"] * 3, dtype=object)
    adv, ret = compute_prime_advantage(rewards, mask, index, prm_scores=prm, reward_dpo_coef=5.0, reward_gt_coef=2.0)
    dpo = _rloo_by_hand(prm.tolist(), mask.long().tolist(), N)
    last = [[1 if t == n - 1 else 0 for t in range(5)] for n in LENGTHS]
    gt = _rloo_by_hand(rewards.tolist(), last, N)
    combined = [[5.0 * dpo[i][t] + 2.0 * gt[i][t] for t in range(5)] for i in range(6)]
    to_go = [[sum(combined[i][t:]) if mask[i, t] else 0.0 for t in range(5)] for i in range(6)]
    assert torch.allclose(ret.double(), torch.tensor(to_go, dtype=torch.float64), atol=1e-5)
    vals = [to_go[i][t] for i in range(6) for t in range(5) if mask[i, t]]
    mean = sum(vals) / len(vals)
    var = sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)
    for i in range(6):
        for t in range(LENGTHS[i]):
            assert float(adv[i, t]) == pytest.approx((to_go[i][t] - mean) / math.sqrt(var + 1e-8), abs=1e-4)


def test_prm_loss_is_the_cross_entropy_of_the_implicit_outcome():
    g = torch.Generator().manual_seed(2)
    mask = _mask()
    q = torch.randn(6, 5, generator=g) * 3
    labels = torch.tensor([1.0, 0.0, 0.5, 1.0, 0.0, 0.0])
    loss = prm_cross_entropy(q, labels, mask, beta=0.2)
    expected = 0.0
    for i, n in enumerate(LENGTHS):
        p = 1 / (1 + math.exp(-0.2 * float(q[i, :n].sum())))
        expected -= float(labels[i]) * math.log(p) + (1 - float(labels[i])) * math.log(1 - p)
    assert float(loss) == pytest.approx(expected / 6, rel=1e-5)


def test_pairwise_accuracy_is_verls():
    mask = torch.ones(6, 2)
    q = torch.tensor([[1.0, 0.0], [0.0, 0.0], [-1.0, 0.0], [0.0, 0.0], [0.5, 0.0], [0.2, 0.0]])
    labels = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0])
    gid = torch.tensor([0, 0, 0, 1, 1, 1])
    # group 0: pairs (0,1) and (0,2) ordered right, (1,2) has equal labels (weight 0): 1.0; group 1: all labels equal
    assert prm_pairwise_accuracy(q, labels, mask, gid) == pytest.approx((1.0 + 0.5) / 2)


class TestPRIMEConformance(AdvantageEstimatorConformance):
    @pytest.fixture
    def estimator(self):
        return compute_prime_advantage

    @pytest.fixture
    def estimator_kwargs(self):
        return {"prm_scores": lambda b, r: torch.randn(b, r) * 0.1}


def test_prime_needs_outcome_labels(base_overrides, manifest, tmp_path):
    """PRIME without outcome labels (rows with no ``reward_model.ground_truth``): one line at start-up, naming the
    key, before any worker starts."""
    import json

    from polyrl.trainer.commands import train

    rows = tmp_path / "unlabelled.jsonl"
    rows.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"{i}+1="}], "data_source": "arithmetic"})
                            + "\n" for i in range(8)))
    overrides = [o for o in base_overrides if not o.startswith("data.train_files")]
    with pytest.raises(ConfigError, match=r"data.train_files \(.*unlabelled.jsonl\), row 0: no reward_model.ground_truth"):
        train(manifest, [], overrides + [f"data.train_files=[{rows}]", "trainer.name=prime"])
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_prime_refuses_a_prm_from_another_model(base_overrides, manifest, tmp_path):
    from polyrl.trainer.commands import train

    with pytest.raises(ConfigError, match="trainer.prime.prm.model.path=/elsewhere: the implicit PRM's reference"):
        train(manifest, [], base_overrides + ["trainer.name=prime", "trainer.prime.prm.model.path=/elsewhere"])
    with pytest.raises(ConfigError, match="trainer.prime.update='after'"):
        train(manifest, [], base_overrides + ["trainer.name=prime", "trainer.prime.update=after"])


def test_the_implicit_prm_learns_outcome_labels(base_overrides):
    """The ``prm`` role for real (engine, its update, its scores): trained a few times on one batch whose labels
    mark half of each prompt's samples, its implicit scores come to order the samples as the labels do, and its
    cross-entropy falls; its reference log-probs are the reference policy's."""
    from pathlib import Path

    from polyrl_recipes.prime import PRIMETrainer

    from polyrl import batch as batch_ops
    from polyrl.config.loader import load_config
    from polyrl.config.schema import PolyrlConfig
    from polyrl.plugins import activate
    from polyrl.trainer.role_groups import build_role_groups

    pm = activate(None)
    config = load_config(PolyrlConfig, [], base_overrides + ["trainer.name=prime", "trainer.prime.prm.optim.lr=1e-3",
                                                             "trainer.prime.beta_train=0.5"], plugins=pm)
    trainer = PRIMETrainer(config, plugins=pm)
    trainer.groups = build_role_groups(config, manifest=None, use_ref=True, use_critic=False,
                                       run_dir=Path(config.trainer.run_dir), worker_cls=trainer.worker_cls,
                                       extra_roles=trainer.role_specs)
    try:
        batch = trainer.generate_batch(trainer.next_rows(), 4, validate=False)
        fields = batch_ops.tensor_fields(batch)
        ref = trainer.groups.ref.dispatch("compute_ref_log_prob", fields)["log_probs"]
        fields["prm_ref_log_prob"] = trainer.groups.ref.dispatch("compute_prm_ref_log_prob", fields)["log_probs"]
        assert torch.allclose(fields["prm_ref_log_prob"], ref, atol=1e-6)  # rollout.temperature is 1 here
        labels = torch.tensor([1.0, 1.0, 0.0, 0.0] * 4)
        fields["prm_labels"] = labels
        gid = torch.arange(16) // 4
        prm = trainer.groups.group_of("prm")
        q0 = prm.dispatch("compute_prm_scores", fields)["prm_q"]
        assert q0.abs().max() < 1e-5  # the PRM starts as the reference: no implicit reward
        losses = [prm.dispatch("update_prm", fields)["prm/loss"] for _ in range(8)]
        q = prm.dispatch("compute_prm_scores", fields)["prm_q"]
    finally:
        trainer.groups.shutdown()
    assert losses[-1] < losses[0] - 0.05, losses
    assert prm_pairwise_accuracy(q, labels, batch["response_mask"], gid) >= 0.9
