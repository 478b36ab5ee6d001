"""``reward.combine``: a sample's score from its reward components (the reward function and reward models).

Components are named: ``rule`` is the reward function (through the reward manager), a reward model is
``reward_model.name`` (``rm``). :class:`RewardComposer` scores each sample with the components its data source's
rule uses, combines them (weighted sum, rule-gated, or a user function; see :class:`~polyrl.rewards.config.
CombineConfig`) and logs every component under ``reward/<name>/*`` (mean, std, min, max, and failures). The
reward function also runs, for its ``acc`` only, on the rows of every data source it has a scorer for, so a
run trained on a reward model still reports task accuracy (``acc/mean``, ``val/<source>/mean@1``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from tensordict import TensorDict

from polyrl.batch import non_tensor
from polyrl.errors import ConfigError
from polyrl.protocols import RewardOutput

log = logging.getLogger("polyrl.rewards")

#: ``reward.combine.mode`` values.
COMBINE_MODES = ("sum", "gate", "function")
#: The reward function's component name.
RULE = "rule"
_RULE_KEYS = {"mode", "weights", "gate", "gate_threshold", "function"}


@dataclass
class ComponentScores:
    """One component's scores for a batch's rows (``failures``: rows that got a fallback score)."""

    scores: list[float]
    failures: int = 0
    metrics: dict[str, float] = field(default_factory=dict)


class ModelComponent(Protocol):
    """A reward component scored by a model (:class:`polyrl.reward_models.scorer.RewardModelScorer`)."""

    name: str

    def __call__(self, batch: TensorDict) -> ComponentScores: ...


@dataclass(frozen=True)
class CombineRule:
    """How one data source's components combine (the resolved ``reward.combine`` keys)."""

    mode: str
    weights: Mapping[str, float]
    gate: str = RULE
    gate_threshold: float = 0.0
    function: Callable[..., Any] | None = None

    def uses(self) -> set[str]:
        """The components this rule reads."""
        if self.mode == "function":
            return {"*"}
        used = {c for c, w in self.weights.items() if w != 0}
        return used | ({self.gate} if self.mode == "gate" else set())

    def combine(self, scores: Mapping[str, float], data_source: str, extra_info: Any) -> float:
        """The sample's score from its component ``scores``."""
        if self.mode == "function":
            assert self.function is not None
            return float(self.function(dict(scores), data_source, extra_info))
        total = sum(w * scores[c] for c, w in self.weights.items() if w != 0)
        if self.mode == "gate" and not scores[self.gate] > self.gate_threshold:
            return float(self.weights.get(self.gate, 1.0) * scores[self.gate])
        return float(total)


def resolve_rules(combine: Any, components: Sequence[str], *, model_enabled: bool) -> tuple[CombineRule, dict[str, CombineRule]]:
    """The default rule and the per-data-source rules of ``reward.combine`` (``combine``) for a run whose
    components are ``components``; raises :class:`ConfigError` naming the key for an unknown mode, component,
    gate or function, or an unknown key in a ``per_data_source`` block."""
    base = {k: _get(combine, k) for k in _RULE_KEYS}
    default = _rule(base, components, "reward.combine", model_enabled=model_enabled)
    per_source: dict[str, CombineRule] = {}
    for source, block in dict(_get(combine, "per_data_source") or {}).items():
        key = f"reward.combine.per_data_source.{source}"
        if not isinstance(block, Mapping) and not hasattr(block, "items"):
            raise ConfigError(f"{key}: give a block of {', '.join(sorted(_RULE_KEYS))}")
        block = dict(block)
        unknown = sorted(set(block) - _RULE_KEYS)
        if unknown:
            raise ConfigError(f"{key}.{unknown[0]}: unknown key; a per-data-source block takes "
                              f"{', '.join(sorted(_RULE_KEYS))}")
        merged = dict(base, weights={}) if "weights" not in block and "mode" in block else dict(base)
        merged.update(block)
        per_source[str(source)] = _rule(merged, components, key, model_enabled=model_enabled)
    return default, per_source


def _get(block: Any, key: str) -> Any:
    return block.get(key) if isinstance(block, Mapping) else getattr(block, key)


def _rule(keys: Mapping[str, Any], components: Sequence[str], where: str, *, model_enabled: bool) -> CombineRule:
    mode = str(keys.get("mode") or "sum")
    if mode not in COMBINE_MODES:
        raise ConfigError(f"{where}.mode={mode!r}: choose one of {', '.join(COMBINE_MODES)}")
    weights = {str(k): float(v) for k, v in dict(keys.get("weights") or {}).items()}
    for name in weights:
        if name not in components:
            raise ConfigError(f"{where}.weights.{name}: no reward component '{name}'; components of this run: "
                              f"{', '.join(components)} (a reward model's name is reward_model.name)")
    if not weights:
        if mode == "gate":
            weights = {c: 1.0 for c in components}
        else:
            weights = {c: 1.0 for c in components if c != RULE} if model_enabled else {RULE: 1.0}
    gate = str(keys.get("gate") or RULE)
    if mode == "gate" and gate not in components:
        raise ConfigError(f"{where}.gate={gate!r}: no reward component '{gate}'; components: {', '.join(components)}")
    function = None
    if mode == "function":
        spec = str(keys.get("function") or "")
        if not spec:
            raise ConfigError(f"{where}.mode=function needs {where}.function=path/to/file.py:fn")
        from polyrl.rewards.scoring import load_compute_score

        try:
            function = load_compute_score(spec)
        except ConfigError as exc:
            raise ConfigError(str(exc).replace("reward.function", f"{where}.function", 1)) from None
    return CombineRule(mode, weights, gate, float(keys.get("gate_threshold") or 0.0), function)


def _last_tokens(batch: TensorDict) -> torch.Tensor:
    """The response length up to the last non-padding token, per row (0 for an empty response)."""
    responses = batch["responses"]
    valid = batch["attention_mask"][:, -responses.shape[1]:] if "attention_mask" in batch.keys() \
        else batch["response_mask"]
    valid = valid.long()
    return torch.where(valid.any(-1), valid.cumsum(-1).argmax(-1) + 1, torch.zeros_like(valid[:, 0]))


def _stats(name: str, values: Sequence[float]) -> dict[str, float]:
    t = torch.tensor([float(v) for v in values], dtype=torch.float64)
    return {f"reward/{name}/mean": float(t.mean()), f"reward/{name}/std": float(t.std(unbiased=False)),
            f"reward/{name}/min": float(t.min()), f"reward/{name}/max": float(t.max())}


class RewardComposer:
    """The run's reward manager when a reward model or ``reward.combine`` is configured: ``batch -> RewardOutput``.

    ``rule``: the reward manager (``reward.manager`` with ``reward.function``); ``models``: reward components
    scored by models; ``has_rule_for(data_source)``: whether the reward function scores that data source (then it
    runs for ``acc`` even where the combination does not use it).
    """

    def __init__(self, *, rule: Callable[[TensorDict], RewardOutput], models: Sequence[ModelComponent],
                 combine: Any, fallback_score: float = 0.0,
                 has_rule_for: Callable[[str], bool] = lambda source: True) -> None:
        self.rule = rule
        self.models = {m.name: m for m in models}
        if RULE in self.models:
            raise ConfigError(f"reward_model.name={RULE!r} is taken by the reward function's component; choose "
                              "another name")
        self.components = [RULE, *self.models]
        self.default, self.per_source = resolve_rules(combine, self.components, model_enabled=bool(self.models))
        self.fallback_score = fallback_score
        self.has_rule_for = has_rule_for
        self._warned = False

    def rule_for(self, data_source: str) -> CombineRule:
        """The combination of ``data_source``'s samples."""
        return self.per_source.get(data_source, self.default)

    def __call__(self, batch: TensorDict) -> RewardOutput:
        n = batch.batch_size[0]
        sources = [str(s) for s in non_tensor(batch, "data_source", "")]
        infos = non_tensor(batch, "extra_info", None)
        rules = [self.rule_for(s) for s in sources]
        needs = [r.uses() for r in rules]
        scores: dict[str, list[float | None]] = {c: [None] * n for c in self.components}
        metrics: dict[str, float] = {}
        extra: dict[str, list[Any]] = {}

        # the reward function: rows that combine it, and rows it can score (for their acc)
        rule_rows = [i for i in range(n) if RULE in needs[i] or "*" in needs[i] or self.has_rule_for(sources[i])]
        rule_failures = 0
        if rule_rows:
            sub = batch if len(rule_rows) == n else batch[torch.tensor(rule_rows)]
            out = self.rule(sub)
            values = out.token_level_scores.sum(-1).tolist()
            for j, i in enumerate(rule_rows):
                scores[RULE][i] = float(values[j])
            metrics.update(out.metrics)
            rule_failures = int(out.metrics.get("reward/failures", 0.0))
            for key, column in out.extra.items():
                if key == "score":
                    continue
                full: list[Any] = [None] * n
                for j, i in enumerate(rule_rows):
                    full[i] = column[j]
                extra[key] = full
        # the models: rows that combine them
        for name, model in self.models.items():
            rows = [i for i in range(n) if name in needs[i] or "*" in needs[i]]
            if not rows:
                continue
            sub = batch if len(rows) == n else batch[torch.tensor(rows)]
            part = model(sub)
            for j, i in enumerate(rows):
                scores[name][i] = float(part.scores[j])
            metrics[f"reward/{name}/failures"] = float(part.failures)
            metrics.update(part.metrics)

        final, failures = self._combine(rules, scores, sources, infos)
        for name in self.components:
            present = [v for v in scores[name] if v is not None]
            if present:
                metrics.update(_stats(name, present))
            extra[f"{name}_score"] = scores[name]
        if RULE in self.components and any(v is not None for v in scores[RULE]):
            metrics[f"reward/{RULE}/failures"] = float(rule_failures)
        metrics["reward/combine_failures"] = float(failures)
        acc = extra.get("acc")
        if acc is not None:  # rows the reward function did not score: correct when their score is positive
            extra["acc"] = [float(a) if a is not None else float(final[i] > 0) for i, a in enumerate(acc)]
        extra["score"] = final
        token_scores = torch.zeros(batch["responses"].shape, dtype=torch.float32)
        lengths = _last_tokens(batch)
        rows_t = torch.arange(n)
        values_t = torch.tensor(final, dtype=torch.float32)
        token_scores[rows_t, (lengths - 1).clamp(min=0)] = torch.where(lengths > 0, values_t, torch.zeros_like(values_t))
        return RewardOutput(token_scores, extra, metrics)

    def _combine(self, rules: Sequence[CombineRule], scores: Mapping[str, Sequence[float | None]],
                 sources: Sequence[str], infos: Sequence[Any]) -> tuple[list[float], int]:
        final: list[float] = []
        failures = 0
        for i, rule in enumerate(rules):
            row = {c: float(x) for c, v in scores.items() if (x := v[i]) is not None}
            try:
                value = rule.combine(row, sources[i], infos[i] or {})
                if not math.isfinite(value):
                    raise ValueError(f"not a finite number: {value}")
            except Exception as exc:  # a user function that raised, or a component this row lacks
                failures += 1
                if not self._warned:
                    self._warned = True
                    log.warning("reward.combine (%s) failed for a sample of data source %r (%s: %s); such samples get "
                                "reward.fallback_score=%s (shown once)", rule.mode, sources[i], type(exc).__name__, exc,
                                self.fallback_score)
                value = self.fallback_score
            final.append(float(value))
        return final, failures
