"""Argument checks and config reads shared by every estimator and loss.

verl passes configs as objects or mappings (:func:`cfg_get` reads both); the checks raise ``ValueError``
naming the argument, so a bad input never turns into a silent NaN loss.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["cfg_get", "check_finite", "check_nonempty_mask", "check_same_shape"]


def cfg_get(config: Any, key: str, default: Any = None) -> Any:
    """Read ``key`` from an object or a mapping (verl passes both); ``default`` when missing or None."""
    if config is None:
        return default
    value = config.get(key, default) if isinstance(config, Mapping) else getattr(config, key, default)
    return default if value is None else value


def check_same_shape(**tensors: torch.Tensor | None) -> None:
    """Raise ``ValueError`` naming every argument and its shape when the shapes differ (None is skipped)."""
    shapes = {k: tuple(v.shape) for k, v in tensors.items() if v is not None}
    if len(set(shapes.values())) > 1:
        raise ValueError("shape mismatch: " + ", ".join(f"{k}={s}" for k, s in shapes.items())
                         + "; these must all be [batch, response_length]")


def check_finite(name: str, value: torch.Tensor, where: torch.Tensor | None = None) -> None:
    """Raise ``ValueError`` naming ``name`` when it holds NaN or inf (only where ``where`` is set, if given)."""
    bad = ~torch.isfinite(value)
    if where is not None:
        bad = bad & where.bool()
    n_bad = int(bad.sum())
    if n_bad:
        raise ValueError(f"{name} holds {n_bad} NaN/inf values; polyrl never turns them into a silent NaN loss "
                         "(a failing reward function should return the reward manager's fallback score)")


def check_nonempty_mask(name: str, mask: torch.Tensor) -> None:
    """Raise ``ValueError`` when ``mask`` selects no token at all."""
    if not bool((mask != 0).any()):
        raise ValueError(f"{name} is all zero: no response token to compute on (check how {name} was built)")
