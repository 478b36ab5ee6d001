"""Conformance suite for policy losses. Provide a ``policy_loss`` fixture (the function)."""

from __future__ import annotations

import pytest
import torch


class PolicyLossConformance:
    """What every policy loss promises (verl's signature plus ``loss_scale``)."""

    config = {"clip_ratio": 0.2, "clip_ratio_c": 3.0}

    def _inputs(self, seed=0):
        g = torch.Generator().manual_seed(seed)
        old = -torch.rand(4, 6, generator=g) * 3
        new = (old + 0.05 * torch.randn(4, 6, generator=g)).requires_grad_(True)
        adv = torch.randn(4, 1, generator=g).expand(4, 6).contiguous()
        mask = torch.ones(4, 6)
        mask[1, 4:] = 0
        return old, new, adv, mask

    def test_scalar_finite_loss_with_gradient(self, policy_loss):
        old, new, adv, mask = self._inputs()
        loss, metrics = policy_loss(old, new, adv, mask, "token-mean", self.config)
        assert loss.dim() == 0 and torch.isfinite(loss)
        loss.backward()
        assert new.grad is not None and torch.isfinite(new.grad).all()
        assert all(isinstance(float(v), float) for v in metrics.values())

    def test_masked_tokens_get_no_gradient(self, policy_loss):
        old, new, adv, mask = self._inputs(seed=1)
        loss, _ = policy_loss(old, new, adv, mask, "token-mean", self.config)
        loss.backward()
        assert torch.all(new.grad[mask == 0] == 0)

    def test_accepts_loss_scale(self, policy_loss):
        from polyrl.protocols import LossScale

        old, new, adv, mask = self._inputs(seed=2)
        scale = LossScale(dp_size=1, batch_num_tokens=int(mask.sum()), global_batch_size=4)
        loss, _ = policy_loss(old, new, adv, mask, "token-mean", self.config, loss_scale=scale)
        assert torch.isfinite(loss)

    def test_mismatched_shapes_raise(self, policy_loss):
        old, new, adv, mask = self._inputs()
        with pytest.raises(ValueError):
            policy_loss(old, new[:, :3], adv, mask, "token-mean", self.config)
