"""Load a config: YAML files, then ``key=value`` overrides, validated against the schema.

Every error names the key and where it came from (file or command line) and,
for an unknown key, suggests the closest known one. Plugin blocks (``actor.fsdp``,
``rollout.vllm``) are validated against the schema the plugin registered through
``register_config_schemas`` and attached as the role's ``plugin_config``.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import logging
import math
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from polyrl.config.overrides import apply_override, parse_override
from polyrl.errors import ConfigError

#: Role sections whose plugin block is named after ``engine``, and the rollouts named after ``name`` (a dotted
#: section is a block inside another: the reward model's judge rollout).
_PLUGIN_BLOCKS = {"actor": ("engine", "engine"), "critic": ("engine", "engine"), "ref": ("engine", "engine"),
                  "rollout": ("name", "rollout"), "trainer": ("name", "trainer"),
                  "reward_model": ("engine", "engine"), "reward_model.rollout": ("name", "rollout")}


#: Schema fields the loader fills itself; never suggested or listed to a user.
_INTERNAL_KEYS = frozenset({"plugin_config"})
#: Top-level keys of verl's layout (polyrl.config.verl.VERL_ONLY), named in the unknown-key error.
_VERL_TOP = frozenset({"actor_rollout_ref", "custom_reward_function", "reward_model", "reward_manager",
                       "global_profiler", "transfer_queue", "ray_kwargs", "distillation", "sandbox_fusion",
                       "model_engine"})
#: ``--config-format`` choices.
CONFIG_FORMATS = ("auto", "native", "verl")


def read_sources(files: Sequence[str | Path], overrides: Sequence[str]) -> tuple[dict, dict[str, str]]:
    """Merge YAML ``files`` and dotlist ``overrides`` into one dict; return it and key origins."""
    merged: dict = {}
    origins: dict[str, str] = {}
    for file in files:
        path = Path(file)
        if not path.exists():
            raise ConfigError(f"config file {path} does not exist")
        try:
            data = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
        except Exception as exc:  # yaml errors carry line numbers
            raise ConfigError(f"config file {path} is not valid YAML: {exc}") from None
        if data is None:
            continue
        if not isinstance(data, dict):
            raise ConfigError(f"config file {path} must hold a mapping at the top level")
        _deep_merge(merged, data, origins, str(path))
        origins.update({key: f"{path} line {line}" for key, line in _key_lines(path).items()})
    for item in overrides:
        override = parse_override(item)  # Hydra's grammar: key=value, +key=value, ++key=value, ~key
        if override.op == "delete":
            if _lookup(merged, override.key) is _MISSING:  # not set by a file: it is at its default already
                continue
            apply_override(merged, override)
            for key in [k for k in origins if k == override.key or k.startswith(override.key + ".")]:
                origins.pop(key)
            continue
        value: Any = override.value
        for part in reversed(override.key.split(".")):
            value = {part: value}
        _deep_merge(merged, value, origins, f"command line '{item}'")
    return merged, origins


def _lookup(tree: Mapping, key: str) -> Any:
    node: Any = tree
    for part in key.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return _MISSING
        node = node[part]
    return node


def _key_lines(path: Path) -> dict[str, int]:
    """The 1-based line of each dotted key of a YAML file (for error messages); empty if it cannot be parsed."""
    import yaml

    try:
        root = yaml.compose(path.read_text())
    except Exception:
        return {}
    lines: dict[str, int] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, yaml.MappingNode):
            for key_node, value_node in node.value:
                key = f"{prefix}{key_node.value}"
                lines[key] = key_node.start_mark.line + 1
                walk(value_node, key + ".")

    walk(root, "")
    return lines


def _deep_merge(dst: dict, src: Mapping, origins: dict[str, str], origin: str, prefix: str = "") -> None:
    for key, value in src.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping) and isinstance(dst.get(key), dict):
            _deep_merge(dst[key], value, origins, origin, path + ".")
        else:
            dst[key] = _copy(value)
        for sub in _leaf_paths(value, path):
            origins[sub] = origin


def _copy(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy(v) for v in value]
    return value


def _leaf_paths(value: Any, path: str) -> list[str]:
    if isinstance(value, Mapping) and value:
        return [p for k, v in value.items() for p in _leaf_paths(v, f"{path}.{k}")] + [path]
    return [path]


def _where(origins: Mapping[str, str], path: str) -> str:
    while path:
        if path in origins:
            return origins[path]
        path = path.rpartition(".")[0]
    return "defaults"


def _dataclass_of(tp: Any) -> type | None:
    if dataclasses.is_dataclass(tp):
        return tp
    for arg in typing.get_args(tp):
        if dataclasses.is_dataclass(arg):
            return arg
    return None


def _is_free_mapping(tp: Any) -> bool:
    origin = typing.get_origin(tp)
    return tp is Any or origin in (dict, Mapping) or tp is dict or (
        origin in (typing.Union, types.UnionType) and any(_is_free_mapping(a) for a in typing.get_args(tp))
    )


def check_keys(schema: type, data: Mapping, origins: Mapping[str, str], prefix: str = "") -> None:
    """Raise ``ConfigError`` for the first key of ``data`` that ``schema`` does not define."""
    hints = typing.get_type_hints(schema)
    names = [f.name for f in dataclasses.fields(schema) if f.name not in _INTERNAL_KEYS]
    for key, value in data.items():
        path = f"{prefix}{key}"
        if key not in hints:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f" Did you mean '{prefix}{close[0]}'?" if close else ""
            if not prefix and key in _VERL_TOP:
                hint = (f" '{key}' is a key of verl's layout: run with --config-format verl (or put the whole "
                        "config in verl's layout)")
            raise ConfigError(
                f"unknown config key '{path}' (from {_where(origins, path)}).{hint} "
                f"Keys of '{prefix.rstrip('.') or 'the config'}': {', '.join(names)}."
            )
        sub = _dataclass_of(hints[key])
        if sub is not None and isinstance(value, Mapping) and not _is_free_mapping(hints[key]):
            check_keys(sub, value, origins, path + ".")


def build(schema: type, data: Mapping, origins: Mapping[str, str], prefix: str = "") -> Any:
    """Validate ``data`` against the dataclass ``schema`` and return an instance."""
    check_keys(schema, data, origins, prefix)
    try:
        merged = OmegaConf.merge(_structured(schema), data)
        obj = OmegaConf.to_object(merged)
    except OmegaConfBaseException as exc:
        key = f"{prefix}{exc.full_key}" if getattr(exc, "full_key", None) else prefix.rstrip(".")
        msg = str(exc).splitlines()[0]
        if "is not a ListConfig" in msg:
            msg = f"expects a list, got a single value: write [value] (on the command line: {key}=[a,b])"
        raise ConfigError(f"config key '{key}' (from {_where(origins, key)}): {msg}") from None
    return obj


@dataclasses.dataclass
class LoadedConfig:
    """A loaded config with where its values came from (what ``polyrl config show`` prints)."""

    config: Any
    #: Dotted key -> where its value came from (``run.yaml line 4``, ``command line '...'``, ``verl ... (...)``).
    origins: dict[str, str]
    #: ``native`` or ``verl``: the layout that was read.
    format: str
    #: Warnings for the user (verl keys set here that have no effect in polyrl).
    warnings: list[str]


@functools.cache
def _structured(schema: type) -> Any:
    """The schema's OmegaConf structured config, built once per schema (``OmegaConf.merge`` copies it)."""
    return OmegaConf.structured(schema)


def load_config(
    schema: type,
    files: Sequence[str | Path] = (),
    overrides: Sequence[str] = (),
    *,
    base: Mapping | None = None,
    plugins: Any = None,
    config_format: str = "auto",
    config_path: str | Path | None = None,
    config_name: str | None = None,
) -> Any:
    """Load ``files`` and ``overrides`` (on top of ``base``) into an instance of ``schema``.

    ``config_format``: ``native`` (polyrl's layout), ``verl`` (verl's, mapped onto polyrl's by
    :mod:`polyrl.config.verl`; ``config_path`` / ``config_name`` name a verl trainer config) or ``auto`` (verl's
    when the config has ``actor_rollout_ref`` at the top level). Plugin blocks are validated against registered
    ``config_schema`` entries of ``plugins`` (the process-wide plugin manager when None).
    """
    loaded = load_with_origins(schema, files, overrides, base=base, plugins=plugins, config_format=config_format,
                               config_path=config_path, config_name=config_name)
    for warning in loaded.warnings:
        logging.getLogger("polyrl").warning("%s", warning)
    return loaded.config


def detect_format(files: Sequence[str | Path], overrides: Sequence[str], config_format: str = "auto", *,
                  config_name: str | None = None) -> str:
    """``native`` or ``verl`` for ``config_format`` ``auto`` (verl's when a file or an override has
    ``actor_rollout_ref`` at the top level, a file has a ``defaults:`` list, or ``--config-name`` is given)."""
    if config_format not in CONFIG_FORMATS:
        raise ConfigError(f"--config-format {config_format}: choose one of {', '.join(CONFIG_FORMATS)}")
    verl_marks: list[str] = []
    for file in files:
        path = Path(file)
        if not path.exists():
            raise ConfigError(f"config file {path} does not exist")
        try:
            data = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
        except Exception as exc:
            raise ConfigError(f"config file {path} is not valid YAML: {exc}") from None
        if isinstance(data, dict):
            verl_marks += [f"'{k}' in {path}" for k in ("actor_rollout_ref", "defaults") if k in data]
    for item in overrides:
        key = item.lstrip("+~").partition("=")[0].strip()
        if key.split(".")[0] == "actor_rollout_ref":
            verl_marks.append(f"command line '{item}'")
    if config_format == "native":
        if verl_marks or config_name:
            where = verl_marks[0] if verl_marks else f"--config-name {config_name}"
            raise ConfigError(f"{where} is verl's layout, but --config-format native was given: use --config-format "
                              "verl (or auto)")
        return "native"
    if config_format == "verl" or verl_marks or config_name:
        return "verl"
    return "native"


def load_with_origins(
    schema: type,
    files: Sequence[str | Path] = (),
    overrides: Sequence[str] = (),
    *,
    base: Mapping | None = None,
    plugins: Any = None,
    config_format: str = "auto",
    config_path: str | Path | None = None,
    config_name: str | None = None,
    strict_plugins: bool = True,
) -> LoadedConfig:
    """:func:`load_config`, returning the origin of every value too. ``strict_plugins=False`` keeps the block of a
    plugin that is not installed as a plain dict instead of refusing it (``polyrl config show``)."""
    fmt = detect_format(files, overrides, config_format, config_name=config_name)
    warnings: list[str] = []
    if fmt == "verl":
        from polyrl.config.verl import to_native

        if "rollout" not in {f.name for f in dataclasses.fields(schema)}:
            raise ConfigError("verl's config layout is read by `polyrl train` and `polyrl config show` only")
        raw, origins, warnings = to_native(files, overrides, config_path=config_path, config_name=config_name)
    else:
        if config_path:
            raise ConfigError("--config-path names a folder of verl configs: use it with --config-name (verl's layout)")
        raw, origins = read_sources(files, overrides)
        _check_deletions(schema, overrides)
    if base:
        merged: dict = {}
        _deep_merge(merged, base, {}, "defaults")
        _deep_merge(merged, raw, {}, "")
        raw = merged
    config = from_dict(schema, raw, origins, plugins=plugins, strict_plugins=strict_plugins)
    return LoadedConfig(config, origins, fmt, warnings)


def _check_deletions(schema: type, overrides: Sequence[str]) -> None:
    """``~key`` must name a key of the schema (a typo would otherwise pass unnoticed)."""
    for item in overrides:
        if item.strip().startswith("~"):
            key = parse_override(item).key
            if not _schema_has(schema, key):
                raise ConfigError(f"command-line override '{item}': the config has no key '{key}' to delete")


def _schema_has(schema: type, key: str) -> bool:
    """Whether dotted ``key`` names a field of ``schema`` (or lies in a free mapping or a plugin's block)."""
    cls: Any = schema
    parts = key.split(".")
    for i, part in enumerate(parts):
        sub = _dataclass_of(cls)
        if sub is None or _is_free_mapping(cls):
            return True
        hints = typing.get_type_hints(sub)
        if part not in hints:
            # a key inside a plugin's block (actor.fsdp.param_offload), which the plugin's own schema checks
            return "plugin_config" in hints and i < len(parts) - 1
        cls = hints[part]
    return True


def from_dict(schema: type, raw: Mapping, origins: dict[str, str] | None = None, *, plugins: Any = None,
              strict_plugins: bool = True) -> Any:
    """Validate an already merged config dict (see :func:`load_config`). ``origins`` is updated in place with the
    origins of values the loader copies (the top-level ``model`` block into the roles, verl's spellings)."""
    if origins is None:
        origins = {}
    data: dict = _copy(raw)
    _apply_spellings(schema, data, origins)
    _share_model_block(schema, data, origins)
    env_keys = _env_interpolations(data, "")
    plugin_blocks = _pop_plugin_blocks(schema, data)
    _coerce_scalars(schema, data, origins)
    config = build(schema, data, origins)
    check_values(config, origins)
    for section, (name, block) in plugin_blocks.items():
        target = config
        for part in section.split("."):  # a dotted section is a block inside another (reward_model.rollout)
            target = getattr(target, part)
        target.plugin_config = _plugin_config(section, name, block, origins, plugins, strict_plugins)
        plugin = name.partition(".")[2]  # the block ``actor.fsdp`` lives on as ``actor.plugin_config``
        env_keys = {(f"{section}.plugin_config.{k[len(section) + len(plugin) + 2:]}"
                     if k.startswith(f"{section}.{plugin}.") else k): v for k, v in env_keys.items()}
    if env_keys:
        object.__setattr__(config, ENV_INTERPOLATIONS, env_keys)
    return config


def _apply_spellings(schema: type, raw: dict, origins: dict[str, str]) -> None:
    """verl's names of renamed keys (:data:`polyrl.config.schema.VERL_SPELLINGS`) become polyrl's."""
    from polyrl.config.schema import VERL_SPELLINGS

    for alias, key in VERL_SPELLINGS.items():
        value = _lookup(raw, alias)
        if value is _MISSING or not _schema_has(schema, key.split(".")[0]):
            continue
        current = _lookup(raw, key)
        if current is not _MISSING and current != value:
            raise ConfigError(f"config keys '{alias}' (from {_where(origins, alias)}) and '{key}' (from "
                              f"{_where(origins, key)}) are two spellings of one key with different values; keep one")
        parent_path, _, leaf = alias.rpartition(".")
        parent = _lookup(raw, parent_path) if parent_path else raw
        del parent[leaf]
        if parent_path and not parent:  # `rollout.val_kwargs` emptied
            grand_path, _, name = parent_path.rpartition(".")
            grand = _lookup(raw, grand_path) if grand_path else raw
            del grand[name]
        node = raw
        *parents, last = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
        origins[key] = _where(origins, alias)


def _coerce_scalars(schema: type, raw: dict, origins: Mapping[str, str], prefix: str = "") -> None:
    """A single value where the schema wants a list becomes a one-element list (``data.train_files=a.parquet``);
    a mapping there is an error naming the key."""
    hints = typing.get_type_hints(schema)
    for key, value in list(raw.items()):
        tp = hints.get(key)
        if tp is None:
            continue
        path = f"{prefix}{key}"
        if typing.get_origin(tp) is list and value is not None and not isinstance(value, (list, tuple)):
            if isinstance(value, Mapping):
                raise ConfigError(f"config key '{path}' (from {_where(origins, path)}): expects a list, got a mapping")
            raw[key] = [value]
            continue
        sub = _dataclass_of(tp)
        if sub is not None and isinstance(value, dict) and not _is_free_mapping(tp):
            _coerce_scalars(sub, value, origins, path + ".")


#: Attribute of a loaded config holding ``{dotted key: "${oc.env:...}" text}`` for values read from the environment.
ENV_INTERPOLATIONS = "_polyrl_env_interpolations"


def _env_interpolations(node: Any, prefix: str) -> dict[str, str]:
    """Dotted keys whose raw value reads the environment (``${oc.env:NAME}``), with that text."""
    found: dict[str, str] = {}
    if isinstance(node, Mapping):
        for k, v in node.items():
            found.update(_env_interpolations(v, f"{prefix}{k}."))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            found.update(_env_interpolations(v, f"{prefix}{i}."))
    elif isinstance(node, str) and "${oc.env:" in node.replace(" ", ""):
        found[prefix[:-1]] = node
    return found


def _with_env_text(data: dict, config: Any) -> dict:
    """``data`` (a plain dict of ``config``) with every value read from the environment put back as its
    ``${oc.env:...}`` text, so what a run records holds no secret and still resolves when loaded again."""
    for key, text in getattr(config, ENV_INTERPOLATIONS, {}).items():
        *parents, leaf = key.split(".")
        node: Any = data
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node.get(part) if isinstance(node, dict) else None
            if node is None:
                break
        if isinstance(node, dict) and leaf in node:
            node[leaf] = text
        elif isinstance(node, list) and leaf.isdigit() and int(leaf) < len(node):
            node[int(leaf)] = text
    return data


def check_values(config: Any, origins: Mapping[str, str] | None = None) -> None:
    """Raise ``ConfigError`` naming the key and its source for a value outside its range
    (:data:`polyrl.config.schema.VALUE_RULES`), or a run that would train nothing."""
    from polyrl.config.schema import VALUE_RULES

    origins = origins or {}
    for key, rule in VALUE_RULES.items():
        obj: Any = config
        for part in key.split("."):
            obj = getattr(obj, part, _MISSING)
            if obj is _MISSING:
                break
        if obj is _MISSING or obj is None:
            continue
        if isinstance(obj, float) and math.isnan(obj):
            raise ConfigError(f"config key '{key}' (from {_where(origins, key)}): nan is not allowed; it must be a number")
        bad = obj <= 0 if rule == "> 0" else obj < 0
        if bad:
            need = "a positive number" if rule == "> 0" else "zero or more"
            raise ConfigError(f"config key '{key}' (from {_where(origins, key)}): {obj} is not allowed; it must be {need}")
    trainer = getattr(config, "trainer", None)
    if trainer is not None and trainer.total_steps == 0 and trainer.total_epochs == 0:
        raise ConfigError(f"config keys 'trainer.total_steps' and 'trainer.total_epochs' (from "
                          f"{_where(origins, 'trainer.total_epochs')}) are both 0: the run would train nothing; "
                          "set one of them")


_MISSING = object()


def _share_model_block(schema: type, raw: dict, origins: dict[str, str] | None = None) -> None:
    """Roles without their own ``model.path`` train the top-level ``model``."""
    hints = typing.get_type_hints(schema)
    top = raw.get("model")
    if top is None:
        return
    for section in ("actor", "critic"):
        if section in hints:
            role = raw.setdefault(section, {})
            own = role.get("model", {}) or {}
            combined: dict = {}
            _deep_merge(combined, top, {}, "")
            _deep_merge(combined, own, {}, "")
            role["model"] = combined
            if origins is not None:
                own_keys = set(_leaf_paths(own, f"{section}.model")) if own else set()
                for key in _leaf_paths(top, "model"):
                    target = f"{section}.{key}"
                    if target not in own_keys and key in origins:
                        origins.setdefault(target, origins[key])


def _pop_plugin_blocks(schema: type, raw: dict) -> dict[str, tuple[str, Any]]:
    found: dict[str, tuple[str, Any]] = {}
    for section, (name_key, kind) in _PLUGIN_BLOCKS.items():
        *parents, leaf = section.split(".")
        owner_schema: Any = schema
        owner: Any = raw
        for part in parents:  # a block inside another (reward_model.rollout)
            owner_schema = _dataclass_of(typing.get_type_hints(owner_schema).get(part))
            owner = owner.get(part) if isinstance(owner, dict) else None
            if owner_schema is None:
                break
        hints = typing.get_type_hints(owner_schema) if owner_schema is not None else {}
        if leaf not in hints:
            continue
        sub_schema = _dataclass_of(hints[leaf])
        block = (owner.get(leaf) if isinstance(owner, dict) else None) or {}
        default = getattr(sub_schema(), name_key, "") if sub_schema else ""
        name = block.get(name_key) or default
        if section == "ref" and not name:
            name = (raw.get("actor") or {}).get("engine") or "fsdp"
        options = block.pop(name, None) if isinstance(block, dict) and name else None
        if isinstance(block, dict) and options is None:
            options = block.pop("plugin_config", None)  # a resolved config.yaml written by a run
        found[section] = (f"{kind}.{name}", options)
    return found


def _plugin_config(section: str, schema_name: str, block: Any, origins: Mapping[str, str], plugins: Any,
                   strict: bool = True) -> Any:
    from polyrl.plugins import get_plugin_manager

    pm = plugins or get_plugin_manager()
    registry = pm.registry("config_schema")
    plugin_name = schema_name.partition(".")[2]
    if schema_name not in registry:
        if block and not strict:
            return dict(block)
        if block:
            raise ConfigError(
                f"config block '{section}.{plugin_name}' has no registered schema: no loaded plugin registers "
                f"config schema '{schema_name}'. Is the plugin providing '{plugin_name}' installed and in the manifest?"
            )
        return None
    return build(registry.get(schema_name), block or {}, origins, f"{section}.{plugin_name}.")


def to_dict(config: Any) -> dict:
    """A plain dict of a config instance (for YAML dumps and Ray transport)."""
    return OmegaConf.to_container(OmegaConf.structured(config), resolve=True)


def record_dict(config: Any) -> dict:
    """:func:`to_dict` as a run records it (``config.yaml``, the checkpoint's state, the trackers): values read
    from the environment (``${oc.env:NAME}``) kept as that text, never as the value (a secret)."""
    return _with_env_text(to_dict(config), config)


def to_yaml(config: Any) -> str:
    """YAML text of a config instance, as written into the run directory (see :func:`record_dict`)."""
    return OmegaConf.to_yaml(OmegaConf.create(record_dict(config)))
