"""PF-PPO (Zhang et al., "Policy Filtration in RLHF to Fine-Tune LLM for Code Generation", arXiv 2409.06957):
train on the samples whose reward is most reliable.

After the advantages are computed, the batch is resampled with replacement, each sample drawn with a
probability proportional to a weight of its score (verl's ``compute_pf_ppo_reweight_data``, same methods and
defaults): ``pow`` (``|score| ** weight_pow``), ``max_min`` (only the batch's best and worst scores),
``max_random`` (the best 0.4, any other 0.1). Every weight gets ``1e-8`` so a batch of zero scores is drawn
uniformly. The batch keeps its size, so data-parallel splits and mini-batches are unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
from tensordict import TensorDict

from polyrl.errors import ConfigError
from polyrl_recipes.base import RecipeTrainer
from polyrl_recipes.config import PFPPOConfig

__all__ = ["PFPPOTrainer", "pf_ppo_resample", "pf_ppo_weights"]

METHODS = ("pow", "max_min", "max_random")


def pf_ppo_weights(scores: torch.Tensor, reweight_method: str = "pow", weight_pow: float = 2.0) -> torch.Tensor:
    """PF-PPO's sampling weight of each sequence score ``[B]`` (before the ``1e-8`` floor)."""
    scores = scores.double()
    if reweight_method == "pow":
        return scores.abs().pow(weight_pow)
    if reweight_method == "max_min":
        return ((scores == scores.max()) | (scores == scores.min())).double()
    if reweight_method == "max_random":
        return torch.where(scores == scores.max(), 0.4, 0.1).double()
    raise ValueError(f"pf_ppo: reweight_method={reweight_method!r}; choose one of {', '.join(METHODS)}")


def pf_ppo_resample(scores: torch.Tensor, reweight_method: str = "pow", weight_pow: float = 2.0,
                    generator: torch.Generator | None = None) -> torch.Tensor:
    """Row indices ``[B]`` drawn with replacement in proportion to :func:`pf_ppo_weights` (+ ``1e-8``)."""
    weights = (pf_ppo_weights(scores, reweight_method, weight_pow) + 1e-8).clamp(min=1e-8)
    return torch.multinomial(weights, scores.shape[0], replacement=True, generator=generator)


class PFPPOTrainer(RecipeTrainer):
    """``trainer.name=pf_ppo``: after each step's advantage estimator (any; verl applies PF-PPO after ``gae``),
    the batch is resampled by PF-PPO's weights of the sequence scores (``trainer.pf_ppo``, :class:`PFPPOConfig`).
    The draw is seeded by ``trainer.seed`` and the step, so a resumed run draws what an uninterrupted one would."""

    recipe = "pf_ppo"
    options_cls = PFPPOConfig

    def configure(self, config: Any) -> None:
        super().configure(config)
        if self.options.reweight_method not in METHODS:
            raise ConfigError(f"trainer.pf_ppo.reweight_method={self.options.reweight_method!r}: choose one of "
                              f"{', '.join(METHODS)}")

    def after_advantage(self, batch: TensorDict, metrics: dict[str, float]) -> TensorDict:
        scores = batch["token_level_scores"].sum(-1)
        generator = torch.Generator().manual_seed(self.config.trainer.seed * 1_000_003 + self.global_step)
        rows = pf_ppo_resample(scores, self.options.reweight_method, self.options.weight_pow, generator)
        metrics["pf_ppo/unique_fraction"] = float(rows.unique().numel() / max(1, rows.numel()))
        metrics["pf_ppo/score_mean_before"] = float(scores.mean())
        metrics["pf_ppo/score_mean_after"] = float(scores[rows].mean())
        if "_acc" in batch.keys():  # the batch metrics (acc/mean...) describe the resampled batch
            metrics["pf_ppo/acc_mean_before"] = float(batch["_acc"].mean())
        return batch[rows]
