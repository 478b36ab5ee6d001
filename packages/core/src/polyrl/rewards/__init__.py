"""Reward functions (verl's ``compute_score``) and the reward managers that apply them to a batch."""

from __future__ import annotations

from typing import TYPE_CHECKING

from polyrl.lazy import lazy_getattr

if TYPE_CHECKING:
    from polyrl.rewards.config import RewardConfig
    from polyrl.rewards.managers import BatchRewardManager, DAPORewardManager, NaiveRewardManager
    from polyrl.rewards.scoring import default_compute_score, load_compute_score

# Imported on first use (PEP 562), so that loading the hooks module next to this package
# (``polyrl plugins``) does not import torch.
_EXPORTS = {
    "RewardConfig": "polyrl.rewards.config",
    "BatchRewardManager": "polyrl.rewards.managers",
    "DAPORewardManager": "polyrl.rewards.managers",
    "NaiveRewardManager": "polyrl.rewards.managers",
    "default_compute_score": "polyrl.rewards.scoring",
    "load_compute_score": "polyrl.rewards.scoring",
}


__getattr__ = lazy_getattr(__name__, _EXPORTS)


__all__ = ["BatchRewardManager", "DAPORewardManager", "NaiveRewardManager", "RewardConfig", "default_compute_score", "load_compute_score"]
