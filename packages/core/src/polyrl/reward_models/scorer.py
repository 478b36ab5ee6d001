"""The ``reward_model`` role on the driver: its spec, its start-up checks, and the scorer the trainer calls.

:func:`reward_model_spec` declares the role (:class:`~polyrl.trainer.roles.RoleSpec`): an engine with a value
head (discriminative) or a rollout on the judge model (generative), served by the worker methods
``compute_rm_score`` / ``judge_generate``. :func:`check_reward_model` runs before any worker starts and refuses,
in one line each, what would fail later (no model, a head that does not output one score, an unknown parser or
placeholder...). :class:`RewardModelScorer` turns a generated batch into the reward model's input
(:mod:`polyrl.reward_models.inputs`), dispatches it to the role's worker group and returns one score per sample.
"""

from __future__ import annotations

import logging
import string
from collections.abc import Callable
from typing import Any

from tensordict import TensorDict

from polyrl.errors import ConfigError
from polyrl.reward_models.inputs import INPUT_FORMATS, RewardModelInputs, same_tokenizer
from polyrl.rewards.combine import ComponentScores
from polyrl.trainer.roles import RoleSpec

log = logging.getLogger("polyrl.rewards")

KINDS = ("discriminative", "generative")
#: Placeholders a judge template may use.
JUDGE_FIELDS = ("prompt", "response", "ground_truth", "data_source")


def reward_model_spec(config: Any) -> RoleSpec:
    """The built-in ``reward_model`` role for ``config.reward_model``."""
    generative = str(config.reward_model.kind) == "generative"
    return RoleSpec(
        name="reward_model", section="reward_model", builds="rollout" if generative else "engine",
        model_type="value", methods=("judge_generate",) if generative else ("compute_rm_score",),
        offload_when_shared=str(config.reward_model.offload) != "never",
    )


def _choice(value: Any, choices: tuple[str, ...], key: str) -> str:
    if value not in choices:
        raise ConfigError(f"{key}={value!r}: choose one of {', '.join(choices)}")
    return str(value)


def check_reward_model(config: Any, plugins: Any, policy_tokenizer: Any = None) -> Any:
    """Check ``reward_model`` before any worker starts; returns the reward model's tokenizer.

    Each problem is one :class:`ConfigError` naming the key: no model path, a model whose head does not output
    one score (or has no head), an engine / rollout / judge parser nobody registered, a judge template with an
    unknown placeholder, a re-templated input without a chat template.
    """
    from transformers import AutoConfig, AutoTokenizer

    from polyrl.models.paths import check_model_paths
    from polyrl.models.reward_heads import find_reward_head

    rm = config.reward_model
    kind = _choice(rm.kind, KINDS, "reward_model.kind")
    _choice(rm.input_format, INPUT_FORMATS, "reward_model.input_format")
    _choice(rm.truncation, ("right", "left"), "reward_model.truncation")
    _choice(rm.offload, ("auto", "never"), "reward_model.offload")
    if not rm.model.path:
        raise ConfigError("reward_model.enable=true needs reward_model.model.path (the reward model's checkpoint)")
    check_model_paths(rm.model, "reward_model.model")
    path = rm.model.path
    if kind == "discriminative":
        _registered(plugins, "engine", rm.engine, "reward_model.engine")
        hf_config = AutoConfig.from_pretrained(path, trust_remote_code=rm.model.trust_remote_code)
        head = find_reward_head(path, hf_config)
        arch = head.architecture or "the checkpoint"
        if head.kind == "none":
            raise ConfigError(
                f"reward_model.model.path={path}: {arch} has no score head; a discriminative reward model is a "
                "sequence classifier (XForSequenceClassification, num_labels=1) or a causal LM saved with a value "
                "head (TRL's v_head, OpenRLHF's value_head). For an LLM judge set reward_model.kind=generative")
        if head.kind == "pooled":
            raise ConfigError(
                f"reward_model.model.path={path}: {arch} pools its own way (no `score` layer on the last token, "
                "e.g. a BERT-style encoder); polyrl scores decoder reward models at the sequence's last token")
        if head.outputs != 1:
            raise ConfigError(
                f"reward_model.model.path={path}: the {head.kind} head of {arch} outputs {head.outputs} scores per "
                "token; a reward model must output one score (num_labels=1)")
    else:
        _registered(plugins, "rollout", rm.rollout.name, "reward_model.rollout.name")
        _registered(plugins, "judge_parser", rm.judge.parser, "reward_model.judge.parser")
        used = {f for _, f, _, _ in string.Formatter().parse(rm.judge.template) if f is not None}
        unknown = sorted(used - set(JUDGE_FIELDS))
        if unknown:
            raise ConfigError(f"reward_model.judge.template: unknown placeholder {{{unknown[0]}}}; a judge template "
                              f"may use {', '.join('{' + f + '}' for f in JUDGE_FIELDS)} (write {{{{ }}}} for a brace)")
        if "response" not in used:
            raise ConfigError("reward_model.judge.template has no {response}: the judge would never see the answer")
    tokenizer = AutoTokenizer.from_pretrained(rm.model.tokenizer_path or path)
    if policy_tokenizer is not None and _retemplates(rm, policy_tokenizer, tokenizer) \
            and not getattr(tokenizer, "chat_template", None):
        raise ConfigError(
            f"reward_model.model: the tokenizer of {rm.model.tokenizer_path or path} differs from the policy's and has "
            "no chat template to render a sample with; give it one (reward_model.model.tokenizer_path) or set "
            "reward_model.input_format=tokens if it reads the policy's tokens")
    return tokenizer


def _registered(plugins: Any, kind: str, name: str, key: str) -> None:
    try:
        plugins.entry(kind, name)
    except LookupError as exc:
        raise ConfigError(f"{key}: {exc}") from None


def _retemplates(rm: Any, policy_tokenizer: Any, rm_tokenizer: Any) -> bool:
    if rm.kind == "generative" or rm.input_format == "chat":
        return True
    if rm.input_format == "tokens":
        return False
    return not same_tokenizer(policy_tokenizer, rm_tokenizer)


class RewardModelScorer:
    """Scores batches with the run's reward model: ``scorer(batch) -> ComponentScores``.

    ``group`` returns the ``reward_model`` role's worker group (the groups start after the trainer is built).
    Rows are padded to a multiple of the group's data-parallel size; generative verdicts the parser finds no
    score in get ``reward_model.judge.fallback_score`` and count as failures (one warning names the parser).
    """

    def __init__(self, config: Any, *, policy_tokenizer: Any, rm_tokenizer: Any, plugins: Any,
                 group: Callable[[], Any]) -> None:
        rm = config.reward_model
        self.config = rm
        self.name = str(rm.name)
        self.generative = rm.kind == "generative"
        self.group = group
        max_length = rm.max_length or (config.data.max_prompt_length + config.data.max_response_length)
        if self.generative and not rm.max_length:
            max_length = rm.rollout.prompt_length
        self.retemplate = _retemplates(rm, policy_tokenizer, rm_tokenizer)
        self.inputs = RewardModelInputs(policy_tokenizer=policy_tokenizer, rm_tokenizer=rm_tokenizer,
                                        retemplate=self.retemplate, max_length=max_length, truncation=rm.truncation)
        self.parse = plugins.get("judge_parser", rm.judge.parser) if self.generative else None
        self._warned = False

    def __call__(self, batch: TensorDict) -> ComponentScores:
        group = self.group()
        if group is None:
            raise RuntimeError("the reward_model role has no worker group: the trainer's groups are not started")
        if self.generative:
            return self._judge(batch, group)
        rm_batch = self.inputs.batch(batch)
        n = rm_batch.batch_size[0]
        padded = _pad_rows(rm_batch, group.dp_size("compute_rm_score"))
        scores = group.dispatch("compute_rm_score", padded)["rm_scores"][:n]
        return ComponentScores([float(s) for s in scores.tolist()])

    def _judge(self, batch: TensorDict, group: Any) -> ComponentScores:
        judge = self.config.judge
        prompts = self.inputs.judge_prompts(batch, judge.template, chat_template=judge.chat_template)
        n = len(prompts)
        parts = group.dp_size("judge_generate")
        padded = prompts + [prompts[-1]] * ((-n) % parts)
        texts = list(group.dispatch("judge_generate", padded))[:n]
        scores: list[float] = []
        failed: list[int] = []
        assert self.parse is not None
        for i, text in enumerate(texts):
            try:
                value = self.parse(text)
            except Exception:  # a parser must not raise; a plugin's that does fails only this sample
                log.debug("judge parser %s raised", self.config.judge.parser, exc_info=True)
                value = None
            if value is None:
                failed.append(i)
                value = judge.fallback_score
            scores.append(float(value))
        failures = len(failed)
        if failures and not self._warned:
            self._warned = True
            shown = texts[failed[0]][-200:]
            log.warning("judge parser '%s' found no score in %d of %d verdicts of reward model '%s' (e.g. %r); they get "
                        "reward_model.judge.fallback_score=%s and count in reward/%s/failures (shown once)",
                        judge.parser, failures, n, self.name, shown, judge.fallback_score, self.name)
        return ComponentScores(scores, failures)


def _pad_rows(batch: TensorDict, parts: int) -> TensorDict:
    """``batch`` followed by copies of its last row up to a multiple of ``parts`` rows."""
    extra = (-batch.batch_size[0]) % max(1, parts)
    if not extra:
        return batch
    import torch

    index = torch.cat([torch.arange(batch.batch_size[0]), torch.full((extra,), batch.batch_size[0] - 1)])
    return batch[index]
