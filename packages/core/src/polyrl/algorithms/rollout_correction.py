"""Rollout correction: importance weights and rejection masks for the rollout-vs-trainer log-prob gap.

The rollout engine (vLLM, SGLang, bf16 kernels) and the training engine disagree a
little on each token's probability, and an asynchronous run trains on samples of
an older policy. verl's ``algorithm.rollout_correction`` block corrects for it,
with the same names here:

- ``rollout_is``: ``token`` (a weight per token, ``pi_train / pi_rollout``) or
  ``sequence`` (one weight per response, the product over its tokens); ``None`` off.
- ``rollout_is_threshold``: a number ``u`` truncates the weights at ``u`` (TIS); a
  string ``"l_u"`` zeroes the weights outside ``[l, u]`` (IcePop).
- ``rollout_is_batch_normalize``: divide the weights by their batch mean.
- ``rollout_rs`` / ``rollout_rs_threshold``: rejection sampling, comma-separated
  criteria (``token_k1``, ``seq_mean_k3``...) each with its threshold; a token or
  sequence that fails any of them leaves the response mask.
- ``bypass_mode``: no separate old-log-prob pass; the rollout's log-probs are the
  old ones and the ``bypass_mode`` policy loss applies the correction itself
  (``loss_type``: ``ppo_clip`` or ``reinforce``).

Everything works in log space, clamped to +-20 before ``exp`` (verl's safety bound).
Formulas: docs/algorithms.md, "Rollout correction".
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from polyrl.algorithms.checks import cfg_get, check_same_shape
from polyrl.algorithms.torch_functional import masked_mean, masked_select_zero, masked_sum

__all__ = [
    "ROLLOUT_RS_OPTIONS",
    "SAFETY_BOUND",
    "compute_offpolicy_metrics",
    "compute_rollout_correction_and_rejection_mask",
    "compute_rollout_correction_weights",
    "compute_rollout_rejection_mask",
    "rollout_correction_settings",
]

SAFETY_BOUND = 20.0
ROLLOUT_RS_OPTIONS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3", "seq_mean_k1",
                      "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")
#: the keys of ``algorithm.rollout_correction`` (verl's names) and their defaults
SETTINGS_DEFAULTS: dict[str, Any] = {
    "rollout_is": None, "rollout_is_threshold": 2.0, "rollout_is_batch_normalize": False, "rollout_rs": None,
    "rollout_rs_threshold": None, "bypass_mode": False, "loss_type": "ppo_clip",
}


def _parse_is_threshold(spec: Any) -> tuple[float, float | None]:
    """``(upper, lower)`` from ``2.0`` / ``"2.0"`` (TIS, no lower bound) or ``"0.5_2.0"`` (IcePop)."""
    if isinstance(spec, bool) or not isinstance(spec, int | float | str):
        raise ValueError(f"rollout_correction.rollout_is_threshold={spec!r}: give a number (TIS cap) or "
                         "'lower_upper' such as '0.5_2.0' (IcePop)")
    text = str(spec).strip()
    try:
        lower_text, _, upper_text = text.rpartition("_")
        upper = float(upper_text)
        lower = float(lower_text) if lower_text else None
    except ValueError:
        raise ValueError(f"rollout_correction.rollout_is_threshold={spec!r} is not a number or "
                         "'lower_upper'") from None
    if upper <= 0 or (lower is not None and not 0 < lower <= upper):
        raise ValueError(f"rollout_correction.rollout_is_threshold={spec!r}: bounds must be positive and "
                         "lower <= upper")
    return upper, lower


def _parse_rs_thresholds(options: list[str], spec: Any) -> dict[str, tuple[float | None, float]]:
    """Per option ``(lower, upper)``: one shared threshold or one per option, comma-separated.

    ``*_k1`` options bound the log-ratio on both sides: ``"l_u"``, or ``u`` meaning ``1/u .. u``
    (the bounds are ratios; the test is on their logs). Other options take an upper bound only.
    """
    if spec is None:
        raise ValueError("rollout_correction.rollout_rs_threshold is required when rollout_rs is set")
    parts = [p.strip() for p in str(spec).split(",") if p.strip()]
    if len(parts) == 1:
        parts = parts * len(options)
    if len(parts) != len(options):
        raise ValueError(f"rollout_correction.rollout_rs_threshold={spec!r}: give one threshold, or one per "
                         f"rollout_rs option ({len(options)})")
    out: dict[str, tuple[float | None, float]] = {}
    for option, part in zip(options, parts, strict=True):
        try:
            if option.endswith("k1"):
                low_text, _, high_text = part.rpartition("_")
                upper = float(high_text)
                lower: float | None = float(low_text) if low_text else 1.0 / upper
            else:
                if "_" in part:
                    raise ValueError
                upper, lower = float(part), None
        except (ValueError, ZeroDivisionError):
            raise ValueError(f"rollout_correction.rollout_rs_threshold: '{part}' is not a valid threshold for "
                             f"'{option}' (k1 options: 'lower_upper' or a number; others: one number)") from None
        if upper <= 0 or (lower is not None and not 0 < lower <= upper):
            raise ValueError(f"rollout_correction.rollout_rs_threshold for '{option}' must be positive with "
                             f"lower <= upper, got '{part}'")
        out[option] = (lower, upper)
    return out


def compute_rollout_correction_weights(log_ratio: torch.Tensor, response_mask: torch.Tensor,
                                       rollout_is: str = "token", rollout_is_threshold: float | str = 2.0,
                                       rollout_is_batch_normalize: bool = False,
                                       ) -> tuple[torch.Tensor, dict[str, float]]:
    """Importance weights ``exp(log_ratio)`` (per token or per sequence), truncated (TIS) or cut (IcePop).

    ``log_ratio = log pi_train - log pi_rollout``. Returns weights (0 on padding,
    detached) and metrics ``rollout_is_mean/max/min``, ``rollout_is_ratio_fraction_high/low``,
    ``rollout_is_eff_sample_size`` (and ``rollout_is_oob_ratio`` for IcePop,
    ``rollout_is_batch_norm_factor`` when normalising).
    """
    check_same_shape(log_ratio=log_ratio, response_mask=response_mask)
    if rollout_is not in ("token", "sequence"):
        raise ValueError(f"rollout_correction.rollout_is={rollout_is!r}: choose 'token', 'sequence' or null")
    upper, lower = _parse_is_threshold(rollout_is_threshold)
    valid = response_mask != 0
    log_ratio = masked_select_zero(log_ratio.detach(), valid)
    if rollout_is == "token":
        raw_log = log_ratio
    else:
        raw_log = masked_sum(log_ratio, response_mask, -1).unsqueeze(-1).expand_as(log_ratio)
    raw = masked_select_zero(raw_log.clamp(-SAFETY_BOUND, SAFETY_BOUND).exp(), valid)
    # TIS truncates; IcePop zeroes what falls outside [lower, upper]
    weights = raw.clamp(max=upper) if lower is None else masked_select_zero(raw, (raw >= lower) & (raw <= upper))
    metrics = _is_metrics(weights, raw, raw_log, response_mask, rollout_is, upper, lower)
    if rollout_is_batch_normalize:
        if rollout_is == "token":
            mean = masked_mean(weights, response_mask)
        else:
            per_seq = masked_mean(weights, response_mask, -1)
            has_tokens = response_mask.sum(-1) > 0
            mean = masked_select_zero(per_seq, has_tokens).sum() / has_tokens.sum().clamp(min=1)
        factor = float(mean)
        if factor > 1e-8:
            weights = weights / mean
        metrics["rollout_is_batch_norm_factor"] = factor if factor > 1e-8 else 1.0
    return weights.detach(), metrics


def _is_metrics(weights: torch.Tensor, raw: torch.Tensor, raw_log: torch.Tensor, mask: torch.Tensor, level: str,
                upper: float, lower: float | None) -> dict[str, float]:
    valid = mask != 0
    low = lower if lower is not None else 1.0 / upper
    metrics = {"rollout_is_mean": float(masked_mean(weights, mask))}
    if level == "sequence":
        seq_log = raw_log[:, 0]  # one log-weight per sequence (all its columns hold it)
        metrics["rollout_is_max"] = math.exp(min(float(seq_log.max()), SAFETY_BOUND))
        metrics["rollout_is_min"] = math.exp(float(seq_log.min()))
        metrics["rollout_is_ratio_fraction_high"] = float((seq_log > math.log(upper)).float().mean())
        metrics["rollout_is_ratio_fraction_low"] = float((seq_log < math.log(low)).float().mean())
    else:
        metrics["rollout_is_max"] = float(weights.masked_fill(~valid, float("-inf")).max())
        metrics["rollout_is_min"] = float(weights.masked_fill(~valid, float("inf")).min())
        metrics["rollout_is_ratio_fraction_high"] = float(masked_mean((raw > upper).float(), mask))
        metrics["rollout_is_ratio_fraction_low"] = float(masked_mean((raw < low).float(), mask))
    capped = weights.clamp(0.0, upper)
    normalised = capped / (masked_mean(capped, mask) + 1e-8)
    metrics["rollout_is_eff_sample_size"] = 1.0 / float(masked_mean(normalised.square(), mask))
    if lower is not None:
        metrics["rollout_is_oob_ratio"] = float(masked_mean(((raw < lower) | (raw > upper)).float(), mask))
    return metrics


def compute_rollout_rejection_mask(log_ratio: torch.Tensor, response_mask: torch.Tensor,
                                   rollout_rs: str = "token_k1", rollout_rs_threshold: float | str | None = None,
                                   ) -> tuple[torch.Tensor, dict[str, float]]:
    """The response mask with tokens (``token_*``) or whole responses (``seq_*``) removed where a divergence
    estimate between the trainer and the rollout exceeds its threshold.

    Estimators per token, on ``log_ratio = log pi_train - log pi_rollout``: ``k1 = -log_ratio``,
    ``k2 = log_ratio^2 / 2``, ``k3 = exp(log_ratio) - 1 - log_ratio``; sequences use their sum,
    mean or max. ``k1`` criteria keep ``log(lower) <= k1 <= log(upper)``, the others ``<= upper``.
    Returns the new mask (same dtype) and metrics ``rollout_rs_masked_fraction``,
    ``rollout_rs_seq_masked_fraction`` and ``rollout_rs_<option>_masked_fraction``.
    """
    check_same_shape(log_ratio=log_ratio, response_mask=response_mask)
    options = list(dict.fromkeys(o.strip() for o in str(rollout_rs or "").split(",") if o.strip()))
    unknown = [o for o in options if o not in ROLLOUT_RS_OPTIONS]
    if not options or unknown:
        raise ValueError(f"rollout_correction.rollout_rs={rollout_rs!r}: options must be among "
                         f"{', '.join(ROLLOUT_RS_OPTIONS)} (comma-separated)")
    thresholds = _parse_rs_thresholds(options, rollout_rs_threshold)
    valid = response_mask != 0
    lr = masked_select_zero(log_ratio.detach(), valid).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    per_token = {"k1": -lr, "k2": 0.5 * lr.square(), "k3": lr.exp() - 1.0 - lr}
    keep = torch.ones_like(valid)
    metrics: dict[str, float] = {}
    for option in options:
        lower, upper = thresholds[option]
        level, kind = option.rsplit("_", 1)
        stat = per_token[kind]
        if level == "seq_sum":
            stat = masked_sum(stat, response_mask, -1).unsqueeze(-1)
        elif level == "seq_mean":
            stat = masked_mean(stat, response_mask, -1).unsqueeze(-1)
        elif level == "seq_max":
            top = stat.masked_fill(~valid, float("-inf")).max(-1).values
            stat = torch.where(torch.isinf(top), torch.zeros_like(top), top).unsqueeze(-1)
        if kind == "k1":
            assert lower is not None
            ok = (stat >= math.log(lower)) & (stat <= math.log(upper))
        else:
            ok = stat <= upper
        ok = ok.expand_as(valid)
        keep = keep & ok
        metrics[f"rollout_rs_{option}_masked_fraction"] = float(masked_mean((~ok).float(), response_mask))
    metrics["rollout_rs_masked_fraction"] = float(masked_mean((~keep).float(), response_mask))
    metrics["rollout_rs_seq_masked_fraction"] = float((valid & ~keep).any(-1).float().mean())
    return masked_select_zero(response_mask, keep).to(response_mask.dtype), metrics


def compute_offpolicy_metrics(old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor,
                              response_mask: torch.Tensor) -> dict[str, float]:
    """How far the trainer and the rollout disagree: ``kl`` (k1), ``k3_kl``, ``training_ppl``, ``rollout_ppl``,
    ``chi2_token`` and ``chi2_seq`` (verl's names)."""
    valid = response_mask != 0
    old = masked_select_zero(old_log_prob.detach(), valid)
    rollout = masked_select_zero(rollout_log_prob.detach(), valid)
    log_ratio = old - rollout
    mean_train = masked_mean(old, response_mask, -1)
    mean_rollout = masked_mean(rollout, response_mask, -1)
    safe = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    seq = masked_sum(log_ratio, response_mask, -1).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    return {
        "kl": float(masked_mean(rollout - old, response_mask)),
        "k3_kl": float(masked_mean(log_ratio.exp() - log_ratio - 1, response_mask)),
        "training_ppl": float(torch.exp(-mean_train).mean()),
        "rollout_ppl": float(torch.exp(-mean_rollout).mean()),
        "chi2_token": float(masked_mean(safe.exp().square(), response_mask)) - 1.0,
        "chi2_seq": float(torch.exp(2.0 * seq).mean()) - 1.0,
    }


def compute_rollout_correction_and_rejection_mask(
        old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, response_mask: torch.Tensor,
        rollout_is: str | None = None, rollout_is_threshold: float | str | None = 2.0,
        rollout_is_batch_normalize: bool = False, rollout_rs: str | None = None,
        rollout_rs_threshold: float | str | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor, dict[str, float]]:
    """IS weights (None when ``rollout_is`` is off), the response mask after rejection sampling, and metrics
    prefixed ``rollout_corr/``. verl returns the weights wrapped in a ``DataProto``; here they are a tensor."""
    check_same_shape(old_log_prob=old_log_prob, rollout_log_prob=rollout_log_prob, response_mask=response_mask)
    if not bool((response_mask != 0).any()):
        raise ValueError("rollout correction: response_mask has no valid token")
    log_ratio = old_log_prob.detach() - rollout_log_prob.detach()
    metrics: dict[str, float] = {}
    weights = None
    if rollout_is is not None and rollout_is_threshold is not None:
        weights, is_metrics = compute_rollout_correction_weights(log_ratio, response_mask, rollout_is,
                                                                 rollout_is_threshold, rollout_is_batch_normalize)
        metrics.update(is_metrics)
    mask = response_mask.clone()
    if rollout_rs is not None:
        mask, rs_metrics = compute_rollout_rejection_mask(log_ratio, response_mask, rollout_rs, rollout_rs_threshold)
        metrics.update(rs_metrics)
    metrics.update(compute_offpolicy_metrics(old_log_prob, rollout_log_prob, response_mask))
    return weights, mask, {f"rollout_corr/{k}": v for k, v in metrics.items()}


def rollout_correction_settings(block: Any, tis_imp_ratio_cap: float = 0.0) -> dict[str, Any] | None:
    """The ``algorithm.rollout_correction`` settings as a plain dict, or None when nothing is on.

    ``tis_imp_ratio_cap`` (polyrl's and verl 0.5's ``actor.policy_loss.tis_imp_ratio_cap``)
    still works: it means ``rollout_is: token`` with ``rollout_is_threshold: <cap>``. Setting
    it beside a different ``rollout_is``/threshold is an error.
    """
    settings = dict(SETTINGS_DEFAULTS)
    if block is not None:
        items = block.items() if isinstance(block, Mapping) else ((k, cfg_get(block, k)) for k in SETTINGS_DEFAULTS)
        for key, value in items:
            if key not in SETTINGS_DEFAULTS:
                raise ValueError(f"algorithm.rollout_correction.{key} is unknown; keys: {', '.join(SETTINGS_DEFAULTS)}")
            if value is not None:
                settings[key] = value
    if tis_imp_ratio_cap and tis_imp_ratio_cap > 0:
        wanted = {"rollout_is": "token", "rollout_is_threshold": float(tis_imp_ratio_cap)}
        if settings["rollout_is"] is not None and (
                settings["rollout_is"] != "token" or _parse_is_threshold(settings["rollout_is_threshold"])
                != (float(tis_imp_ratio_cap), None)):
            raise ValueError(
                f"actor.policy_loss.tis_imp_ratio_cap={tis_imp_ratio_cap} and algorithm.rollout_correction "
                f"(rollout_is={settings['rollout_is']!r}, rollout_is_threshold={settings['rollout_is_threshold']!r}) "
                "disagree; keep only algorithm.rollout_correction (tis_imp_ratio_cap: X is rollout_is: token, "
                "rollout_is_threshold: X)")
        settings.update(wanted)
    if settings["rollout_is"] is not None:
        _parse_is_threshold(settings["rollout_is_threshold"])
    if settings["loss_type"] not in ("ppo_clip", "reinforce"):
        raise ValueError(f"algorithm.rollout_correction.loss_type={settings['loss_type']!r}: choose 'ppo_clip' "
                         "or 'reinforce'")
    if settings["rollout_is"] is None and settings["rollout_rs"] is None and not settings["bypass_mode"]:
        return None
    return settings


def needs_whole_batch(settings: Mapping[str, Any]) -> bool:
    """True when the correction must see the whole batch before the update (rejection sampling, batch
    normalisation), so the trainer computes old log-probs instead of deriving the weights per micro-batch."""
    return bool(settings.get("rollout_rs")) or bool(settings.get("rollout_is_batch_normalize"))


def apply_rollout_correction(batch: Any, settings: Mapping[str, Any]) -> dict[str, float]:
    """Decoupled mode on a batch holding ``old_log_probs``, ``rollout_log_probs`` and ``response_mask``:
    store ``rollout_is_weights`` (when ``rollout_is`` is on), narrow ``response_mask`` (rejection
    sampling) in place, and return the ``rollout_corr/`` metrics."""
    if "rollout_log_probs" not in batch.keys():
        raise ValueError("algorithm.rollout_correction needs the rollout's log-probs (batch field rollout_log_probs); "
                         "use a rollout that returns them (rollout.calculate_log_probs / logprobs)")
    weights, mask, metrics = compute_rollout_correction_and_rejection_mask(
        batch["old_log_probs"], batch["rollout_log_probs"], batch["response_mask"],
        rollout_is=settings.get("rollout_is"), rollout_is_threshold=settings.get("rollout_is_threshold", 2.0),
        rollout_is_batch_normalize=bool(settings.get("rollout_is_batch_normalize", False)),
        rollout_rs=settings.get("rollout_rs"), rollout_rs_threshold=settings.get("rollout_rs_threshold"))
    if weights is not None:
        batch["rollout_is_weights"] = weights.to(batch["old_log_probs"].dtype)
    batch["response_mask"] = mask
    return metrics
