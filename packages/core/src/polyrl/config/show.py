"""``polyrl config show``: a config resolved into polyrl's layout, each non-default value with its source.

The output is YAML that ``polyrl train --config`` reads back; a value that differs from polyrl's default
carries a comment saying where it came from: a file and line, a command-line override, or the verl key it was
mapped from (and where that one came from)::

    actor:
      optim:
        lr: 1.0e-06  # verl actor_rollout_ref.actor.optim.lr (verl default (ppo_trainer))
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from polyrl.config.loader import LoadedConfig, load_with_origins, record_dict

#: Sections with a plugin block, and the field naming the plugin.
_PLUGIN_SECTIONS = {"actor": "engine", "critic": "engine", "ref": "engine", "rollout": "name", "trainer": "name"}


def show(manifest: str | Path | None = None, configs: Sequence[str | Path] = (), overrides: Sequence[str] = (), *,
         config_format: str = "auto", config_path: str | Path | None = None, config_name: str | None = None) -> str:
    """The text ``polyrl config show`` prints (see the module docstring)."""
    import logging

    from polyrl import plugins
    from polyrl.config.schema import PolyrlConfig
    from polyrl.manifest import Manifest

    pm = plugins.activate(Manifest.load(manifest) if manifest else None)
    loaded = load_with_origins(PolyrlConfig, configs, overrides, plugins=pm, config_format=config_format,
                               config_path=config_path, config_name=config_name, strict_plugins=False)
    for warning in loaded.warnings:
        logging.getLogger("polyrl").warning("%s", warning)
    return render(loaded, pm)


def native_tree(config: Any) -> dict:
    """``config`` as a nested dict in the layout a YAML file uses: each ``plugin_config`` under its plugin's
    name (``actor.fsdp``, ``rollout.vllm``); values read from the environment as their ``${oc.env:...}`` text."""
    tree = record_dict(config)
    for section, name_key in _PLUGIN_SECTIONS.items():
        block = tree.get(section)
        if not isinstance(block, dict) or "plugin_config" not in block:
            continue
        options = block.pop("plugin_config")
        if options is None:
            continue
        name = block.get(name_key) or (tree.get("actor", {}).get("engine") if section == "ref" else "")
        block[name] = options
    return tree


def _defaults(config: Any, pm: Any) -> dict:
    """polyrl's defaults in the same layout, plugin blocks at their schema's defaults."""
    defaults = native_tree(type(config)())
    registry = pm.registry("config_schema")
    for section, name_key in _PLUGIN_SECTIONS.items():
        block = getattr(config, section, None)
        if block is None or block.plugin_config is None:
            continue
        name = getattr(block, name_key, "") or (config.actor.engine if section == "ref" else "")
        schema_name = f"{'engine' if name_key == 'engine' else section}.{name}"
        if schema_name in registry:
            defaults[section][name] = dataclasses.asdict(registry.get(schema_name)())
    return defaults


def render(loaded: LoadedConfig, pm: Any) -> str:
    """The YAML text with source comments for ``loaded``."""
    tree, defaults = native_tree(loaded.config), _defaults(loaded.config, pm)
    layout = "verl's layout, mapped by docs/from_verl.md" if loaded.format == "verl" else "polyrl's layout"
    lines = [f"# polyrl config, read from {layout}. A value that differs from polyrl's default says where it "
             "came from."]
    _emit(tree, defaults, loaded.origins, "", 0, lines)
    return "\n".join(lines) + "\n"


def _scalar(value: Any) -> str:
    text = yaml.safe_dump(value, default_flow_style=True, width=10**9, allow_unicode=True).strip()
    return text[:-4].strip() if text.endswith("\n...") or text.endswith(" ...") else text.removesuffix("...").strip()


def _origin(origins: dict[str, str], key: str) -> str:
    path = key
    while path:
        if path in origins:
            return origins[path]
        path = path.rpartition(".")[0]
    return "derived by polyrl"


def _emit(tree: dict, defaults: Any, origins: dict[str, str], prefix: str, depth: int, lines: list[str]) -> None:
    pad = "  " * depth
    for key, value in tree.items():
        path = f"{prefix}{key}"
        default = defaults.get(key, _NOTHING) if isinstance(defaults, dict) else _NOTHING
        if isinstance(value, dict) and value:
            lines.append(f"{pad}{key}:")
            _emit(value, default if isinstance(default, dict) else {}, origins, path + ".", depth + 1, lines)
            continue
        text = f"{pad}{key}: {_scalar(value)}"
        if default is _NOTHING or default != value:
            text += f"  # {_origin(origins, path)}"
        lines.append(text)


_NOTHING = object()
