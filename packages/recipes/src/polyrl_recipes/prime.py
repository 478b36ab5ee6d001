"""PRIME (Cui et al., "Process Reinforcement through Implicit Rewards", arXiv 2502.01456).

An *implicit process reward model* (PRM) is a causal LM trained only from outcome labels: its token rewards
are ``r_t = beta * (log pi_prm(y_t) - log pi_ref(y_t))``, and it is trained with the cross-entropy of
``sigmoid(beta * sum_t (log pi_prm - log pi_ref))`` against each response's outcome label, online, on the
policy's own samples. The policy is trained with RLOO on the PRM's token rewards and on the outcome reward,
summed (``reward_dpo_coef``, ``reward_gt_coef``), then whitened.

Numerics follow verl's recipe (``recipe/prime``: ``prime_core_algos.py``, ``prime_dp_rm.py``), each written
here from its formula and tested against it (docs/recipes.md, "PRIME"): the PRM is updated on the batch before
it scores it (``update: before``), the implicit reward of a response's last token is left at 0 (the outcome
reward sits there), rewards are divided by the batch's largest absolute reward-to-go (``prime_norm:
batch_norm``), RLOO takes a sample's mean token reward against its group's. Departures: the normaliser is the
whole batch's (verl's is each data-parallel shard's), the PRM's reference is the run's reference policy (so the
PRM starts from the actor's model, as in the paper; verl allows another ``ref_path``), and the accuracy filter
of verl's trainer is the core's dynamic sampling (``algorithm.filter_groups``).
"""

from __future__ import annotations

from typing import Any

import torch
from tensordict import TensorDict

from polyrl import batch as batch_ops
from polyrl.algorithms import agg_loss, masked_whiten
from polyrl.algorithms.advantages import clean_padding, group_ids
from polyrl.algorithms.checks import cfg_get, check_finite, check_same_shape
from polyrl.algorithms.torch_functional import masked_select_zero
from polyrl.errors import ConfigError
from polyrl.protocols import LossScale
from polyrl.trainer.role_worker import Worker
from polyrl.trainer.roles import RoleSpec
from polyrl.trainer.updates import mini_batch_rows, run_update_epochs
from polyrl_recipes.base import RecipeTrainer
from polyrl_recipes.config import PRIMEConfig

__all__ = ["PRIMETrainer", "PRIMEWorker", "compute_prime_advantage", "implicit_token_rewards", "masked_rloo",
           "prime_norm", "prm_cross_entropy", "prm_pairwise_accuracy"]

UPDATES = ("before", "none")
NORMS = ("batch_norm", "none")


def implicit_token_rewards(q: torch.Tensor, response_mask: torch.Tensor, beta: float) -> torch.Tensor:
    """``beta * q`` on every response token but the last (verl's ``prime_granularity: token``), 0 elsewhere.

    ``q`` is ``log pi_prm - log pi_ref`` per token ``[B, R]``; the last token of each response keeps no implicit
    reward (the outcome reward sits there)."""
    valid = response_mask != 0
    lengths = valid.long().sum(-1)
    last = torch.arange(q.shape[1], device=q.device)[None, :] >= (lengths - 1).clamp(min=0)[:, None]
    return masked_select_zero(beta * q, valid & ~last)


def prime_norm(token_rewards: torch.Tensor) -> torch.Tensor:
    """``token_rewards / (max |reward-to-go| over the batch + 1e-6)`` (verl's ``prime_norm: batch_norm``)."""
    to_go = token_rewards.flip(-1).cumsum(-1).flip(-1)
    return token_rewards / (to_go.abs().max() + 1e-6)


def masked_rloo(rewards: torch.Tensor, mask: torch.Tensor, gid: torch.Tensor) -> torch.Tensor:
    """verl's PRIME RLOO on token rewards: within a group of ``n``, each masked entry ``r`` becomes
    ``r * n / (n - 1) - sum_j mean_j / (n - 1)``, ``mean_j`` the mean of sample ``j``'s masked entries (0 outside
    ``mask``). A sample alone in its group keeps its rewards."""
    mask = mask.bool()
    r = masked_select_zero(rewards.double(), mask)
    count = mask.sum(-1).double()
    means = torch.where(count > 0, r.sum(-1) / count.clamp(min=1), torch.zeros_like(count))
    n_groups = int(gid.max()) + 1
    sizes = torch.bincount(gid, minlength=n_groups).double()[gid]
    group_sum = torch.zeros(n_groups, dtype=torch.float64, device=r.device).index_add_(0, gid, means)[gid]
    n = sizes[:, None]
    out = torch.where(n > 1, r * n / (n - 1).clamp(min=1) - (group_sum / (sizes - 1).clamp(min=1))[:, None], r)
    return masked_select_zero(out, mask)


@torch.no_grad()
def compute_prime_advantage(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Any = None,
                            config: Any = None, prm_scores: torch.Tensor | None = None,
                            reward_dpo_coef: float | None = None, reward_gt_coef: float | None = None,
                            **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """PRIME's advantage: ``whiten(reward-to-go of reward_dpo_coef * RLOO(prm_scores) + reward_gt_coef *
    RLOO(outcome))``; returns ``(advantages, reward-to-go)``.

    ``prm_scores`` ``[B, R]`` are the implicit PRM's token rewards (the trainer adds them to the batch); the
    outcome is each response's sequence reward (the sum of ``token_level_rewards``) on its last token. RLOO is
    taken within the groups of ``index`` (:func:`masked_rloo`). Coefficients come as keywords or from ``config``
    / its ``extra`` (``trainer.prime`` puts them there); verl's defaults are 5 and 5.
    """
    check_same_shape(token_level_rewards=token_level_rewards, response_mask=response_mask, prm_scores=prm_scores)
    check_finite("token_level_rewards", token_level_rewards, response_mask)
    extra = cfg_get(config, "extra", None)
    dpo = float(reward_dpo_coef if reward_dpo_coef is not None else cfg_get(extra, "reward_dpo_coef", 5.0))
    gt = float(reward_gt_coef if reward_gt_coef is not None else cfg_get(extra, "reward_gt_coef", 5.0))
    gid = group_ids(index, token_level_rewards.shape[0], token_level_rewards.device)
    valid = response_mask != 0
    total = torch.zeros(token_level_rewards.shape, dtype=torch.float64, device=token_level_rewards.device)
    if prm_scores is not None and dpo != 0.0:
        check_finite("prm_scores", prm_scores, response_mask)
        total = total + dpo * masked_rloo(clean_padding(prm_scores, response_mask), valid, gid)
    if gt != 0.0:
        scores = clean_padding(token_level_rewards, response_mask).sum(-1).double()
        lengths = valid.long().sum(-1)
        last = torch.zeros_like(valid)
        rows = torch.nonzero(lengths > 0).squeeze(-1)
        last[rows, lengths[rows] - 1] = True
        outcome = torch.zeros_like(total)
        outcome[rows, lengths[rows] - 1] = scores[rows]
        total = total + gt * masked_rloo(outcome, last, gid)
    mask = response_mask.to(torch.float64)
    returns = (total * mask).flip(-1).cumsum(-1).flip(-1) * mask
    advantages = masked_whiten(returns, mask)
    dtype = token_level_rewards.dtype
    return advantages.to(dtype), returns.to(dtype)


def prm_cross_entropy(q: torch.Tensor, labels: torch.Tensor, response_mask: torch.Tensor, beta: float,
                      loss_scale: LossScale | None = None) -> torch.Tensor:
    """PRIME's PRM loss (verl's ``compute_ce_dpo_loss_rm``): the binary cross-entropy of
    ``sigmoid(beta * sum_t q_t)`` against each response's outcome label in ``[0, 1]``, averaged over responses
    (over the mini-batch's global count with ``loss_scale``)."""
    mask = response_mask.to(q.dtype)
    valid = mask != 0
    logit = beta * masked_select_zero(q, valid).sum(-1)
    per_seq = torch.nn.functional.binary_cross_entropy_with_logits(logit, labels.to(q.dtype), reduction="none")
    first = valid & (valid.long().cumsum(-1) == 1)
    loss_mat = torch.where(first, per_seq.unsqueeze(-1).expand_as(q), torch.zeros_like(q))
    return agg_loss(loss_mat, mask, "seq-mean-token-sum", loss_scale=loss_scale)


def prm_pairwise_accuracy(q: torch.Tensor, labels: torch.Tensor, response_mask: torch.Tensor,
                          gid: torch.Tensor) -> float:
    """verl's ``compute_dpo_accuracy``: within each group, how often the PRM's summed score orders two responses
    as their labels do, weighted by the labels' difference (1/2 for a group whose labels are all equal)."""
    scores = masked_select_zero(q, response_mask != 0).sum(-1)
    accs = []
    for g in torch.unique(gid):
        rows = torch.nonzero(gid == g).squeeze(-1)
        s, a = scores[rows], labels[rows].to(scores.dtype)
        upper = torch.triu(torch.ones(len(rows), len(rows), dtype=torch.bool), diagonal=1)
        ds, da = (s[:, None] - s[None, :])[upper], (a[:, None] - a[None, :])[upper]
        if float(da.abs().sum()) == 0:
            accs.append(0.5)
        else:
            accs.append(float((((ds > 0) == (da > 0)).to(s.dtype) * da.abs()).sum() / da.abs().sum()))
    return float(sum(accs) / max(1, len(accs)))


class PRIMEWorker(Worker):
    """The role worker with PRIME's calls: the reference log-probs at temperature 1 (on the reference's
    workers), and the implicit PRM's update and scores (on the ``prm`` role's)."""

    dispatch_roles = {**Worker.dispatch_roles, "compute_prm_ref_log_prob": "ref"}

    def compute_prm_ref_log_prob(self, batch: TensorDict) -> TensorDict:
        """``log pi_ref`` of the response tokens at temperature 1 (the implicit reward's reference): a separate
        reference engine, or the LoRA actor with its adapter disabled."""
        engine = self.ref if self.ref is not None else self.actor
        if engine is None:
            raise RuntimeError(f"{self!r} holds neither the reference nor the actor")
        return engine.infer_batch(batch, temperature=1.0, disable_adapter=self.ref is None).select("log_probs")

    def _prime(self) -> Any:
        return self.config.trainer.plugin_config

    def update_prm(self, batch: TensorDict) -> dict[str, float]:
        """One pass of PRM optimizer steps over this rank's shard (mini-batches of ``trainer.prime.mini_batch_size``
        prompts, or the actor's): the cross-entropy of the implicit outcome score against ``prm_labels``."""
        opts = self._prime()
        engine = self.role_engine("prm")
        beta = opts.beta_train

        def loss_fn(out: Any, mb: TensorDict, scale: LossScale) -> tuple[torch.Tensor, dict[str, float]]:
            q = out["log_probs"] - mb["prm_ref_log_prob"]
            loss = prm_cross_entropy(q, mb["prm_labels"], mb["response_mask"], beta, loss_scale=scale)
            # the metric is this micro-batch's own mean (the loss is its share of the mini-batch's)
            return loss, {"prm/loss": float(prm_cross_entropy(q.detach(), mb["prm_labels"], mb["response_mask"], beta))}

        prompts = opts.mini_batch_size or self.config.actor.ppo_mini_batch_size
        rows = mini_batch_rows(prompts, self.config.rollout.n, engine.dp_size)
        with self.using_role("prm"):
            metrics = run_update_epochs(engine, batch, rows, 1, loss_fn, shuffle=False, seed=engine.dp_rank)
        return {k.replace("actor/", "prm/"): v for k, v in metrics.items()}

    def compute_prm_scores(self, batch: TensorDict) -> TensorDict:
        """``q = log pi_prm - log pi_ref`` of every response token (0 on padding), at temperature 1."""
        with self.using_role("prm"):
            out = self.role_engine("prm").infer_batch(batch, temperature=1.0)
        q = masked_select_zero(out["log_probs"] - batch["prm_ref_log_prob"], batch["response_mask"] != 0)
        return TensorDict({"prm_q": q}, batch_size=batch.batch_size)


class PRIMETrainer(RecipeTrainer):
    """``trainer.name=prime``: the ``prime`` estimator with an implicit PRM (role ``prm``, its block
    ``trainer.prime.prm``) trained each step on the batch's outcome labels (``trainer.prime``, :class:`PRIMEConfig`).

    Outcome labels are the reward function's ``acc`` (its ``score`` when it returns none), in ``[0, 1]``; every
    training row needs ``reward_model.ground_truth`` to be verified against.
    """

    recipe = "prime"
    adv_estimator = "prime"
    options_cls = PRIMEConfig
    worker_cls = PRIMEWorker
    provides_fields = frozenset({"prm_scores"})

    def configure(self, config: Any) -> None:
        super().configure(config)
        o = self.options
        if o.update not in UPDATES:
            raise ConfigError(f"trainer.prime.update={o.update!r}: choose one of {', '.join(UPDATES)}")
        if o.prime_norm not in NORMS:
            raise ConfigError(f"trainer.prime.prime_norm={o.prime_norm!r}: choose one of {', '.join(NORMS)}")
        if o.beta_train <= 0:
            raise ConfigError(f"trainer.prime.beta_train={o.beta_train}: must be positive")
        if o.mini_batch_size < 0:
            raise ConfigError(f"trainer.prime.mini_batch_size={o.mini_batch_size}: must be 0 (the actor's) or more")
        actor_path = config.actor.model.path
        if str(o.prm.model.path) in ("???", "", "None"):
            o.prm.model.path = actor_path
            o.prm.model.tokenizer_path = o.prm.model.tokenizer_path or config.actor.model.tokenizer_path
        elif o.prm.model.path != actor_path:
            raise ConfigError(f"trainer.prime.prm.model.path={o.prm.model.path}: the implicit PRM's reference is the "
                              f"run's reference policy, the actor's starting model ({actor_path}); the PRM must start "
                              "from it too (leave trainer.prime.prm.model.path unset)")
        if str(config.ref.enable).lower() == "false":
            raise ConfigError("ref.enable=false: PRIME's implicit rewards are log-ratios against the reference policy; "
                              "leave ref.enable at auto or true")
        config.ref.enable = "true"
        config.algorithm.extra = {**dict(config.algorithm.extra), "reward_dpo_coef": o.reward_dpo_coef,
                                  "reward_gt_coef": o.reward_gt_coef}

    def __init__(self, config: Any, *, manifest: Any = None, plugins: Any = None) -> None:
        super().__init__(config, manifest=manifest, plugins=plugins)
        self._check_outcome_labels()
        self._check_engine_name("trainer.prime.prm", self.options.prm.engine)

    def _check_outcome_labels(self) -> None:
        """Every training row carries ``reward_model.ground_truth`` (the PRM learns from verified outcomes)."""
        for i in range(len(self.train_set)):
            row = self.train_set[i]
            if (row.get("reward_model") or {}).get("ground_truth") is None:
                files = ", ".join(map(str, self.config.data.train_files))
                raise ConfigError(f"data.train_files ({files}), row {i}: no reward_model.ground_truth; "
                                  "trainer.name=prime trains its implicit PRM from outcome labels verified against "
                                  "it, so every training row needs one")

    def extra_roles(self) -> list[RoleSpec]:
        return [*super().extra_roles(), RoleSpec(
            name="prm", section="trainer.plugin_config.prm", builds="engine", model_type="causal_lm",
            methods=("update_prm", "compute_prm_scores"), trains=True)]

    def before_advantage(self, batch: TensorDict, metrics: dict[str, float]) -> TensorDict:
        o = self.options
        labels = batch["_acc"] if "_acc" in batch.keys() else batch["token_level_scores"].sum(-1)
        labels = labels.float()
        if bool(((labels < 0) | (labels > 1)).any()):
            raise ValueError("trainer.name=prime: the outcome labels (the reward function's 'acc', or its score) must "
                             f"lie in [0, 1]; got {labels.min():.3g}..{labels.max():.3g}")
        batch["prm_labels"] = labels
        if self.config.rollout.temperature == 1.0 and "ref_log_prob" in batch.keys():
            batch["prm_ref_log_prob"] = batch["ref_log_prob"]  # the same numbers at temperature 1
        else:
            batch["prm_ref_log_prob"] = self.group("ref").dispatch("compute_prm_ref_log_prob",
                                                                   batch_ops.engine_fields(batch))["log_probs"]
        prm = self.group("prm")
        if o.update == "before":
            metrics.update(_mean_of(prm.dispatch("update_prm", batch_ops.engine_fields(batch))))
        q = prm.dispatch("compute_prm_scores", batch_ops.engine_fields(batch))["prm_q"]
        rewards = implicit_token_rewards(q, batch["response_mask"], o.beta_train)
        if o.prime_norm == "batch_norm":
            rewards = prime_norm(rewards)
        batch["prm_scores"] = rewards
        gid = group_ids(batch_ops.non_tensor(batch, "uid"), q.shape[0])
        metrics["prm/reward"] = float(rewards.sum(-1).mean())
        metrics["prm/raw_reward"] = float(q.sum(-1).mean())
        metrics["prm/pairwise_acc"] = prm_pairwise_accuracy(q, labels, batch["response_mask"], gid)
        return batch


def _mean_of(results: Any) -> dict[str, float]:
    if isinstance(results, dict):
        return {k: float(v) for k, v in results.items()}
    keys = set().union(*results) if results else set()
    return {k: float(sum(r[k] for r in results if k in r) / sum(1 for r in results if k in r)) for k in keys}
