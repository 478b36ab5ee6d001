"""On-policy distillation: the student (the actor) samples, a frozen teacher scores every sampled token, and the
student learns to match the teacher on its own samples (Agarwal et al., "On-Policy Distillation of Language
Models", arXiv 2306.13649; Thinking Machines, "On-Policy Distillation", 2025; verl's ``distillation`` losses).

The teacher is a worker role (``teacher``, :class:`polyrl.trainer.roles.RoleSpec`; any engine, its own pool or
shared, ``trainer.placement``) that returns, per student token, its log-prob ``log p_T(y_t)`` and, for
``forward_kl_topk``, its top-k tokens (a forward product). Losses, per response token, with verl's names:

- reverse KL ``KL(pi_S || p_T)`` estimated on the sampled token (``loss_mode`` ``k1``/``kl``: ``log pi_S - log
  p_T``; ``k2``/``mse``, ``k3``/``low_var_kl``, ``abs``), either backpropagated directly (``use_policy_gradient:
  false``, verl's default with ``k3``) or, the on-policy distillation objective, as the advantage ``-(log pi_S -
  log p_T)`` of the run's policy loss (``use_policy_gradient: true`` with ``k1``);
- forward KL on the teacher's top-k tokens, ``sum_k p_T(k) (log p_T(k) - log pi_S(k))`` (``forward_kl_topk``;
  the student's log-probs at those ids come from its training forward pass, a forward product), clamped at 0 as
  verl does (the truncated sums need not be a divergence);

and, with ``use_task_rewards``, ``policy loss on the run's reward + coef * distillation loss`` (a GRPO/PPO reward
mixed in). A teacher whose tokenizer holds other tokens than the student's is refused before any worker starts;
one that holds the same tokens under other ids is used through an exact id map (docs/recipes.md, "On-policy
distillation").
"""

from __future__ import annotations

from typing import Any

import torch
from tensordict import TensorDict

from polyrl import batch as batch_ops
from polyrl.algorithms import agg_loss, get_policy_loss_fn, kl_penalty, masked_mean
from polyrl.algorithms.torch_functional import masked_select_zero
from polyrl.errors import ConfigError
from polyrl.protocols import ForwardProducts, LossScale
from polyrl.trainer.losses import VerlActorConfigView, loss_metric, make_actor_loss
from polyrl.trainer.role_worker import Worker
from polyrl.trainer.roles import RoleSpec
from polyrl_recipes.base import RecipeTrainer
from polyrl_recipes.config import DistillConfig

__all__ = ["DistillTrainer", "DistillWorker", "VocabularyMap", "distillation_loss", "forward_kl_topk",
           "make_distill_loss", "reverse_kl", "vocabulary_map"]

REVERSE_KL_MODES = ("k1", "kl", "k2", "mse", "k3", "low_var_kl", "abs")
LOSS_MODES = (*REVERSE_KL_MODES, "forward_kl_topk")
#: the batch fields the teacher adds (student token ids throughout)
TEACHER_FIELDS = ("teacher_log_probs", "teacher_top_k_log_probs", "teacher_top_k_ids")


# ---------------------------------------------------------------------------- tokenizers


class VocabularyMap:
    """Student token ids -> teacher token ids and back, when the two tokenizers hold the same tokens.

    Built from the tokenizers' vocabularies (token string -> id), which must hold the same tokens (ids may
    differ): a token only one side has would make the teacher score, or rank, text the student cannot write.
    Model rows past a tokenizer (embedding padding) map to -1. ``identity`` when the ids agree.
    """

    def __init__(self, student_vocab: dict[str, int], teacher_vocab: dict[str, int]) -> None:
        missing = [tok for tok in student_vocab if tok not in teacher_vocab]
        extra = [tok for tok in teacher_vocab if tok not in student_vocab]
        if missing:
            raise ValueError(f"{len(missing)} of the student's {len(student_vocab)} tokens are not in the teacher's "
                             f"vocabulary (e.g. {missing[:3]})")
        if extra:
            raise ValueError(f"the teacher's vocabulary has {len(extra)} tokens the student's lacks (e.g. {extra[:3]})")
        size_s = max(student_vocab.values()) + 1
        size_t = max(teacher_vocab.values()) + 1
        self.to_teacher = torch.full((size_s,), -1, dtype=torch.long)
        self.to_student = torch.full((size_t,), -1, dtype=torch.long)
        for tok, i in student_vocab.items():
            self.to_teacher[i] = teacher_vocab[tok]
            self.to_student[teacher_vocab[tok]] = i
        self.identity = all(student_vocab[t] == teacher_vocab[t] for t in student_vocab)

    def teacher_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Student ids -> teacher ids (ids past the student's tokenizer, e.g. padding rows, stay as they are)."""
        if self.identity:
            return ids
        inside = (ids >= 0) & (ids < self.to_teacher.numel())
        mapped = self.to_teacher[ids.clamp(0, self.to_teacher.numel() - 1)]
        return torch.where(inside & (mapped >= 0), mapped, ids)

    def student_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Teacher ids -> student ids; -1 for a row of the teacher's model past its tokenizer (embedding padding,
        which the student's model may not have)."""
        inside = (ids >= 0) & (ids < self.to_student.numel())
        return torch.where(inside, self.to_student[ids.clamp(0, self.to_student.numel() - 1)], torch.full_like(ids, -1))


def vocabulary_map(student_tokenizer: Any, teacher_tokenizer: Any, key: str) -> VocabularyMap:
    """The :class:`VocabularyMap` of two tokenizers, or a :class:`ConfigError` naming ``key`` when the teacher
    lacks some of the student's tokens."""
    try:
        return VocabularyMap(dict(student_tokenizer.get_vocab()), dict(teacher_tokenizer.get_vocab()))
    except ValueError as exc:
        raise ConfigError(f"{key}: the teacher's tokenizer does not match the student's: {exc}. On-policy "
                          "distillation scores the student's own tokens with the teacher, so both need the same "
                          "vocabulary (the same tokens; their ids may differ); use a teacher of the student's "
                          "tokenizer family") from None


# ---------------------------------------------------------------------------- losses


def reverse_kl(student_log_probs: torch.Tensor, teacher_log_probs: torch.Tensor, mode: str = "k1") -> torch.Tensor:
    """Per-token ``KL(student || teacher)`` estimated on the sampled token (``[B, R]``), verl's estimators:
    ``k1`` ``log s - log t``, ``k2`` ``(log s - log t)^2 / 2``, ``k3`` ``exp(log t - log s) - (log t - log s) - 1``
    (clamped like the reference KL), ``abs`` ``|log s - log t|``."""
    return kl_penalty(student_log_probs, teacher_log_probs, mode)


def forward_kl_topk(student_top_k_log_probs: torch.Tensor, teacher_top_k_log_probs: torch.Tensor,
                    log_prob_min_clamp: float | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token ``sum_k p_T(k) (log p_T(k) - log pi_S(k))`` over the teacher's top-k (``[B, R, k]`` inputs, the
    student's log-probs at the teacher's ids), clamped at 0 (verl's ``compute_forward_kl_topk``). Entries with a
    teacher log-prob of ``-inf`` (a teacher token the student does not have) count for nothing. Also returns
    ``student_mass`` / ``teacher_mass``: the probability each puts on those k tokens."""
    t = teacher_top_k_log_probs.float()
    s = student_top_k_log_probs.float()
    present = torch.isfinite(t)
    student_mass = masked_select_zero(s.exp(), present).sum(-1)
    teacher_mass = masked_select_zero(t.exp(), present).sum(-1)
    if log_prob_min_clamp is not None:
        s = s.clamp_min(log_prob_min_clamp)
        t = torch.where(present, t.clamp_min(log_prob_min_clamp), t)
    p = masked_select_zero(t.exp(), present)
    terms = masked_select_zero(p * (masked_select_zero(t, present) - s), present)
    return terms.sum(-1).clamp_min(0.0), {"student_mass": student_mass, "teacher_mass": teacher_mass}


def distillation_loss(out: Any, mb: TensorDict, scale: LossScale, options: DistillConfig, actor_config: Any, *,
                      on_policy: bool) -> tuple[torch.Tensor, dict[str, float]]:
    """The distillation term of a micro-batch: ``out`` is the student's forward (``log_probs``, and
    ``gathered_log_probs`` at the teacher's top-k for ``forward_kl_topk``), ``mb`` carries the teacher's fields."""
    mask = mb["response_mask"]
    valid = mask != 0
    log_prob = out["log_probs"]
    metrics: dict[str, float] = {}
    mode = options.loss_mode
    if mode == "forward_kl_topk":
        per_token, mass = forward_kl_topk(out["gathered_log_probs"], mb["teacher_top_k_log_probs"],
                                          options.log_prob_min_clamp)
        metrics["distill/student_mass"] = float(masked_mean(mass["student_mass"].detach(), mask))
        metrics["distill/teacher_mass"] = float(masked_mean(mass["teacher_mass"].detach(), mask))
    else:
        per_token = reverse_kl(masked_select_zero(log_prob, valid), masked_select_zero(mb["teacher_log_probs"], valid),
                               mode)
    per_token = masked_select_zero(per_token, valid)
    if options.loss_max_clamp is not None:
        per_token = per_token.clamp(-options.loss_max_clamp, options.loss_max_clamp)
    metrics["distill/kl_k1"] = float(masked_mean((log_prob - mb["teacher_log_probs"]).detach(), mask))
    if options.use_policy_gradient and mode != "forward_kl_topk":
        # the negative per-token KL as the advantage of the run's policy loss (Thinking Machines' objective)
        old = log_prob.detach() if on_policy else mb["old_log_probs"]
        fn = get_policy_loss_fn(actor_config.policy_loss.loss_mode)
        info = {"dp_size": scale.dp_size, "batch_num_tokens": scale.batch_num_tokens,
                "global_batch_size": scale.global_batch_size}
        loss, pg = fn(old, log_prob, -per_token.detach(), mask, actor_config.loss_agg_mode,
                      VerlActorConfigView(actor_config, info), loss_scale=scale)
        metrics.update({f"distill/{k.rpartition('/')[2]}": float(v) for k, v in pg.items()})
    else:
        loss = agg_loss(per_token, mask, actor_config.loss_agg_mode, loss_scale=scale)
    metrics["distill/loss"] = loss_metric(loss.detach(), mask, actor_config.loss_agg_mode, scale)
    return loss, metrics


def make_distill_loss(actor_config: Any, options: DistillConfig, *, on_policy: bool) -> Any:
    """The student's loss for ``Engine.train_batch``: :func:`distillation_loss`, plus with ``use_task_rewards`` the
    run's own actor loss (:func:`polyrl.trainer.losses.make_actor_loss`: its policy loss on the task's advantages,
    entropy and KL terms): ``task + coef * distillation``."""
    task_loss = make_actor_loss(actor_config, on_policy=on_policy)

    def loss_fn(out: Any, mb: TensorDict, scale: LossScale) -> tuple[torch.Tensor, dict[str, float]]:
        distill, metrics = distillation_loss(out, mb, scale, options, actor_config, on_policy=on_policy)
        if not options.use_task_rewards:
            return distill, metrics
        task, task_metrics = task_loss(out, mb, scale)
        return task + options.coef * distill, {**task_metrics, **metrics}

    return loss_fn


# ---------------------------------------------------------------------------- worker and trainer


class DistillWorker(Worker):
    """The role worker with the teacher's call and the student's update with the distillation loss."""

    _vocab_map: VocabularyMap | None = None

    def _options(self) -> DistillConfig:
        return self.config.trainer.plugin_config

    def _vocabulary(self) -> VocabularyMap:
        if self._vocab_map is None:
            self._vocab_map = vocabulary_map(self.tokenizer, self.role_tokenizers["teacher"],
                                             "trainer.distill.teacher.model.path")
        return self._vocab_map

    def compute_teacher_log_prob(self, batch: TensorDict) -> TensorDict:
        """The teacher's log-prob of every student token (``teacher_log_probs``) and, for ``forward_kl_topk``, its
        top-k log-probs and (student) ids, at the rollout temperature; token ids mapped both ways when the
        tokenizers number tokens differently."""
        opts = self._options()
        vocab = self._vocabulary()
        teacher_batch = batch.select("input_ids", "attention_mask", "position_ids", "responses", "response_mask")
        if not vocab.identity:
            teacher_batch["input_ids"] = vocab.teacher_ids(teacher_batch["input_ids"])
            teacher_batch["responses"] = vocab.teacher_ids(teacher_batch["responses"])
        top_k = opts.topk if opts.loss_mode == "forward_kl_topk" else 0
        products = {"products": ForwardProducts(top_k=top_k)} if top_k else {}
        with self.using_role("teacher"):
            out = self.role_engine("teacher").infer_batch(teacher_batch, temperature=self.config.rollout.temperature,
                                                          **products)
        result = TensorDict({"teacher_log_probs": out["log_probs"]}, batch_size=batch.batch_size)
        if top_k:
            ids = vocab.student_ids(out["top_k_ids"])
            known = ids >= 0
            result["teacher_top_k_ids"] = torch.where(known, ids, torch.zeros_like(ids))
            result["teacher_top_k_log_probs"] = torch.where(known, out["top_k_log_probs"],
                                                            torch.full_like(out["top_k_log_probs"], float("-inf")))
        return result

    def update_actor(self, batch: TensorDict) -> dict[str, float]:
        """The PPO update whose loss is the distillation loss (plus the task's policy loss with
        ``use_task_rewards``); ``forward_kl_topk`` asks the student's forward pass for its log-probs at the
        teacher's top-k ids (a forward product)."""
        cfg = self.config.actor
        opts = self._options()
        loss_fn = make_distill_loss(cfg, opts, on_policy=self.update_is_on_policy(batch))
        products = ForwardProducts(gather_ids="teacher_top_k_ids") if opts.loss_mode == "forward_kl_topk" else None
        return self.run_update_epochs(self.actor, batch, loss_fn, cfg, shuffle=cfg.shuffle,
                                      temperature=self.config.rollout.temperature, products=products)


class DistillTrainer(RecipeTrainer):
    """``trainer.name=distill``: on-policy distillation from ``trainer.distill.teacher`` (``trainer.distill``,
    :class:`DistillConfig`), with the run's own estimator and policy loss for the task reward."""

    recipe = "distill"
    options_cls = DistillConfig
    worker_cls = DistillWorker

    def configure(self, config: Any) -> None:
        super().configure(config)
        o = self.options
        if o.loss_mode not in LOSS_MODES:
            raise ConfigError(f"trainer.distill.loss_mode={o.loss_mode!r}: choose one of {', '.join(LOSS_MODES)}")
        if o.loss_mode == "forward_kl_topk" and o.topk < 1:
            raise ConfigError(f"trainer.distill.topk={o.topk}: forward_kl_topk needs at least 1 token")
        if o.coef < 0:
            raise ConfigError(f"trainer.distill.coef={o.coef}: must be 0 or more")
        if o.use_policy_gradient and o.loss_mode == "forward_kl_topk":
            raise ConfigError("trainer.distill.use_policy_gradient=true: forward_kl_topk is a supervised loss over the "
                              "teacher's top-k; use a reverse-KL loss_mode (k1) for the policy-gradient objective")
        if str(o.teacher.model.path) in ("", "???", "None"):
            raise ConfigError("trainer.distill.teacher.model.path is not set: give the teacher's model folder")

    def __init__(self, config: Any, *, manifest: Any = None, plugins: Any = None) -> None:
        super().__init__(config, manifest=manifest, plugins=plugins)
        o = self.options
        self._check_engine_name("trainer.distill.teacher", o.teacher.engine)
        if o.loss_mode == "forward_kl_topk":
            self.check_forward_products(ForwardProducts(top_k=o.topk), engine=o.teacher.engine,
                                        key="trainer.distill.teacher", needed_by="trainer.distill.loss_mode=forward_kl_topk")
            self.check_forward_products(ForwardProducts(gather_ids="teacher_top_k_ids"), engine=config.actor.engine,
                                        key="actor", needed_by="trainer.distill.loss_mode=forward_kl_topk")
        self._check_teacher_tokenizer()

    def _check_teacher_tokenizer(self) -> None:
        """Before any worker starts: the teacher's tokenizer holds every student token (ids may differ)."""
        from transformers import AutoTokenizer

        from polyrl.models.paths import check_model_paths

        teacher = self.options.teacher.model
        check_model_paths(teacher, "trainer.distill.teacher.model")
        tokenizer = AutoTokenizer.from_pretrained(teacher.tokenizer_path or teacher.path,
                                                  trust_remote_code=teacher.trust_remote_code)
        vocabulary_map(self.tokenizer, tokenizer, "trainer.distill.teacher.model.path")

    def extra_roles(self) -> list[RoleSpec]:
        return [*super().extra_roles(), RoleSpec(
            name="teacher", section="trainer.plugin_config.teacher", builds="engine", model_type="causal_lm",
            methods=("compute_teacher_log_prob",))]

    def before_advantage(self, batch: TensorDict, metrics: dict[str, float]) -> TensorDict:
        teacher = self.group("teacher").dispatch("compute_teacher_log_prob", batch_ops.engine_fields(batch))
        for key in TEACHER_FIELDS:
            if key in teacher.keys():
                batch[key] = teacher[key]
        mask = batch["response_mask"]
        metrics["distill/teacher_log_prob"] = float(masked_mean(batch["teacher_log_probs"], mask))
        student = next((batch[k] for k in ("old_log_probs", "rollout_log_probs") if k in batch.keys()), None)
        if student is not None:  # the reverse KL on the sampled tokens, before this step's update
            metrics["distill/reverse_kl"] = float(masked_mean(student - batch["teacher_log_probs"], mask))
        return batch
