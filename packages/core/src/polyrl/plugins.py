"""The plugin manager: loads built-ins, installed plugins and manifest modules, fills the registries.

Every process (the driver, each Ray worker) builds its own :class:`PluginManager`
from the same :class:`~polyrl.manifest.Manifest`, so registrations reach remote
workers without pickling registries. :func:`get_plugin_manager` returns the
process-wide one; :func:`activate` sets it from a manifest.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import logging
import os
import traceback
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pluggy

from polyrl import hookspecs
from polyrl.errors import PluginLoadError, RegistryError
from polyrl.manifest import Manifest
from polyrl.registry import HOOK_FOR_KIND, Entry, PluginInfo, Registry

ENTRY_POINT_GROUP = "polyrl"
#: ``POLYRL_TRACE_HOOKS=1``: every hook call and ``register(...)``, at INFO
_trace_log = logging.getLogger("polyrl.hooks")

#: The core's own components, registered through the same hooks as any plugin.
DEFAULT_PLUGINS: list[str] = [
    "polyrl.platforms.hooks",
    "polyrl.algorithms.hooks",
    "polyrl.rollout.hooks",
    "polyrl.agent_loops.hooks",
    "polyrl.tools.hooks",
    "polyrl.rewards.hooks",
    "polyrl.reward_models.hooks",
    "polyrl.sandboxes.hooks",
    "polyrl.environments.hooks",
    "polyrl.data.hooks",
]


class PluginManager:
    """Plugins of one process and the registries they filled.

    ``manifest=None`` loads every installed plugin; a manifest loads the core's
    built-ins, the distributions it requires and its ``modules``, minus ``block``.
    ``entry_points=False`` loads the built-ins only (tests).
    """

    def __init__(self, manifest: Manifest | None = None, *, entry_points: bool = True) -> None:
        self.manifest = manifest
        self.pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        self.pm.add_hookspecs(hookspecs)
        self.plugins: dict[str, PluginInfo] = {}
        self.registries: dict[str, Registry] = {kind: Registry(kind) for kind in HOOK_FOR_KIND}
        for kind, registry in self.registries.items():
            registry.unloaded_providers = lambda name, kind=kind: self.unloaded_providers(kind, name)
        self._trace = os.environ.get("POLYRL_TRACE_HOOKS", "") not in ("", "0")
        if self._trace:  # the trace is asked for: make sure it reaches stderr, whatever logging is configured
            from polyrl.logs import setup_console_logging

            setup_console_logging()
        if self._trace:
            self.pm.add_hookcall_monitoring(self._trace_before, self._trace_after)
        self.versions = manifest.check_requirements() if manifest is not None else {}

        from polyrl.__about__ import __version__

        for module_name in DEFAULT_PLUGINS:
            if manifest is not None and manifest.is_blocked(module_name):
                continue
            module = _import_plugin_module(module_name, f"built-in plugin '{module_name}'")
            self.add_plugin(module, PluginInfo(module_name, "polyrl", __version__, module_name))
        if entry_points:
            self._load_entry_points()
        for module_name in manifest.modules if manifest is not None else ():
            if manifest.is_blocked(module_name):
                continue
            where = f"manifest {manifest.source or '<manifest>'} plugins.modules entry '{module_name}'"
            module = _import_plugin_module(module_name, where)
            if self.pm.is_registered(module):
                continue  # already loaded through an entry point or as a built-in
            self.add_plugin(module, PluginInfo(module_name, None, None, module_name))

    # ------------------------------------------------------------------ loading
    def _load_entry_points(self) -> None:
        wanted = self.manifest.required_distributions() if self.manifest is not None else None
        from packaging.utils import canonicalize_name

        for ep in sorted(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
            dist = ep.dist.name if ep.dist is not None else None
            version = ep.dist.version if ep.dist is not None else None
            if wanted is not None and (dist is None or canonicalize_name(dist) not in wanted):
                continue
            if self.manifest is not None and self.manifest.is_blocked(ep.name, dist, ep.module):
                continue
            if ep.name in self.plugins:
                continue  # the same distribution seen twice on sys.path
            try:
                module = ep.load()
            except Exception as exc:
                raise PluginLoadError(
                    f"plugin '{ep.name}' ({dist} {version}, entry point '{ep.value}') failed to import:\n"
                    f"{traceback.format_exc()}\nFix or uninstall {dist}, or block it in the manifest."
                ) from exc
            self.add_plugin(module, PluginInfo(ep.name, dist, version, ep.module))

    def unloaded_providers(self, kind: str, name: str | None = None, *, data_source: str | None = None) -> str:
        """For an error about a name no loaded plugin registers: which installed plugin that this manifest does not
        require registers ``kind`` ``name`` (or, with ``data_source``, a reward function for that data source), as one
        sentence saying what to add to the manifest; ``""`` when none does.

        Only called on that error path: it imports the hook modules of the plugins not required (cheap by design,
        DESIGN.md) and runs their registration hook against a throw-away register. Blocked plugins are not
        imported (the manifest said not to load them)."""
        if self.manifest is None:
            return ""  # every installed plugin is loaded
        where = self.manifest.source or "your manifest"
        loaded = {info.distribution for info in self.plugins.values()}
        for ep in sorted(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
            dist = ep.dist.name if ep.dist is not None else None
            if dist is None or dist in loaded or self.manifest.is_blocked(ep.name, dist, ep.module):
                continue
            if _registers(ep, HOOK_FOR_KIND[kind], name, data_source):
                return f"installed {dist} provides it: add it to [plugins].require in {where}."
        return ""

    def add_plugin(self, plugin: ModuleType | object, info: PluginInfo) -> None:
        """Register ``plugin`` (a hooks module or object) and collect its registrations."""
        if info.name in self.plugins:
            raise PluginLoadError(
                f"{info.describe()} is loaded twice. Give it another name, or remove the first one "
                "(PluginManager.remove_plugin) before adding it again."
            )
        try:
            self.pm.register(plugin, name=info.name)
        except pluggy.PluginValidationError as exc:
            # e.g. a hook implementation whose argument is not one the hook offers: `def register_tools(reg)`
            raise PluginLoadError(
                f"{info.describe()} has an invalid hook implementation: {exc}. A hook implementation may only "
                "take arguments the hook offers (every registration hook offers 'register')."
            ) from None
        except ValueError as exc:  # pluggy: the same module/object registered under another name
            other = self.pm.get_name(plugin)
            raise PluginLoadError(
                f"{info.describe()} is already loaded as plugin '{other}' ({exc}); a hooks module loads once. "
                "Remove the duplicate entry point or manifest modules entry."
            ) from None
        try:
            self.pm.check_pending()
        except pluggy.PluginValidationError as exc:
            self.pm.unregister(name=info.name)
            raise PluginLoadError(
                f"{info.describe()} implements a hook that polyrl does not define: {exc}. "
                f"Known hooks: {', '.join(sorted(HOOK_FOR_KIND.values()))}."
            ) from None
        self.plugins[info.name] = info
        try:
            self._collect(info)
        except Exception:
            self.remove_plugin(info.name)
            raise

    def remove_plugin(self, name: str) -> None:
        """Unregister plugin ``name`` and drop every name it registered."""
        for registry in self.registries.values():
            registry.unregister_plugin(name)
        if self.pm.get_plugin(name) is not None:
            self.pm.unregister(name=name)
        self.plugins.pop(name, None)

    def _collect(self, info: PluginInfo) -> None:
        """Call each registration hook of one plugin with a ``register`` bound to it."""
        plugin = self.pm.get_plugin(info.name)
        for kind, hook_name in HOOK_FOR_KIND.items():
            registry = self.registries[kind]
            for impl in getattr(self.pm.hook, hook_name).get_hookimpls():
                if impl.plugin is not plugin:
                    continue

                def register(name: str, obj: Any, _registry: Registry = registry, **metadata: Any) -> None:
                    _registry.register(name, obj, plugin=info, **metadata)
                    if self._trace:
                        _trace_log.info("[polyrl hooks]   register(%s %r)", _registry.kind, name)

                if self._trace:
                    _trace_log.info("[polyrl hooks] %s() -> %s", hook_name, info.name)
                kwargs = {"register": register}
                try:
                    impl.function(**{k: v for k, v in kwargs.items() if k in impl.argnames})
                except RegistryError:
                    raise
                except Exception as exc:
                    raise PluginLoadError(
                        f"{info.describe()} raised in {hook_name}:\n{traceback.format_exc()}"
                    ) from exc

    def _trace_before(self, hook_name: str, impls: list, kwargs: dict) -> None:
        _trace_log.info("[polyrl hooks] %s(%s) -> %s", hook_name, ", ".join(kwargs), [i.plugin_name for i in impls])

    def _trace_after(self, outcome: Any, hook_name: str, impls: list, kwargs: dict) -> None:
        _trace_log.info("[polyrl hooks] %s returned", hook_name)

    # ------------------------------------------------------------------ lookups
    def registry(self, kind: str) -> Registry:
        """The registry of ``kind`` (``engine``, ``rollout``...)."""
        try:
            return self.registries[kind]
        except KeyError:
            raise RegistryError(f"unknown component kind '{kind}'; kinds: {', '.join(HOOK_FOR_KIND)}") from None

    def get(self, kind: str, name: str) -> Any:
        """The loaded object registered as ``name`` in ``kind``."""
        return self.registry(kind).get(name)

    def entry(self, kind: str, name: str) -> Entry:
        """The registry entry (with metadata and owning plugin) for ``name``."""
        return self.registry(kind).entry(name)

    def hooks_of(self, name: str) -> list[str]:
        """Names of the hooks plugin ``name`` implements."""
        plugin = self.pm.get_plugin(name)
        return sorted(hc.name for hc in self.pm.get_hookcallers(plugin) or [])

    def describe(self) -> list[dict[str, Any]]:
        """Every plugin with its distribution, version, hooks and registered names by kind.

        Each item: ``name``, ``distribution``, ``version``, ``module``, ``hooks`` (sorted hook
        names), ``registered`` (``{kind: [name, ...]}``) and ``entries`` (``{kind: [{name, target,
        aliases, description}]}``), plugins in load order. ``polyrl plugins --json`` prints it.
        """
        out = []
        for name, info in self.plugins.items():
            names: dict[str, list[str]] = {}
            entries: dict[str, list[dict[str, Any]]] = {}
            for kind, registry in self.registries.items():
                mine = [e for e in registry.entries() if e.plugin.name == name]
                if mine:
                    names[kind] = [e.name for e in mine]
                    entries[kind] = [
                        {
                            "name": e.name,
                            "target": e.target_name,
                            "aliases": list(e.metadata.get("aliases", [])),
                            "description": e.metadata.get("description"),
                        }
                        for e in mine
                    ]
            out.append(
                {
                    "name": name,
                    "distribution": info.distribution,
                    "version": info.version,
                    "module": info.module,
                    "hooks": self.hooks_of(name),
                    "registered": names,
                    "entries": entries,
                }
            )
        return out


def _registers(ep: Any, hook_name: str, name: str | None, data_source: str | None) -> bool:
    """Whether entry point ``ep``'s hook module registers ``name`` (or a reward function for ``data_source``)
    through ``hook_name``; a module that fails to import or to register counts as not (this is only a hint)."""
    names: list[tuple[str, dict]] = []
    try:
        module = ep.load()
        impl = getattr(module, hook_name, None)
        if impl is None:
            return False
        impl(register=lambda n, obj, **metadata: names.append((n, metadata)))
    except Exception:  # a broken plugin is reported when it is loaded; here it is simply no provider
        return False
    for registered, metadata in names:
        aliases = metadata.get("aliases") or ()
        if name is not None and (registered == name or name in ([aliases] if isinstance(aliases, str) else aliases)):
            return True
        if data_source is not None and data_source in (metadata.get("data_sources") or ()):
            return True
    return False


def _import_plugin_module(module_name: str, where: str) -> ModuleType:
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and (module_name == exc.name or module_name.startswith(exc.name + ".")):
            # the module itself is missing (not one of its imports): a path problem, no traceback needed
            raise PluginLoadError(
                f"{where} failed to import: no module named '{exc.name}'. Install the package that provides it, "
                "or put its folder on PYTHONPATH (for every process of the run, Ray workers included)."
            ) from exc
        raise PluginLoadError(f"{where} failed to import:\n{traceback.format_exc()}") from exc
    except Exception as exc:
        raise PluginLoadError(f"{where} failed to import:\n{traceback.format_exc()}") from exc


# ---------------------------------------------------------------------- the process-wide manager

_current: PluginManager | None = None


def get_plugin_manager() -> PluginManager:
    """The process-wide plugin manager; with none activated, every installed plugin loads."""
    global _current
    if _current is None:
        _current = PluginManager(None)
    return _current


def activate(manifest: Manifest | str | Path | None) -> PluginManager:
    """Build the process-wide plugin manager from ``manifest`` (a path, a Manifest, or None)."""
    global _current
    if isinstance(manifest, (str, Path)):
        manifest = Manifest.load(manifest)
    _current = PluginManager(manifest)
    return _current


@contextlib.contextmanager
def use_plugin_manager(pm: PluginManager) -> Iterator[PluginManager]:
    """Make ``pm`` the process-wide manager inside a ``with`` block (tests, embedding)."""
    global _current
    previous, _current = _current, pm
    try:
        yield pm
    finally:
        _current = previous


def lookup(kind: str, name: str) -> Any:
    """Shortcut: ``get_plugin_manager().get(kind, name)``."""
    return get_plugin_manager().get(kind, name)
