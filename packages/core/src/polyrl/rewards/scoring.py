"""Choosing a reward function: by data source, by registered name, or from ``path.py:function``."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from polyrl.errors import ConfigError


def default_compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None,
                          **kwargs: Any) -> float | dict:
    """Score with the reward function registered for ``data_source`` (verl's ``default_compute_score``).

    The function is the one whose registration metadata lists ``data_source`` in
    ``data_sources`` (or a prefix of it in ``data_source_prefixes``, e.g. ``aime``):
    GSM8K, MATH, DAPO-Math/AIME, Geometry3K and Search-R1 are built in
    (docs/rewards_and_data.md). verl's ``sandbox_fusion_url`` reaches a function that takes it (the ``code``
    reward runs the program on that SandboxFusion server); other extra keywords are accepted and ignored. An
    unknown data source raises ``NotImplementedError`` like verl's.
    """
    fn = reward_function_for(data_source)
    url = kwargs.get("sandbox_fusion_url")
    if url and _takes(fn, "sandbox_fusion_url"):
        return fn(data_source, solution_str, ground_truth, extra_info, sandbox_fusion_url=url)
    return fn(data_source, solution_str, ground_truth, extra_info)


def _takes(fn: Any, name: str) -> bool:
    import inspect

    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def reward_function_for(data_source: str) -> Any:
    """The reward function registered for ``data_source`` (see :func:`default_compute_score`)."""
    from polyrl.plugins import get_plugin_manager

    registry = get_plugin_manager().registry("reward_function")
    entry = _entry_for(registry, data_source)
    if entry is not None:
        return entry.load()
    sources = sorted({s for e in registry.entries() for s in e.metadata.get("data_sources", ())}
                     | {f"{p}*" for e in registry.entries() for p in e.metadata.get("data_source_prefixes", ())})
    raise NotImplementedError(
        f"no reward function registered for data_source '{data_source}' (known: {', '.join(sources)}); "
        "set reward.function to a registered name or to path/to/file.py:compute_score"
    )


def has_reward_function(reward: Any, data_source: str) -> bool:
    """Whether the ``reward`` block scores ``data_source`` with a function: ``reward.function`` (or verl's
    ``custom_reward_function``) names one, or one is registered for the data source."""
    if reward_function_spec(reward):
        return True
    try:
        reward_function_for(data_source)
    except NotImplementedError:
        return False
    return True


def check_reward_requirements(spec: str, data_sources: Any, plugins: Any = None) -> None:
    """Before any worker starts: a ConfigError with the install line when a reward function the run will call
    (the one ``spec`` names, or with an empty ``spec`` the one registered for each of ``data_sources``) declares
    modules (registration metadata ``requires_modules`` and ``install``) that are not installed, e.g. the MATH
    scorers without ``math-verify`` (``pip install 'polyrl[math]'``)."""
    if spec and (".py:" in spec or spec.endswith(".py")):
        return  # the user's own file: its imports ran when it was loaded
    from polyrl.plugins import get_plugin_manager

    registry = (plugins or get_plugin_manager()).registry("reward_function")
    entries = []
    if spec:
        try:
            entries.append((registry.entry(spec), f"reward.function={spec}"))
        except LookupError:
            return  # reported by load_compute_score
    else:
        for source in sorted({str(s) for s in data_sources}):
            entry = _entry_for(registry, source)
            if entry is not None:
                entries.append((entry, f"data_source '{source}'"))
    for entry, why in entries:
        missing = [m for m in entry.metadata.get("requires_modules", ()) if importlib.util.find_spec(m) is None]
        if missing:
            install = entry.metadata.get("install") or f"pip install {' '.join(missing)}"
            raise ConfigError(f"{why} is scored by reward function '{entry.name}', which needs "
                              f"{', '.join(missing)} (not installed): {install}")


def _entry_for(registry: Any, data_source: str) -> Any:
    for entry in registry.entries():
        if data_source in entry.metadata.get("data_sources", ()):
            return entry
    for entry in registry.entries():
        if any(data_source.startswith(p) for p in entry.metadata.get("data_source_prefixes", ())):
            return entry
    return None


def reward_function_spec(reward: Any) -> str:
    """The reward function a ``reward`` config block names, from polyrl's ``function`` or verl's
    ``custom_reward_function.path`` / ``.name`` (``name`` defaults to ``compute_score``).

    Both spellings may be given only if they name the same function; otherwise a
    :class:`~polyrl.errors.ConfigError` names both keys.
    """
    own = str(getattr(reward, "function", "") or "")
    custom = getattr(reward, "custom_reward_function", None)
    path = _get(custom, "path")
    name = _get(custom, "name")
    if not path:
        if name and not own:
            raise ConfigError(f"reward.custom_reward_function.name={name!r} needs reward.custom_reward_function.path "
                              "(the file that defines it); or set reward.function to a registered name")
        return own
    verl_spec = f"{path}:{name or 'compute_score'}"
    if own and _normalise_spec(own) != _normalise_spec(verl_spec):
        raise ConfigError(f"reward.function={own!r} and reward.custom_reward_function (path={path!r}, name="
                          f"{name!r}) name different reward functions; keep one of the two spellings")
    return verl_spec


def _get(block: Any, key: str) -> Any:
    if block is None:
        return None
    return block.get(key) if isinstance(block, dict) else getattr(block, key, None)


def _normalise_spec(spec: str) -> str:
    file, _, name = spec.partition(":")
    if file.endswith(".py"):
        return f"{Path(file).resolve()}:{name or 'compute_score'}"
    return spec


def load_compute_score(spec: Any) -> Any:
    """The reward function ``spec`` names: empty (by data source), a registered name, or ``file.py:function``;
    or a ``reward`` config block (see :func:`reward_function_spec`)."""
    if spec is not None and not isinstance(spec, str):
        spec = reward_function_spec(spec)
    if not spec:
        return default_compute_score
    if ".py:" in spec or spec.endswith(".py"):
        file, _, name = spec.partition(":")
        name = name or "compute_score"
        path = Path(file)
        if not path.exists():
            raise ConfigError(f"reward.function: file {path} does not exist")
        module_spec = importlib.util.spec_from_file_location(f"polyrl_custom_reward_{path.stem}", path)
        if module_spec is None or module_spec.loader is None:
            raise ConfigError(f"reward.function: {path} cannot be imported as a Python module")
        module = importlib.util.module_from_spec(module_spec)
        try:
            module_spec.loader.exec_module(module)
        except SyntaxError as exc:
            raise ConfigError(f"reward.function: {path} line {exc.lineno}: syntax error: {exc.msg}") from None
        except Exception as exc:  # the file runs at import: name the line that failed
            import traceback

            frames = [f for f in traceback.extract_tb(exc.__traceback__) if Path(f.filename) == path.resolve()
                      or f.filename == str(path)]
            line = f" line {frames[-1].lineno}" if frames else ""
            raise ConfigError(f"reward.function: importing {path}{line} failed: {type(exc).__name__}: {exc}") from None
        if not hasattr(module, name):
            raise ConfigError(f"reward.function: {path} has no function '{name}'")
        return getattr(module, name)
    from polyrl.plugins import get_plugin_manager

    try:
        return get_plugin_manager().get("reward_function", spec)
    except LookupError as exc:
        raise ConfigError(f"reward.function: {exc}") from None
