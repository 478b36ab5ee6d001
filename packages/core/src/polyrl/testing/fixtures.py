"""Fixtures of the ``polyrl.testing`` pytest plugin."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from polyrl.plugins import PluginManager, use_plugin_manager
from polyrl.registry import PluginInfo


class PluginHarness:
    """A fresh plugin manager (built-ins only) that is the process-wide one during a test.

    ``register(plugin)`` adds a hooks module or object for the test; everything is
    dropped when the test ends. ``pm`` is the :class:`~polyrl.plugins.PluginManager`.
    """

    def __init__(self, pm: PluginManager) -> None:
        self.pm = pm

    def register(self, plugin: ModuleType | object, name: str | None = None) -> PluginInfo:
        """Load ``plugin``'s hooks into the test's plugin manager; returns its PluginInfo."""
        name = name or getattr(plugin, "__name__", None) or type(plugin).__name__
        info = PluginInfo(name, None, None, getattr(plugin, "__name__", None))
        self.pm.add_plugin(plugin, info)
        return info

    def get(self, kind: str, name: str) -> Any:
        """Shortcut for ``pm.get(kind, name)``."""
        return self.pm.get(kind, name)


@pytest.fixture
def polyrl_plugins() -> Iterator[PluginHarness]:
    """A :class:`PluginHarness`: register your plugin, then look its names up as polyrl would."""
    pm = PluginManager(None, entry_points=False)
    with use_plugin_manager(pm):
        yield PluginHarness(pm)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-init tiny Qwen2-style causal LM with a char tokenizer (built once per session)."""
    from polyrl.models.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("polyrl-tiny") / "model", size="tiny", seed=0)


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir: Path) -> Any:
    """The tokenizer of :func:`tiny_model_dir`."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)
