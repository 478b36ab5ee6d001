"""A KV cache for a transformers model's forward pass, under the name that model's ``forward`` takes.

transformers renamed the forward argument ``past_key_values`` (and the output field of the same name) to
``cache``: from 5.24 the old spelling still works but warns on every call, and it goes away in 5.40. Code that
runs a model step by step (the ``hf`` rollout's decoding, the fsdp engine's shared-prompt forward) builds its
own :class:`transformers.DynamicCache`, passes it under the name the model declares
(:func:`cache_kwargs`), and keeps using that object (the model fills it in place), so it never reads the
renamed output field and works, without a warning, on either side of the rename.
"""

from __future__ import annotations

import inspect
from functools import cache
from typing import Any


@cache
def _cache_keyword(forward: Any) -> str:
    try:
        params = inspect.signature(forward).parameters  # follows functools.wraps (transformers' decorators)
    except (TypeError, ValueError):
        return "past_key_values"
    return "cache" if "cache" in params else "past_key_values"


def cache_keyword(model: Any) -> str:
    """``"cache"`` when ``model.forward`` takes a ``cache`` argument (transformers >= 5.24), else
    ``"past_key_values"``."""
    forward = getattr(type(model), "forward", None)
    return _cache_keyword(forward) if forward is not None else "past_key_values"


def new_cache(model: Any) -> Any:
    """An empty :class:`transformers.DynamicCache` for ``model`` (its config sets the layer types)."""
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


def cache_kwargs(model: Any, cache: Any) -> dict[str, Any]:
    """``{name: cache}`` for ``model(...)``: the KV cache under the name its forward takes."""
    return {cache_keyword(model): cache}


__all__ = ["cache_keyword", "cache_kwargs", "new_cache"]
