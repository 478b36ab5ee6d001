"""Start-up check that the data can be scored at all: nothing trains blind at reward 0.

Two mistakes used to train silently at reward 0 and exit 0: rows whose ground truth sits under another column
than the one the reward reads (``reward_model.ground_truth``), and a custom ``data_source`` with no
``reward.function`` (every call raises, every sample gets ``reward.fallback_score``). Before any worker starts,
:func:`check_rewards_reachable` takes the first rows of a data set and, for each, resolves the reward function
the configured path would call (``reward.function``, else the function registered for the row's data source)
and checks that the row has a ground truth where that function reads one. If no row can reach a scorer, it
raises one :class:`~polyrl.errors.ConfigError` naming the data file, the column, the data source and the key to
set. It runs no reward call, so it costs milliseconds whatever the reward does.

Whether a function reads its ground truth is taken from its registration (``needs_ground_truth=False`` in
``register_reward_functions``) or, for a plain Python function, from its code: one that never loads its third
argument does not need it.
"""

from __future__ import annotations

import dis
import functools
import inspect
from collections.abc import Sequence
from typing import Any

from polyrl.errors import ConfigError

#: Rows checked per data set.
SAMPLE_ROWS = 16
#: Column names a ground truth is often found under, suggested when the configured one is empty.
_TRUTH_NAMES = ("ground_truth", "answer", "solution", "label", "target", "gt", "final_answer", "reference")


def reads_argument(fn: Any, index: int, name: str) -> bool | None:
    """Whether ``fn``'s code reads its parameter ``name`` (or else its ``index``-th positional one); None when
    this cannot be told (a builtin, a parameter it does not have)."""
    target = fn
    while isinstance(target, functools.partial):
        target = target.func
    offset = 0
    if inspect.ismethod(target):
        target, offset = target.__func__, 1
    elif not inspect.isfunction(target):
        call = getattr(type(target), "__call__", None)  # noqa: B004 - the method itself, to read its code
        if not inspect.isfunction(call):
            return None
        target, offset = call, 1
    code = target.__code__
    params = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
    if name in params:
        param = name
    elif index + offset < code.co_argcount:
        param = params[index + offset]
    else:
        return None
    if param in code.co_cellvars:  # used by a nested function
        return True
    for ins in dis.get_instructions(code):
        if ins.opname.startswith(("LOAD_FAST", "LOAD_DEREF", "LOAD_CLOSURE")):
            value = ins.argval
            if value == param or (isinstance(value, tuple) and param in value):
                return True
    return False


def needs_ground_truth(fn: Any, metadata: dict | None = None) -> bool:
    """Whether reward function ``fn`` reads its ``ground_truth`` argument (unknown: False, never refuse on a guess)."""
    if metadata and "needs_ground_truth" in metadata:
        return bool(metadata["needs_ground_truth"])
    return bool(reads_argument(fn, 2, "ground_truth"))


def _function_for(spec: str, data_source: str, plugins: Any) -> tuple[Any, dict, str] | None:
    """``(function, registration metadata, name)`` scoring ``data_source`` by ``spec``; None when there is none."""
    if spec:
        from polyrl.rewards.scoring import load_compute_score

        fn = load_compute_score(spec)
        metadata: dict = {}
        if ".py" not in spec and spec in plugins.registry("reward_function"):
            metadata = dict(plugins.entry("reward_function", spec).metadata)
        return fn, metadata, spec
    registry = plugins.registry("reward_function")
    for entry in registry.entries():
        if data_source in entry.metadata.get("data_sources", ()):
            return entry.load(), dict(entry.metadata), entry.name
    for entry in registry.entries():
        if any(data_source.startswith(p) for p in entry.metadata.get("data_source_prefixes", ())):
            return entry.load(), dict(entry.metadata), entry.name
    return None


def check_rewards_reachable(rows: Sequence[dict], reward: Any, data: Any, *, source: str, plugins: Any = None) -> None:
    """Raise :class:`ConfigError` when none of the first :data:`SAMPLE_ROWS` of ``rows`` (verl's row format,
    columns already renamed by ``data.*_key``) can reach a scorer through ``reward`` (the config's reward block).

    ``source`` names the data set in the message (``data.val_files (a.jsonl, ...)``).
    """
    from polyrl.plugins import get_plugin_manager
    from polyrl.rewards.scoring import reward_function_spec

    pm = plugins or get_plugin_manager()
    spec = reward_function_spec(reward)
    sample = [r for r in (rows[i] for i in range(min(len(rows), SAMPLE_ROWS))) if isinstance(r, dict)]
    if not sample:
        return
    no_function: list[str] = []
    no_truth: list[tuple[str, str, dict]] = []
    found: dict[str, tuple[Any, dict, str] | None] = {}
    for row in sample:
        data_source = str(row.get("data_source") or "")
        if data_source not in found:
            found[data_source] = _function_for(spec, data_source, pm)
        scorer = found[data_source]
        if scorer is None:
            no_function.append(data_source)
            continue
        fn, metadata, name = scorer
        truth = (row.get("reward_model") or {}).get("ground_truth") if isinstance(row.get("reward_model"), dict) else None
        if truth is None and needs_ground_truth(fn, metadata):
            no_truth.append((data_source, name, row))
            continue
        return  # one row reaches a scorer
    ds_key = getattr(data, "reward_fn_key", "data_source")
    if no_function and len(no_function) >= len(no_truth):
        known = sorted({s for e in pm.registry("reward_function").entries() for s in e.metadata.get("data_sources", ())})
        shown = ", ".join(f"'{s}'" for s in dict.fromkeys(no_function))
        raise ConfigError(
            f"{source}: no reward function scores data_source {shown} (column '{ds_key}' of the first "
            f"{len(sample)} rows): every sample would get reward.fallback_score. Set reward.function (a registered "
            f"name or path/to/file.py:compute_score; verl: custom_reward_function.path), or use a data source with "
            f"a built-in function ({', '.join(known)}){_unloaded_scorer(pm, no_function)}")
    data_source, name, row = no_truth[0]
    column = getattr(data, "ground_truth_key", "reward_model.ground_truth")
    candidates = _truth_columns(row)
    hint = (f"set data.ground_truth_key={candidates[0]}" if candidates else
            f"put each row's answer under '{column}' or point data.ground_truth_key at its column")
    raise ConfigError(
        f"{source}: none of the first {len(sample)} rows has a ground truth at '{column}' (data.ground_truth_key), "
        f"which reward function '{name}' for data_source '{data_source}' reads: every sample would score 0. The rows "
        f"have columns {', '.join(sorted(row))}; {hint}")


def _unloaded_scorer(pm: Any, data_sources: list[str]) -> str:
    """``"; installed X provides it: add it to [plugins].require in M"`` when a plugin the manifest leaves out scores
    one of ``data_sources``."""
    finder = getattr(pm, "unloaded_providers", None)
    for source in dict.fromkeys(data_sources):
        hint = finder("reward_function", data_source=source) if finder is not None else ""
        if hint:
            return f"; for '{source}', {hint}"
    return ""


def _truth_columns(row: dict) -> list[str]:
    """Columns of ``row`` (one level deep) whose name looks like a ground truth and that hold a value."""
    out = []
    for key, value in row.items():
        if key in _TRUTH_NAMES and value not in (None, ""):
            out.append(key)
        elif isinstance(value, dict):
            out += [f"{key}.{k}" for k, v in value.items() if k in _TRUTH_NAMES and v not in (None, "")]
    return out
