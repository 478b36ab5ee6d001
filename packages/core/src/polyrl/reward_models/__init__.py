"""Reward models: a trained model scoring each sample, discriminative (a sequence classifier or a causal LM
with a value head, scored at the last token by an engine) or generative (a judge whose verdict a registered
parser reads). The ``reward_model`` role runs it in the pool ``trainer.placement`` gives it; its score joins
the reward function's through ``reward.combine`` (docs/reward_models.md)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from polyrl.lazy import lazy_getattr

if TYPE_CHECKING:
    from polyrl.reward_models.config import JudgeConfig, RewardModelConfig
    from polyrl.reward_models.inputs import RewardModelInputs
    from polyrl.reward_models.parsers import parse_boxed, parse_json, parse_score_line
    from polyrl.reward_models.scorer import RewardModelScorer, check_reward_model, reward_model_spec

_EXPORTS = {
    "JudgeConfig": "polyrl.reward_models.config",
    "RewardModelConfig": "polyrl.reward_models.config",
    "RewardModelInputs": "polyrl.reward_models.inputs",
    "parse_boxed": "polyrl.reward_models.parsers",
    "parse_json": "polyrl.reward_models.parsers",
    "parse_score_line": "polyrl.reward_models.parsers",
    "RewardModelScorer": "polyrl.reward_models.scorer",
    "check_reward_model": "polyrl.reward_models.scorer",
    "reward_model_spec": "polyrl.reward_models.scorer",
}

__getattr__ = lazy_getattr(__name__, _EXPORTS)

__all__ = ["JudgeConfig", "RewardModelConfig", "RewardModelInputs", "RewardModelScorer", "check_reward_model",
           "parse_boxed", "parse_json", "parse_score_line", "reward_model_spec"]
