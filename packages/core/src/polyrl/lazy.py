"""Names a package exports without importing them until first use (PEP 562).

The packages next to the built-in hooks modules use it, so that loading the hooks (``polyrl plugins``,
``polyrl --help``) does not import torch, tensordict, transformers or ray.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_getattr(package: str, exports: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package`` that imports ``exports[name]`` (a module path) on first access."""

    def __getattr__(name: str) -> Any:
        if name in exports:
            return getattr(importlib.import_module(exports[name]), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
