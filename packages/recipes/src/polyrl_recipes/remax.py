"""ReMax (Li et al., "ReMax: A Simple, Effective, and Efficient Reinforcement Learning Method for Aligning Large
Language Models", arXiv 2310.10505): REINFORCE whose baseline is the reward of the prompt's greedy response.

Each step, after the samples are scored, the trainer sends the step's prompts once more to the rollout with
temperature 0 (an extra generation request on the current weights), scores those greedy responses with the
same reward manager and hands each sample its prompt's greedy reward as ``reward_baselines`` to the core's
``remax`` estimator: ``A_t = sum_{s >= t} r_s - b``. verl does the same inside its trainer
(``adv_estimator=remax``); here it is a trainer of this plugin, ``trainer.name=remax``.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any

import torch
from tensordict import TensorDict

from polyrl import batch as batch_ops
from polyrl.agent_loops.runner import fold_tool_rewards
from polyrl.errors import ConfigError
from polyrl_recipes.base import RecipeTrainer
from polyrl_recipes.config import ReMaxConfig

__all__ = ["ReMaxTrainer", "greedy_baselines"]


def greedy_baselines(uids: list[Any], scores_by_uid: dict[Any, float], dtype: torch.dtype = torch.float32
                     ) -> torch.Tensor:
    """``reward_baselines [B]``: each sample's prompt's greedy-response score (looked up by the sample's uid)."""
    missing = sorted({str(u) for u in uids if u not in scores_by_uid})
    if missing:
        raise RuntimeError(f"remax: no greedy baseline for the prompts {missing[:3]}")
    return torch.tensor([float(scores_by_uid[u]) for u in uids], dtype=dtype)


class ReMaxTrainer(RecipeTrainer):
    """``trainer.name=remax``: the core's ``remax`` estimator with its baselines generated each step
    (``trainer.remax``, :class:`ReMaxConfig`). Synchronous training only: the baseline must come from the
    weights being trained."""

    recipe = "remax"
    adv_estimator = "remax"
    options_cls = ReMaxConfig
    provides_fields = frozenset({"reward_baselines"})

    def configure(self, config: Any) -> None:
        super().configure(config)
        if config.trainer.async_mode != "sync":
            raise ConfigError(f"trainer.async_mode={config.trainer.async_mode}: trainer.name=remax generates each "
                              "step's greedy baselines on the weights being trained; use trainer.async_mode=sync")
        if self.options.baseline_temperature < 0:
            raise ConfigError(f"trainer.remax.baseline_temperature={self.options.baseline_temperature}: must be 0 "
                              "(greedy) or more")
        #: the rows handed out by next_rows, by uid (a step may draw several times: dynamic sampling)
        self._rows: OrderedDict[Any, dict] = OrderedDict()

    def next_rows(self) -> list[dict]:
        rows = super().next_rows()
        for row in rows:
            self._rows[row["uid"]] = row
        while len(self._rows) > 8 * max(1, self.config.data.train_batch_size):  # rows of steps long gone
            self._rows.popitem(last=False)
        return rows

    def before_advantage(self, batch: TensorDict, metrics: dict[str, float]) -> TensorDict:
        start = time.perf_counter()
        uids = batch_ops.non_tensor(batch, "uid")
        prompts = list(dict.fromkeys(uids))
        rows = [self._rows[u] for u in prompts]
        sampling = self.sampling_params().replace(temperature=self.options.baseline_temperature, top_p=1.0, top_k=-1)
        greedy = self.generate_batch(self.pad_rows(rows), 1, validate=False, sampling=sampling)[: len(rows)]
        out = self.reward_fn(greedy)
        greedy["token_level_scores"] = out.token_level_scores.float()
        fold_tool_rewards(greedy, self.config.agent)
        scores = greedy["token_level_scores"].sum(-1).tolist()
        batch["reward_baselines"] = greedy_baselines(uids, dict(zip(prompts, scores)))
        metrics["remax/baseline_score_mean"] = float(sum(scores) / max(1, len(scores)))
        metrics["remax/baseline_response_length"] = float(greedy["response_mask"].sum(-1).float().mean())
        metrics["timing/gen_baseline"] = time.perf_counter() - start
        return batch
