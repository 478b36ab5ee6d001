"""verl's config layout as a second front end to polyrl's one schema.

``polyrl train --config-format verl`` (or any config with ``actor_rollout_ref`` at the top level) reads what
verl's ``main_ppo`` reads: a trainer config (``--config-name ppo_trainer`` / ``ppo_megatron_trainer``, shipped
with polyrl so verl need not be installed; ``--config-path`` for your own, whose ``defaults:`` lists are
composed as Hydra does), YAML files, and Hydra overrides (``key=value``, ``+key``, ``++key``, ``~key``,
``${...}`` interpolations). The composed tree starts from verl's own defaults, so a value you do not set is
verl's. Every key then goes through :mod:`polyrl.config.verl_table`: mapped onto polyrl's keys, accepted with
no effect (one warning lists those you changed), or refused with what to do instead. What comes out is an
ordinary polyrl config dict, validated by the native loader like any other.
"""

from __future__ import annotations

import copy
import difflib
import functools
import inspect
import logging
import re
from collections.abc import Callable, Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from polyrl.config import verl_table as table
from polyrl.config.overrides import Override, apply_override, parse_override
from polyrl.errors import ConfigError, PolyrlError

log = logging.getLogger("polyrl")

#: verl's trainer configs polyrl ships (``--config-name``).
TRAINER_CONFIGS = ("ppo_trainer", "ppo_megatron_trainer")
#: Top-level keys only polyrl's layout has; one of them in a verl-layout config mixes the two.
NATIVE_ONLY = {"model": "actor_rollout_ref.model", "actor": "actor_rollout_ref.actor",
               "rollout": "actor_rollout_ref.rollout", "ref": "actor_rollout_ref.ref",
               "agent": "actor_rollout_ref.rollout.multi_turn"}
#: Top-level keys only verl's layout has (``reward`` is both: verl's current tree has a ``reward`` block).
VERL_ONLY = ("actor_rollout_ref", "custom_reward_function", "reward_model", "reward_manager", "global_profiler",
             "transfer_queue", "ray_kwargs", "distillation", "sandbox_fusion", "model_engine")
#: verl's ``model_engine`` choices polyrl has trees for: the trainer config each one composes.
MODEL_ENGINES = {"dp": "ppo_trainer", "megatron": "ppo_megatron_trainer"}
#: verl's config groups, as their defaults lists name them, and the part of a shipped tree each one is.
GROUPS: dict[tuple[str, str], tuple[str, str]] = {
    ("actor", "dp_actor"): ("ppo_trainer", "actor_rollout_ref.actor"),
    ("actor", "megatron_actor"): ("ppo_megatron_trainer", "actor_rollout_ref.actor"),
    ("ref", "dp_ref"): ("ppo_trainer", "actor_rollout_ref.ref"),
    ("ref", "megatron_ref"): ("ppo_megatron_trainer", "actor_rollout_ref.ref"),
    ("rollout", "rollout"): ("ppo_trainer", "actor_rollout_ref.rollout"),
    ("model", "hf_model"): ("ppo_trainer", "actor_rollout_ref.model"),
    ("critic", "dp_critic"): ("ppo_trainer", "critic"),
    ("critic", "megatron_critic"): ("ppo_megatron_trainer", "critic"),
    ("data", "legacy_data"): ("ppo_trainer", "data"),
    ("reward_model", "dp_reward_loop"): ("ppo_trainer", "reward_model"),
    ("reward_model", "megatron_reward_loop"): ("ppo_megatron_trainer", "reward_model"),
    ("algorithm", "rollout_correction"): ("ppo_trainer", "algorithm.rollout_correction"),
    ("", "reward_manager"): ("ppo_trainer", "reward_manager"),
    ("reward", "reward"): ("ppo_trainer", "reward"),
    ("distillation", "distillation"): ("ppo_trainer", "distillation"),
    ("transfer_queue", "transfer_queue"): ("ppo_trainer", "transfer_queue"),
}


def shipped_tree(name: str) -> dict:
    """verl's composed ``name`` tree as polyrl ships it (interpolations unresolved); a fresh copy."""
    return copy.deepcopy(_shipped(name))


@functools.cache
def _shipped(name: str) -> dict:
    text = resources.files("polyrl.config").joinpath("verl_defaults").joinpath(f"{name}.yaml").read_text()
    return yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


def flatten(tree: Mapping, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}`` (an empty mapping is a leaf)."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, Mapping) and value:
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def unflatten(flat: Mapping[str, Any]) -> dict:
    """The inverse of :func:`flatten`."""
    tree: dict = {}
    for key, value in flat.items():
        node = tree
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return tree


def _subtree(tree: Mapping, path: str) -> Any:
    node: Any = tree
    for part in path.split("."):
        node = node[part]
    return node


def _place(tree: Any, package: str) -> Any:
    for part in reversed([p for p in package.split(".") if p]):
        tree = {part: tree}
    return tree


def _merge(dst: dict, src: Mapping) -> None:
    for key, value in src.items():
        if isinstance(value, Mapping) and isinstance(dst.get(key), dict):
            _merge(dst[key], value)
        else:
            dst[key] = value


class _Tree:
    """A verl config tree being composed, with the origin of every leaf."""

    def __init__(self) -> None:
        self.data: dict = {}
        self.origins: dict[str, str] = {}
        self.known: set[str] = set()  # keys of verl's own trees (a plain override must name one)
        self.trainer: str | None = None
        #: verl's model_engine choice (dp, megatron) a shipped trainer config is composed with; None: its own.
        self.engine: str | None = None

    def merge(self, data: Mapping, origin: str | Mapping[str, str], *, known: bool = False) -> None:
        new = list(flatten(data))
        self._drop_under(new)
        _merge(self.data, data)
        for key in new:
            self.origins[key] = origin if isinstance(origin, str) else origin.get(key, "")
            if known:
                self.known.add(key)

    def _drop_under(self, keys: Sequence[str]) -> None:
        """A leaf replacing a subtree (or the other way round) takes the old keys' origins with it."""
        if not self.origins:
            return
        inner = {p for k in keys for p in _parents(k)}
        under = tuple(f"{k}." for k in keys)
        for old in [k for k in inner if k in self.origins] + [k for k in self.origins if k.startswith(under)]:
            self.origins.pop(old, None)


def _read_yaml(path: Path) -> dict:
    if not path.exists():
        raise ConfigError(f"config file {path} does not exist")
    try:
        data = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    except Exception as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping at the top level")
    return data


def _file_origins(path: Path, data: Mapping) -> dict[str, str]:
    from polyrl.config.loader import _key_lines

    lines = _key_lines(path)
    return {key: f"{path} line {lines[key]}" if key in lines else str(path) for key in flatten(data)}


def _compose_file(path: Path, search: Sequence[Path], tree: _Tree, seen: tuple[Path, ...] = ()) -> None:
    """Merge ``path`` into ``tree``, composing its ``defaults:`` list first (Hydra's order: ``_self_`` last
    unless listed)."""
    if path.resolve() in seen:
        raise ConfigError(f"verl config {path}: its defaults list includes itself")
    data = _read_yaml(path)
    defaults = data.pop("defaults", None)
    data.pop("hydra", None)  # search paths into verl's package: polyrl ships verl's trees itself
    origins = _file_origins(path, data)
    if defaults is None:
        tree.merge(data, origins)
        return
    if not isinstance(defaults, list):
        raise ConfigError(f"verl config {path}: 'defaults' must be a list")
    dirs = [path.parent, *search]
    self_done = False
    for entry in defaults:  # `override model_engine: megatron` picks the trees of a trainer config listed before it
        if isinstance(entry, dict) and len(entry) == 1:
            group, _, option = _parse_default(entry, path)
            if group == "model_engine" and tree.engine is None and option is not None:
                tree.engine = _engine_choice(option, f"the defaults list of {path}")
    for entry in defaults:
        if entry == "_self_":
            tree.merge(data, origins)
            self_done = True
            continue
        group, package, option = _parse_default(entry, path)
        if option is None or group == "model_engine":
            continue
        _compose_entry(group, package, option, dirs, tree, path, entry, (*seen, path.resolve()))
    if not self_done:
        tree.merge(data, origins)


def _parse_default(entry: Any, path: Path) -> tuple[str, str | None, str | None]:
    """``(group, package, option)`` of a defaults-list entry (``name``, ``group: option``, ``group@pkg: option``)."""
    if isinstance(entry, str):
        return "", None, entry
    if isinstance(entry, dict) and len(entry) == 1:
        (key, option), = entry.items()
        key = str(key)
        for prefix in ("override ", "optional "):
            if key.startswith(prefix):
                key = key[len(prefix):].strip()
        group, _, package = key.partition("@")
        if option is not None and not isinstance(option, str):
            raise ConfigError(f"verl config {path}: defaults entry {entry!r}: only one option per group is supported")
        return group, package or None, option
    raise ConfigError(f"verl config {path}: defaults entry {entry!r} is not 'name', 'group: option' or "
                      "'group@package: option'")


def _compose_entry(group: str, package: str | None, option: str, dirs: Sequence[Path], tree: _Tree, parent: Path,
                   entry: Any, seen: tuple[Path, ...]) -> None:
    option = option[:-5] if option.endswith(".yaml") else option
    if not group and "@" in option:  # `- reward_manager@reward_manager`
        option, _, package = option.partition("@")
    rel = Path(group) / f"{option}.yaml" if group else Path(f"{option}.yaml")
    target = package if package is not None else group.replace("/", ".")
    if package == "_global_":
        target = ""
    for folder in dirs:
        candidate = folder / rel
        if candidate.exists():
            sub = _Tree()
            sub.engine = tree.engine
            _compose_file(candidate, [], sub, seen)
            _merge_placed(tree, sub, target)
            return
    if not group and option in TRAINER_CONFIGS:
        option = MODEL_ENGINES[tree.engine] if tree.engine else option
        tree.merge(shipped_tree(option), f"verl default ({option})", known=True)
        tree.trainer = option
        return
    shipped = GROUPS.get((group, option))
    if shipped is not None:
        name, path = shipped
        part = _place(_subtree(shipped_tree(name), path), target)
        tree.merge(part, f"verl default ({name})", known=True)
        return
    where = ", ".join(str(d) for d in dirs)
    raise ConfigError(f"verl config {parent}: defaults entry {entry!r} names {rel}, which is in none of {where} "
                      f"(polyrl ships verl's {', '.join(TRAINER_CONFIGS)} and their groups)")


def _merge_placed(tree: _Tree, sub: _Tree, target: str) -> None:
    prefix = f"{target}." if target else ""
    tree.merge(_place(sub.data, target), {prefix + k: v for k, v in sub.origins.items()})
    tree.known |= {prefix + k for k in sub.known}
    tree.trainer = tree.trainer or sub.trainer
    tree.engine = tree.engine or sub.engine


def _did_you_mean(key: str, names: Sequence[str]) -> str:
    """The closest of verl's key names: one that ends with ``key`` (a prefix left out), a sibling with a close
    name, or a close full name."""
    tails = [n for n in names if n.endswith("." + key)]
    if tails:
        return f" Did you mean '{min(tails, key=len)}'?"
    parent, _, leaf = key.rpartition(".")
    siblings = [n.rpartition(".")[2] for n in names if n.rpartition(".")[0] == parent]
    close = difflib.get_close_matches(leaf, siblings, n=1, cutoff=0.6)
    if close:
        return f" Did you mean '{parent}.{close[0]}'?"
    close = difflib.get_close_matches(key, list(names), n=1, cutoff=0.75)
    return f" Did you mean '{close[0]}'?" if close else ""


def compose(files: Sequence[str | Path] = (), overrides: Sequence[str] = (), *, config_path: str | Path | None = None,
            config_name: str | None = None) -> tuple[dict, dict[str, str], set[str]]:
    """verl's tree for ``--config-path/--config-name``, ``files`` and ``overrides``, unresolved: ``(tree,
    origins of the leaves, keys of verl's own trees)``."""
    tree = _Tree()
    search = [Path(config_path)] if config_path else []
    parsed = [parse_override(text) for text in overrides]
    engine = _model_engine(parsed) or _file_engine(files)
    tree.engine = engine
    if config_name:
        name = config_name[:-5] if config_name.endswith(".yaml") else config_name
        own = Path(config_path) / f"{name}.yaml" if config_path else None
        if own is not None and own.exists():
            _compose_file(own, search, tree)
        elif name in TRAINER_CONFIGS:
            name = MODEL_ENGINES[engine] if engine else name
            tree.merge(shipped_tree(name), f"verl default ({name})", known=True)
            tree.trainer = name
        else:
            where = f" in {config_path}" if config_path else ""
            raise ConfigError(f"--config-name {config_name}: no {name}.yaml{where}, and it is not one of verl's "
                              f"trainer configs polyrl ships ({', '.join(TRAINER_CONFIGS)})")
    composed = [_compose_one(Path(f), search, engine) for f in files]
    if tree.trainer is None and not any(t.trainer for t in composed):
        engine = engine or next((t.engine for t in composed if t.engine), None)
        name = MODEL_ENGINES[engine] if engine else "ppo_trainer"
        base = _Tree()
        base.merge(shipped_tree(name), f"verl default ({name})", known=True)
        base.trainer = name
        base.merge(tree.data, tree.origins)
        base.known |= tree.known
        tree = base
    for sub in composed:
        _merge_placed(tree, sub, "")
    for override in parsed:
        _apply(tree, override)
    return tree.data, tree.origins, tree.known


def _model_engine(overrides: Sequence[Override]) -> str | None:
    """verl's ``model_engine=...`` from the command line (it picks the actor, ref and critic trees), or None."""
    chosen = None
    for override in overrides:
        if override.key == "model_engine" and override.op != "delete":
            chosen = _engine_choice(override.value, f"command line '{override.text}'")
    return chosen


def _file_engine(files: Sequence[str | Path]) -> str | None:
    """A top-level ``model_engine:`` of the YAML files (the last one that has it), or None."""
    chosen = None
    for file in files:
        path = Path(file)
        if path.exists():
            value = _read_yaml(path).get("model_engine")
            if value is not None:
                chosen = _engine_choice(value, str(path))
    return chosen


def _engine_choice(value: Any, where: str) -> str:
    if str(value) not in MODEL_ENGINES:
        raise ConfigError(f"verl's model_engine={value} (from {where}) is not an engine polyrl has: dp (polyrl's "
                          "fsdp) or megatron. docs/from_verl.md lists what each verl key becomes")
    return str(value)


def _compose_one(path: Path, search: Sequence[Path], engine: str | None = None) -> _Tree:
    sub = _Tree()
    sub.engine = engine
    _compose_file(path, search, sub)
    return sub


def _apply(tree: _Tree, override: Override) -> None:
    top = override.key.split(".")[0]
    if top == "hydra":
        if override.key.startswith("hydra.searchpath"):
            raise ConfigError(f"command line '{override.text}': polyrl ships verl's config trees itself and cannot "
                              "read a package's configs (pkg://...); give your configs' folder with --config-path")
        return  # Hydra's own settings (output folders, logging): polyrl writes everything to trainer.run_dir
    if top in NATIVE_ONLY and top not in tree.data:
        check_layout({top: f"command line '{override.text}'"})
    node: Any = tree.data
    exists, free = True, False
    for part in override.key.split("."):
        if not isinstance(node, Mapping) or part not in node:
            exists = False
            # a key under a free-form block (engine_kwargs.sglang: {}) needs no +
            free = isinstance(node, Mapping) and not node
            break
        node = node[part]
    free = free or getattr(table.classify(override.key), "open", False)
    if override.op == "set" and not exists and not free:
        hint = _did_you_mean(override.key, sorted(tree.known or flatten(tree.data)))
        raise ConfigError(f"unknown verl key '{override.key}' (from command line '{override.text}').{hint} "
                          f"A key verl's tree does not have needs +{override.key}=...")
    apply_override(tree.data, override)
    tree._drop_under([override.key])
    if override.op != "delete":
        for key in flatten({override.key: override.value} if not isinstance(override.value, Mapping)
                           else _place(override.value, override.key)):
            tree.origins[key] = f"command line '{override.text}'"


_REF = re.compile(r"\$\{(?:oc\.select:)?\s*(\.*[A-Za-z_][\w.]*)")


def _split_inert(tree: Mapping, origins: Mapping[str, str]) -> tuple[dict, dict[str, Any]]:
    """``(tree to resolve, flat leaves that need no resolving)``: the blocks (profilers, distillation, verl's
    reward-model rollout...) that hold only verl's defaults, no ``${...}`` but in keys polyrl ignores, and that
    no interpolation elsewhere reads are kept out of OmegaConf, whose resolving of verl's whole tree costs most
    of a load."""
    flat = flatten(tree)
    refs: set[str] = set()
    for key, value in flat.items():
        if isinstance(value, str) and "${" in value:
            for name in _REF.findall(value):
                dots = len(name) - len(name.lstrip("."))
                if dots:
                    base = key.split(".")[:-dots]  # `${.x}`: a sibling of the leaf; each further dot one level up
                    name = ".".join([*base, name[dots:]])
                refs.add(name)
    user = {k for k, v in origins.items() if not v.startswith("verl default")}

    def inert(path: str, node: Mapping) -> bool:
        prefix = path + "."
        if any(r == path or r.startswith(prefix) or path.startswith(r + ".") for r in refs):
            return False
        if any(u == path or u.startswith(prefix) for u in user):
            return False
        # an interpolation only an ignored key holds need not be resolved: nothing reads its value
        return not any(isinstance(v, str) and "${" in v and not isinstance(table.classify(k), table.Ignored)
                       for k, v in flat.items() if k.startswith(prefix))

    out: dict[str, Any] = {}

    def split(node: Mapping, path: str) -> dict:
        live: dict = {}
        for key, value in node.items():
            sub = f"{path}.{key}" if path else str(key)
            if isinstance(value, Mapping) and value:
                if path and inert(sub, value):  # top-level blocks stay (a tree needs its roots)
                    out.update(flatten(value, sub + "."))
                else:
                    live[key] = split(value, sub)
            else:
                live[key] = value
        return live

    return split(tree, ""), out


def resolve(tree: Mapping, origins: Mapping[str, str]) -> dict[str, Any]:
    """Resolve ``${...}`` interpolations (``oc.env``, ``oc.select``, relative ``${.key}``); flat result."""
    try:
        resolved = OmegaConf.to_container(OmegaConf.create(dict(tree)), resolve=True, throw_on_missing=False)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or ""
        where = origins.get(key, "")
        first = str(exc).strip().splitlines()[0]
        raise ConfigError(f"verl key '{key}'{f' (from {where})' if where else ''}: {first}") from None
    assert isinstance(resolved, dict)
    return flatten(resolved)


def check_layout(top_keys: Mapping[str, str]) -> None:
    """Refuse a config that mixes verl's layout with polyrl's; ``top_keys``: top-level key -> where it came from."""
    for key, where in top_keys.items():
        if key in NATIVE_ONLY:
            raise ConfigError(f"the config mixes verl's layout (actor_rollout_ref...) with polyrl's: '{key}' (from "
                              f"{where}) is polyrl's key; in verl's layout write {NATIVE_ONLY[key]}, or convert the "
                              "whole config to one layout (polyrl config show prints polyrl's)")


def to_native(files: Sequence[str | Path] = (), overrides: Sequence[str] = (), *, config_path: str | Path | None = None,
              config_name: str | None = None) -> tuple[dict, dict[str, str], list[str]]:
    """A verl-layout config as polyrl's: ``(native config dict, origin of each native key, warnings)``.

    Raises :class:`ConfigError` (one line, naming the key and where it came from) for an unknown verl key (with a
    did-you-mean over verl's names), a refused key, a config mixing the layouts, or a ``defaults:`` entry that
    names a missing file.
    """
    tree, origins, known = compose(files, overrides, config_path=config_path, config_name=config_name)
    check_layout({k: _first_origin(origins, k) for k in tree})
    live, inert = _split_inert(tree, origins)
    values = {**resolve(live, origins), **inert}
    origins = dict(origins)
    for key in values:  # an interpolation that resolved to a mapping (rollout.mtp -> model.mtp): its leaf's origin
        if key not in origins:
            parent = next((p for p in _parents(key) if p in origins), None)
            if parent is not None:
                origins[key] = origins[parent]
                if parent in known:
                    known.add(key)
    view = table.VerlView(values, origins)
    defaults = _verl_defaults()
    warnings = _check_keys(view, known, defaults)
    native, native_origins = _map(view, flatten(tree))
    return unflatten(native), native_origins, warnings


def _parents(key: str) -> list[str]:
    parts = key.split(".")
    return [".".join(parts[:i]) for i in range(len(parts) - 1, 0, -1)]


def _first_origin(origins: Mapping[str, str], key: str, *, user: bool = False) -> str:
    """Where ``key`` (or the first leaf under it) came from; ``user``: the first leaf the user set, not one of
    verl's defaults beside it."""
    for k, v in origins.items():
        if (k == key or k.startswith(key + ".")) and not (user and v.startswith("verl default")):
            return v
    return _first_origin(origins, key) if user else "the config"


@functools.lru_cache(maxsize=1)
def _verl_defaults() -> dict[str, Any]:
    """verl's default value of every key of the shipped trees (the first tree that has it)."""
    out: dict[str, Any] = {}
    for name in TRAINER_CONFIGS:
        for key, value in flatten(_shipped(name)).items():
            out.setdefault(key, value)
    return out


def _check_keys(view: table.VerlView, known: set[str], defaults: Mapping[str, Any]) -> list[str]:
    """Unknown keys and refused values raise; returns a warning for ignored keys the user changed."""
    changed: list[str] = []
    refused: list[tuple[str, Any, str, str]] = []
    missing: list[str] = []
    names = sorted(defaults)
    for key, value in view.values.items():
        entry = table.classify(key)
        origin = view.origins.get(key, "")
        from_user = not origin.startswith("verl default")
        if key not in known and (entry is None or not (_exact(entry, key) or getattr(entry, "open", False))):
            raise ConfigError(f"unknown verl key '{key}' (from {origin}).{_did_you_mean(key, names)} verl's "
                              "trainer config has no such key and polyrl does not know it")
        assert entry is not None
        if value == "???" and isinstance(entry, table.Mapped):
            missing.append(key)
        if isinstance(entry, table.Refused) and not entry.accepts(value, defaults.get(key)):
            refused.append((key, value, origin, entry.instead))
        if isinstance(entry, table.Ignored) and from_user and value != defaults.get(key, None):
            changed.append(key)
    if refused:
        key, value, origin, instead = refused[0]
        more = f" (also refused here: {', '.join(k for k, *_ in refused[1:])})" if len(refused) > 1 else ""
        raise ConfigError(f"verl key '{key}'={value!r} (from {origin}) is not supported by polyrl: {instead}{more}. "
                          "docs/from_verl.md lists what each verl key becomes")
    if missing:
        key = missing[0]
        hint = " (vllm, sglang or hf)" if key == f"{table.ROLLOUT}.name" else ""
        raise ConfigError(f"verl key '{key}' has no value (verl requires it): set {key}=...{hint}")
    if not changed:
        return []
    shown = ", ".join(changed[:8]) + (f" (and {len(changed) - 8} more)" if len(changed) > 8 else "")
    return [f"verl keys set here that have no effect in polyrl (docs/from_verl.md says why): {shown}"]


def _exact(entry: table.Entry, key: str) -> bool:
    return entry.verl == key


#: A value that is only environment reads (``${oc.env:TOKEN}``, ``${oc.env:HOME}/data``).
_ENV_ONLY = re.compile(r"^(?:[^$]|\$(?!\{))*(?:\$\{oc\.env:[^${}]*\}(?:[^$]|\$(?!\{))*)+$")


def _map(view: table.VerlView, raw: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """The polyrl keys the table's mapped entries give ``view``, with their origins. A value copied as it is
    that only reads the environment keeps its ``${oc.env:...}`` text, so the run records it, not the secret."""
    native: dict[str, Any] = {}
    origins: dict[str, str] = {}
    user_set: dict[str, bool] = {}
    for entry in table.TABLE:
        if not isinstance(entry, table.Mapped):
            continue
        if "*" in entry.verl and not entry.verl.endswith(".*"):
            continue
        key = entry.verl[:-2] if entry.verl.endswith(".*") else entry.verl
        if not view.has(key):
            continue
        if entry.placeholder and not view.user_set(key):
            continue
        from_user = view.user_set(key)
        where = _first_origin(view.origins, key, user=from_user)
        text = raw.get(key)
        if entry.convert is None and isinstance(text, str) and _ENV_ONLY.match(text):
            updates = {entry.native: text}  # resolved by the native loader, recorded as written
        else:
            updates = entry.apply(view.get(key), view)
        for target, value in updates.items():
            if value is table.SKIP:
                continue
            if target in native and native[target] != value:
                if user_set[target] and from_user:
                    raise ConfigError(f"verl keys give polyrl key '{target}' two values: {native[target]!r} "
                                      f"({origins[target]}) and {value!r} (verl {key}, from {where}); keep one")
                if user_set[target]:
                    continue
            native[target] = value
            user_set[target] = from_user
            # a block mapped key by key (policy_loss.*, filter_groups.*): each key's own origin where verl's tree
            # has a leaf of that name under the block
            leaf = f"{key}.{target.rpartition('.')[2]}"
            if leaf in view.origins and key != leaf:
                origins[target] = f"verl {leaf} ({view.origins[leaf]})"
            else:
                origins[target] = f"verl {key} ({where})"
    return native, origins


# ---------------------------------------------------------------------------- errors in verl's words

#: polyrl phrases whose verl spelling is not one key of the table (checked before the key-by-key rewrite).
_PHRASES = {
    "data.truncation=filter": "data.filter_overlong_prompts=True",
    "data.truncation: filter": "data.filter_overlong_prompts=True",
    "data.truncation to filter/left/right": "data.filter_overlong_prompts=True (or data.truncation=left/right)",
    "reward.function": "custom_reward_function.path",
    "trainer.n_workers": "trainer.nnodes * trainer.n_gpus_per_node",
    "trainer.run_dir": "trainer.default_local_dir",
}


@functools.lru_cache(maxsize=1)
def _spoken() -> tuple[re.Pattern[str], dict[str, str]]:
    """polyrl key -> how a verl-layout config writes it: the table's mapped verl key, or ``+key`` for polyrl's
    own settings (which verl's layout takes only with ``+``)."""
    names: dict[str, str] = dict(_PHRASES)
    # a key verl spells as polyrl does (data.truncation) stays, whatever else maps onto it
    same = {e.native for e in table.TABLE if isinstance(e, table.Mapped) and e.verl == e.native
            and "polyrl only" not in e.note}
    for entry in table.TABLE:
        if not isinstance(entry, table.Mapped) or "*" in entry.verl:
            continue
        native = entry.native
        if not re.fullmatch(r"[A-Za-z_][\w.]*", native) or native in names or native in same:
            continue
        names[native] = f"+{native}" if "polyrl only" in entry.note else entry.verl
    names = {k: v for k, v in names.items() if k != v}
    keys = sorted(names, key=len, reverse=True)
    pattern = re.compile(r"(?<![\w.+])(" + "|".join(re.escape(k) for k in keys) + r")(?![\w]|\.\w)")
    return pattern, names


def speak_verl(message: str) -> str:
    """``message`` (an error about polyrl's keys) with each polyrl key written as a verl-layout config writes it:
    ``rollout.tensor_parallel_size=2`` -> ``actor_rollout_ref.rollout.tensor_model_parallel_size=2``,
    ``trainer.n_workers`` -> ``trainer.nnodes * trainer.n_gpus_per_node``, ``trainer.executor=local`` ->
    ``+trainer.executor=local``, ``data.truncation=filter`` -> ``data.filter_overlong_prompts=True``."""
    pattern, names = _spoken()
    return pattern.sub(lambda m: names[m.group(1)], message)


def reword(exc: PolyrlError, fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
    """Reword ``exc``, raised by a command ``fn(manifest, configs, overrides, *, config_format, config_name, ...)``
    called with ``args`` / ``kwargs``, with :func:`speak_verl` when the config was written in verl's layout (the
    user reads the keys they wrote, or can write)."""
    bound = inspect.signature(fn).bind_partial(*args, **kwargs).arguments
    if exc.args and isinstance(exc.args[0], str) and _is_verl(bound):
        exc.args = (speak_verl(exc.args[0]), *exc.args[1:])


def _is_verl(arguments: Mapping[str, Any]) -> bool:
    from polyrl.config.loader import detect_format

    try:
        return detect_format(arguments.get("configs", ()), arguments.get("overrides", ()),
                             arguments.get("config_format", "auto"), config_name=arguments.get("config_name")) == "verl"
    except PolyrlError:
        return False
