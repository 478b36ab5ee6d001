"""Reward functions (verl's ``compute_score``) and the reward managers that apply them to a batch."""

from polyrl.rewards.config import RewardConfig
from polyrl.rewards.managers import BatchRewardManager, DAPORewardManager, NaiveRewardManager
from polyrl.rewards.scoring import default_compute_score, load_compute_score

__all__ = [
    "BatchRewardManager",
    "DAPORewardManager",
    "NaiveRewardManager",
    "RewardConfig",
    "default_compute_score",
    "load_compute_score",
]
