"""Conformance suite for policy losses: verl's signature plus the keywords the trainer passes
(:class:`polyrl.protocols.PolicyLoss`: ``rollout_log_probs``, ``loss_scale``, ``rollout_is_weights``).

Subclass it and provide a ``policy_loss`` fixture (the function). Class attributes
tune it to the loss:

- ``config``: the actor config (a mapping) the loss is called with.
- ``split_invariant`` (True): splitting a mini-batch into micro-batches and
  data-parallel ranks, each normalised with the global ``LossScale``, gives the same
  loss as the whole. False for losses that select tokens per call (clip_cov, kl_cov).
- ``on_policy_agg_mode`` ("token-mean"): the ``loss_agg_mode`` under which, with
  ``log_prob == old_log_prob``, the gradient is the plain policy gradient of
  ``agg_loss(-A * log_prob)``; None to skip that check.
- ``is_weights_scale_the_loss`` (True): ``rollout_is_weights`` multiply the per-token losses,
  so constant weights ``c`` give ``c`` times the loss. False for a loss that uses them otherwise.

A loss written for verl that declares only some of the keywords runs in the trainer anyway
(:func:`polyrl.algorithms.as_policy_loss` adapts it at look-up); this suite checks the whole
protocol, so declare them to pass it.

::

    class TestMyLoss(PolicyLossConformance):
        @pytest.fixture
        def policy_loss(self):
            return my_loss
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from polyrl.protocols import LossScale

AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def make_inputs(seed: int = 0, b: int = 6, r: int = 7, spread: float = 0.3):
    """``(old_log_prob, log_prob (leaf, requires grad), advantages, response_mask)`` with ragged masks."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, r, generator=g) * 3
    new = (old + spread * torch.randn(b, r, generator=g)).requires_grad_(True)
    adv = torch.randn(b, 1, generator=g).expand(b, r).contiguous()
    lengths = torch.randint(1, r + 1, (b,), generator=g)
    lengths[0] = r
    mask = (torch.arange(r)[None, :] < lengths[:, None]).float()
    return old, new, adv, mask


def _namespace(value: Any) -> Any:
    if isinstance(value, dict):
        return SimpleNamespace(**{k: _namespace(v) for k, v in value.items()})
    return value


class PolicyLossConformance:
    """What every policy loss promises: ``fn(old_log_prob, log_prob, advantages, response_mask,
    loss_agg_mode, config, rollout_log_probs=None, *, loss_scale=None, rollout_is_weights=None)
    -> (scalar loss, float metrics)``."""

    config: dict[str, Any] = {"clip_ratio": 0.2, "clip_ratio_c": 3.0}
    split_invariant: bool = True
    on_policy_agg_mode: str | None = "token-mean"
    is_weights_scale_the_loss: bool = True

    def _loss(self, policy_loss, old, new, adv, mask, mode="token-mean", config=None, **kw):
        torch.manual_seed(0)  # losses that sample tokens (clip_cov) are reproducible per call
        return policy_loss(old, new, adv, mask, mode, self.config if config is None else config, **kw)

    def test_scalar_finite_loss_with_a_finite_gradient(self, policy_loss):
        old, new, adv, mask = make_inputs()
        loss, metrics = self._loss(policy_loss, old, new, adv, mask)
        assert isinstance(loss, torch.Tensor) and loss.dim() == 0 and torch.isfinite(loss)
        loss.backward()
        assert new.grad is not None and torch.isfinite(new.grad).all()
        assert isinstance(metrics, dict)
        for key, value in metrics.items():
            assert isinstance(float(value), float), f"metric {key!r} is not a number"

    def test_masked_tokens_never_contribute(self, policy_loss):
        old, new, adv, mask = make_inputs(seed=1)
        loss, _ = self._loss(policy_loss, old, new, adv, mask)
        loss.backward()
        assert torch.all(new.grad[mask == 0] == 0), "masked tokens received gradient"
        junk = mask == 0
        old2, adv2 = old.masked_fill(junk, -7.0), adv.masked_fill(junk, 100.0)
        new2 = new.detach().masked_fill(junk, 5.0).requires_grad_(True)
        loss2, _ = self._loss(policy_loss, old2, new2, adv2, mask)
        assert torch.allclose(loss, loss2, atol=1e-6), "values under masked tokens changed the loss"

    def test_nan_in_padding_changes_neither_loss_nor_gradient(self, policy_loss):
        old, new, adv, mask = make_inputs(seed=9)
        loss, _ = self._loss(policy_loss, old, new, adv, mask)
        loss.backward()
        nan = torch.full_like(old, float("nan"))
        junk = mask == 0
        new2 = torch.where(junk, nan, new.detach()).requires_grad_(True)
        loss2, metrics = self._loss(policy_loss, torch.where(junk, nan, old), new2, torch.where(junk, nan, adv), mask)
        loss2.backward()
        assert torch.isfinite(loss2) and float(loss2.detach()) == pytest.approx(float(loss.detach()), abs=1e-6)
        assert new2.grad is not None and new.grad is not None
        assert torch.allclose(new2.grad, new.grad, atol=1e-7), "NaN in padding reached the gradient"
        assert all(float(v) == float(v) for v in metrics.values()), f"a metric is NaN: {metrics}"

    @pytest.mark.parametrize("mode", AGG_MODES)
    def test_micro_batches_and_ranks_with_loss_scale_sum_to_the_whole(self, policy_loss, mode):
        if not self.split_invariant:
            pytest.skip("this loss selects tokens per call; its value depends on the split")
        old, new, adv, mask = make_inputs(seed=2)
        whole, _ = self._loss(policy_loss, old, new, adv, mask, mode)
        whole.backward()
        grad_whole, new.grad = new.grad.clone(), None
        # 2 data-parallel ranks of 3 rows, each in micro-batches of 2 and 1, normalised by global counts
        scale = LossScale(dp_size=2, batch_num_tokens=int(mask.sum()), global_batch_size=mask.shape[0])
        rank_losses = []
        for rows in ((slice(0, 2), slice(2, 3)), (slice(3, 5), slice(5, 6))):
            parts = [self._loss(policy_loss, old[s], new[s], adv[s], mask[s], mode, loss_scale=scale)[0]
                     for s in rows]
            rank_losses.append(sum(parts))
        averaged = sum(rank_losses) / 2  # what all-reduce(mean) of the ranks' gradients amounts to
        averaged.backward()
        assert float(averaged.detach()) == pytest.approx(float(whole.detach()), abs=1e-5)
        assert torch.allclose(new.grad, grad_whole, atol=1e-5)

    def test_all_masked_micro_batch_with_loss_scale_adds_nothing(self, policy_loss):
        old, new, adv, mask = make_inputs(seed=3)
        scale = LossScale(dp_size=1, batch_num_tokens=10, global_batch_size=4)
        loss, _ = self._loss(policy_loss, old, new, adv, torch.zeros_like(mask), loss_scale=scale)
        loss.backward()  # padding micro-batches still run backward (FSDP collectives)
        assert float(loss.detach()) == 0.0
        assert torch.all(new.grad == 0)

    def test_all_zero_mask_without_loss_scale_raises(self, policy_loss):
        old, new, adv, mask = make_inputs(seed=4)
        with pytest.raises(ValueError, match="response_mask"):
            self._loss(policy_loss, old, new, adv, torch.zeros_like(mask))

    def test_mismatched_shapes_raise_value_error(self, policy_loss):
        old, new, adv, mask = make_inputs(seed=5)
        with pytest.raises(ValueError, match="shape"):
            self._loss(policy_loss, old, new[:, :3], adv, mask)

    def test_on_policy_gradient_is_the_plain_policy_gradient(self, policy_loss):
        if self.on_policy_agg_mode is None:
            pytest.skip("this loss is not the plain policy gradient at ratio 1")
        from polyrl.algorithms import agg_loss

        old, _, adv, mask = make_inputs(seed=6)
        new = old.clone().requires_grad_(True)
        loss, _ = self._loss(policy_loss, old, new, adv, mask, self.on_policy_agg_mode)
        loss.backward()
        ref = old.clone().requires_grad_(True)
        agg_loss(-adv * ref, mask, self.on_policy_agg_mode).backward()
        assert torch.allclose(new.grad, ref.grad, atol=1e-6)

    def test_config_may_be_a_mapping_or_an_object(self, policy_loss):
        old, new, adv, mask = make_inputs(seed=7)
        as_dict, _ = self._loss(policy_loss, old, new, adv, mask)
        as_obj, _ = self._loss(policy_loss, old, new, adv, mask, config=_namespace(self.config))
        assert float(as_dict.detach()) == pytest.approx(float(as_obj.detach()), abs=1e-7)

    def test_rollout_log_probs_equal_to_old_change_nothing(self, policy_loss):
        old, new, adv, mask = make_inputs(seed=8)
        plain, _ = self._loss(policy_loss, old, new, adv, mask)
        with_rollout, _ = self._loss(policy_loss, old, new, adv, mask, rollout_log_probs=old.clone())
        assert float(plain.detach()) == pytest.approx(float(with_rollout.detach()), abs=1e-6)

    def test_takes_every_keyword_the_trainer_passes(self, policy_loss):
        """The trainer calls with all three keywords, ``None`` where one does not apply."""
        old, new, adv, mask = make_inputs(seed=10)
        plain, _ = self._loss(policy_loss, old, new, adv, mask)
        explicit, _ = self._loss(policy_loss, old, new, adv, mask, rollout_log_probs=None, loss_scale=None,
                                 rollout_is_weights=None)
        assert float(explicit.detach()) == pytest.approx(float(plain.detach()), abs=1e-7)

    def test_rollout_is_weights_reweight_the_tokens(self, policy_loss):
        old, new, adv, mask = make_inputs(seed=11)
        plain, _ = self._loss(policy_loss, old, new, adv, mask)
        ones, _ = self._loss(policy_loss, old, new, adv, mask, rollout_is_weights=torch.ones_like(old))
        assert float(ones.detach()) == pytest.approx(float(plain.detach()), abs=1e-6)
        if not self.is_weights_scale_the_loss:
            return
        half, _ = self._loss(policy_loss, old, new, adv, mask, rollout_is_weights=torch.full_like(old, 0.5))
        assert float(half.detach()) == pytest.approx(0.5 * float(plain.detach()), abs=1e-6)
