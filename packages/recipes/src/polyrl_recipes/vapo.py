"""VAPO (Yue et al., "VAPO: Efficient and Reliable Reinforcement Learning for Advanced Reasoning Tasks",
arXiv 2504.05118): PPO with a value model, made to work on long chain-of-thought.

What this recipe takes from the paper (docs/recipes.md, "VAPO"):

- **decoupled GAE**: the critic's targets use ``lam_critic`` (1.0: unbiased Monte-Carlo returns, no decay of the
  end-of-sequence reward), the actor's advantages ``lam_actor``;
- **length-adaptive GAE**: ``lam_actor = 1 - 1 / (alpha * l)`` per response of ``l`` tokens (``alpha`` 0.05),
  so long responses get a lambda near 1 and short ones rely more on the value model (clamped to ``[0, 1]``:
  below ``1 / alpha`` tokens the formula would be negative);
- **value pre-training**: ``value_pretrain_steps`` steps train only the critic, on samples of the starting
  policy, before the actor moves (the core's ``critic.warmup_steps``).

VAPO's other parts are the core's own keys: clip-higher (``actor.clip_ratio_high=0.28``), token-level loss
(``actor.loss_agg_mode=token-mean``), group sampling (``rollout.n``). Its positive-example language-model
loss is not included.
"""

from __future__ import annotations

from typing import Any

import torch

from polyrl.algorithms.advantages import clean_padding
from polyrl.algorithms.checks import cfg_get, check_finite, check_same_shape
from polyrl.algorithms.torch_functional import masked_select_zero, masked_whiten
from polyrl.errors import ConfigError
from polyrl_recipes.base import RecipeTrainer
from polyrl_recipes.config import VAPOConfig

__all__ = ["VAPOTrainer", "compute_vapo_advantage_return", "gae", "length_adaptive_lambda"]


def gae(rewards: torch.Tensor, values: torch.Tensor, response_mask: torch.Tensor, gamma: float,
        lam: float | torch.Tensor) -> torch.Tensor:
    """Unwhitened GAE advantages ``[B, R]``: ``A_t = delta_t + gamma * lam * A_{t+1}``, ``delta_t = r_t + gamma
    V_{t+1} - V_t``, over the tokens where ``response_mask`` is set (masked tokens inside a response are skipped,
    as in the core's ``gae``); ``lam`` is a number or one value per row ``[B]``."""
    valid = response_mask != 0
    values = masked_select_zero(values, valid)
    rewards = masked_select_zero(rewards, valid)
    lam_t = torch.as_tensor(lam, dtype=values.dtype, device=values.device).expand(values.shape[0])
    next_value = torch.zeros(values.shape[0], dtype=values.dtype, device=values.device)
    last = torch.zeros_like(next_value)
    adv = torch.zeros_like(values)
    for t in reversed(range(values.shape[1])):  # over time only; vectorised over the batch
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        v = valid[:, t]
        next_value = torch.where(v, values[:, t], next_value)
        last = torch.where(v, delta + gamma * lam_t * last, last)
        adv[:, t] = last
    return masked_select_zero(adv, valid)


def length_adaptive_lambda(response_mask: torch.Tensor, alpha: float) -> torch.Tensor:
    """VAPO's per-response ``lambda = 1 - 1 / (alpha * l)``, ``l`` the response's token count, clamped to
    ``[0, 1]`` (an empty response gets 0)."""
    if alpha <= 0:
        raise ValueError(f"vapo: alpha={alpha} must be positive (length-adaptive lambda = 1 - 1 / (alpha * length))")
    lengths = (response_mask != 0).sum(-1).to(torch.float64)
    lam = 1.0 - 1.0 / (alpha * lengths.clamp(min=1.0))
    return torch.where(lengths > 0, lam, torch.zeros_like(lam)).clamp(0.0, 1.0)


@torch.no_grad()
def compute_vapo_advantage_return(token_level_rewards: torch.Tensor, values: torch.Tensor | None = None,
                                  response_mask: torch.Tensor | None = None, index: Any = None, config: Any = None,
                                  gamma: float | None = None, lam_critic: float | None = None,
                                  lam_actor: float | None = None, length_adaptive: bool | None = None,
                                  alpha: float | None = None, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """VAPO's decoupled, length-adaptive GAE: ``(whiten(GAE(lam_actor)), GAE(lam_critic) + V)``.

    Options come as keywords or from ``config`` (``trainer.vapo`` puts them in ``algorithm.extra``):
    ``lam_critic`` (1.0), ``lam_actor`` (0.95, used when ``length_adaptive`` is false), ``length_adaptive``
    (true: ``lam_actor = 1 - 1/(alpha l)`` per response), ``alpha`` (0.05), ``gamma`` (``config.gamma``, 1.0).
    With ``lam_critic == lam_actor`` (and ``length_adaptive`` off) it is the core's ``gae``.
    """
    if values is None:
        raise ValueError("vapo needs values=[B, R] (the critic's value of each response token)")
    if response_mask is None:
        raise ValueError("vapo needs response_mask=[B, R]")
    check_same_shape(token_level_rewards=token_level_rewards, values=values, response_mask=response_mask)
    check_finite("token_level_rewards", token_level_rewards, response_mask)
    check_finite("values", values, response_mask)
    extra = cfg_get(config, "extra", None)

    def option(name: str, given: Any, default: Any) -> Any:
        if given is not None:
            return given
        return cfg_get(config, name, cfg_get(extra, name, default))

    gamma = float(option("gamma", gamma, 1.0))
    lam_critic = float(option("lam_critic", lam_critic, 1.0))
    lam_actor_value = float(option("lam_actor", lam_actor, 0.95))
    adaptive = bool(option("length_adaptive", length_adaptive, True))
    alpha = float(option("alpha", alpha, 0.05))
    rewards = clean_padding(token_level_rewards, response_mask)
    values = values.to(rewards.dtype)
    actor_lam: float | torch.Tensor = (length_adaptive_lambda(response_mask, alpha).to(rewards.dtype) if adaptive
                                       else lam_actor_value)
    critic_adv = gae(rewards, values, response_mask, gamma, lam_critic)
    actor_adv = gae(rewards, values, response_mask, gamma, actor_lam)
    mask = response_mask.to(rewards.dtype)
    returns = masked_select_zero(critic_adv + masked_select_zero(values, response_mask != 0), mask)
    return masked_whiten(actor_adv, mask), returns


class VAPOTrainer(RecipeTrainer):
    """``trainer.name=vapo``: PPO with the ``vapo`` estimator (decoupled, length-adaptive GAE) and
    ``value_pretrain_steps`` steps of critic-only training first (``trainer.vapo``, :class:`VAPOConfig`)."""

    recipe = "vapo"
    adv_estimator = "vapo"
    options_cls = VAPOConfig

    def configure(self, config: Any) -> None:
        super().configure(config)
        o = self.options
        self.require_critic(config)
        for key in ("lam_critic", "lam_actor"):
            if not 0.0 <= getattr(o, key) <= 1.0:
                raise ConfigError(f"trainer.vapo.{key}={getattr(o, key)}: a GAE lambda lies in [0, 1]")
        if o.alpha <= 0:
            raise ConfigError(f"trainer.vapo.alpha={o.alpha}: must be positive (lambda = 1 - 1 / (alpha * length))")
        if o.value_pretrain_steps < 0:
            raise ConfigError(f"trainer.vapo.value_pretrain_steps={o.value_pretrain_steps}: must be 0 or more")
        warmup = config.critic.warmup_steps
        if warmup and warmup != o.value_pretrain_steps:
            raise ConfigError(f"critic.warmup_steps={warmup} and trainer.vapo.value_pretrain_steps="
                              f"{o.value_pretrain_steps} disagree: VAPO's value pre-training is the critic warm-up; "
                              "set one of them")
        config.critic.warmup_steps = o.value_pretrain_steps
        config.algorithm.extra = {**dict(config.algorithm.extra), "lam_critic": o.lam_critic,
                                  "lam_actor": o.lam_actor, "length_adaptive": o.length_adaptive, "alpha": o.alpha}
