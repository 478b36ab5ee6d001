"""Choosing a reward function: by data source, by registered name, or from ``path.py:function``."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from polyrl.errors import ConfigError


def default_compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None,
                          ) -> float | dict:
    """Score with the reward function registered for ``data_source`` (metadata ``data_sources``)."""
    from polyrl.plugins import get_plugin_manager

    registry = get_plugin_manager().registry("reward_function")
    for entry in registry.entries():
        if data_source in entry.metadata.get("data_sources", ()):
            return entry.load()(data_source, solution_str, ground_truth, extra_info)
    sources = sorted({s for e in registry.entries() for s in e.metadata.get("data_sources", ())})
    raise NotImplementedError(
        f"no reward function registered for data_source '{data_source}' (known: {', '.join(sources)}); "
        "set reward.function to a registered name or to path/to/file.py:compute_score"
    )


def load_compute_score(spec: str | None) -> Any:
    """The reward function ``spec`` names: empty (by data source), a registered name, or ``file.py:function``."""
    if not spec:
        return default_compute_score
    if ".py:" in spec or spec.endswith(".py"):
        file, _, name = spec.partition(":")
        name = name or "compute_score"
        path = Path(file)
        if not path.exists():
            raise ConfigError(f"reward.function: file {path} does not exist")
        module_spec = importlib.util.spec_from_file_location(f"polyrl_custom_reward_{path.stem}", path)
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)  # type: ignore[union-attr]
        if not hasattr(module, name):
            raise ConfigError(f"reward.function: {path} has no function '{name}'")
        return getattr(module, name)
    from polyrl.plugins import get_plugin_manager

    try:
        return get_plugin_manager().get("reward_function", spec)
    except LookupError as exc:
        raise ConfigError(f"reward.function: {exc}") from None
