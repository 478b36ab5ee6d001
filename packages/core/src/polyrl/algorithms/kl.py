"""KL between the policy and the reference: per-token estimators (verl's ``kl_penalty``), KL in the reward
(``apply_kl_penalty``) and the fixed / adaptive coefficient controllers."""

from __future__ import annotations

from typing import Any

import torch

from polyrl.algorithms.checks import cfg_get, check_finite, check_same_shape
from polyrl.algorithms.torch_functional import masked_mean, masked_select_zero

__all__ = [
    "KL_ESTIMATORS",
    "AdaptiveKLController",
    "FixedKLController",
    "apply_kl_penalty",
    "get_kl_controller",
    "kl_penalty",
    "kl_penalty_forward",
]

KL_ESTIMATORS = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kl_penalty: str = "kl") -> torch.Tensor:
    """Per-token KL estimate between the policy and the reference (verl's names).

    ``kl``/``k1``: ``logp - ref``; ``abs``: ``|logp - ref|``; ``mse``/``k2``:
    ``0.5 (logp - ref)^2``; ``low_var_kl``/``k3``: ``exp(ref - logp) - (ref - logp) - 1``
    with the log-ratio clamped to [-20, 20] and the result to [-10, 10]. A ``+``
    suffix (``k3+``) is the straight-through estimator: the value of the named
    estimator with the gradient of ``k2`` (an unbiased gradient of KL).
    """
    if not isinstance(kl_penalty, str):
        raise ValueError(f"kl_penalty must be a name such as 'low_var_kl', got {kl_penalty!r}")
    if kl_penalty.endswith("+"):
        value = kl_penalty_forward(logprob, ref_logprob, kl_penalty[:-1])
        grad = kl_penalty_forward(logprob, ref_logprob, "k2")
        return grad - grad.detach() + value.detach()
    return kl_penalty_forward(logprob, ref_logprob, kl_penalty)


_kl_estimate = kl_penalty  # apply_kl_penalty's argument ``kl_penalty`` (verl's name) shadows the function


def kl_penalty_forward(logprob: torch.Tensor, ref_logprob: torch.Tensor, kind: str) -> torch.Tensor:
    """The plain estimators of :func:`kl_penalty` (no ``+`` suffix)."""
    check_same_shape(logprob=logprob, ref_logprob=ref_logprob)
    if kind in ("kl", "k1"):
        return logprob - ref_logprob
    if kind == "abs":
        return (logprob - ref_logprob).abs()
    if kind in ("mse", "k2"):
        return 0.5 * (logprob - ref_logprob).square()
    if kind in ("low_var_kl", "k3"):
        log_ratio = (ref_logprob - logprob).clamp(-20, 20)
        return (log_ratio.exp() - log_ratio - 1).clamp(-10, 10)
    hint = " ('full' needs the whole vocabulary distribution, which no engine returns)" if kind == "full" else ""
    raise ValueError(f"kl_penalty={kind!r} is unknown{hint}; choose from {', '.join(KL_ESTIMATORS)}, "
                     "optionally with a '+' suffix (straight-through k2 gradient)")


class FixedKLController:
    """A constant KL coefficient ``value``."""

    def __init__(self, kl_coef: float) -> None:
        self.value = kl_coef

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op (the coefficient is fixed)."""


class AdaptiveKLController:
    """Ziegler et al. (2019): move ``value`` towards a target KL over ``horizon`` samples."""

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int) -> None:
        if horizon <= 0:
            raise ValueError(f"kl_ctrl.horizon must be > 0, got {horizon}")
        if target_kl <= 0:
            raise ValueError(f"kl_ctrl.target_kl must be > 0, got {target_kl}")
        self.value, self.target, self.horizon = init_kl_coef, target_kl, horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        """``value *= 1 + clip(current_kl / target - 1, -0.2, 0.2) * n_steps / horizon``."""
        error = max(-0.2, min(0.2, current_kl / self.target - 1))
        self.value *= 1 + error * n_steps / self.horizon


def get_kl_controller(config: Any) -> FixedKLController | AdaptiveKLController:
    """A controller from ``algorithm.kl_ctrl`` (``type``: fixed | adaptive; ``kl_coef``, ``target_kl``, ``horizon``)."""
    kind = cfg_get(config, "type", "fixed")
    coef = cfg_get(config, "kl_coef", 0.001)
    if kind == "fixed":
        return FixedKLController(coef)
    if kind == "adaptive":
        return AdaptiveKLController(coef, cfg_get(config, "target_kl", 0.1), cfg_get(config, "horizon", 10000))
    raise ValueError(f"algorithm.kl_ctrl.type={kind!r} is unknown; choose 'fixed' or 'adaptive'")


def apply_kl_penalty(token_level_scores: torch.Tensor, old_log_prob: torch.Tensor, ref_log_prob: torch.Tensor,
                     response_mask: torch.Tensor, kl_ctrl: Any, kl_penalty: str = "kl",
                     ) -> tuple[torch.Tensor, dict[str, float]]:
    """KL in the reward: ``token_level_rewards = scores - kl_ctrl.value * KL`` on response tokens.

    Returns the rewards and metrics ``actor/reward_kl_penalty`` (the batch mean of
    each sequence's token-mean KL) and ``actor/reward_kl_penalty_coeff``. Unlike
    verl's, this does not call ``kl_ctrl.update``: the trainer does, once per step.
    """
    check_same_shape(token_level_scores=token_level_scores, old_log_prob=old_log_prob, ref_log_prob=ref_log_prob,
                     response_mask=response_mask)
    check_finite("token_level_scores", token_level_scores, response_mask)
    mask = response_mask.to(old_log_prob.dtype)
    kld = masked_select_zero(_kl_estimate(old_log_prob, ref_log_prob, kl_penalty), mask)
    beta = kl_ctrl.value
    rewards = masked_select_zero(token_level_scores, torch.isfinite(token_level_scores)) - beta * kld
    current = float(masked_mean(kld, mask, -1).mean())
    return rewards, {"actor/reward_kl_penalty": current, "actor/reward_kl_penalty_coeff": float(beta)}
