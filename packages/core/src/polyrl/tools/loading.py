"""Building the tools a run lists in ``agent.tools`` (registry names or import strings)."""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import Any

from polyrl.errors import ConfigError
from polyrl.tools.function import validate_tool_schema

__all__ = ["build_tools", "check_tool"]


def check_tool(obj: Any, where: str) -> Any:
    """Raise ``ConfigError`` naming ``where`` unless ``obj`` satisfies :class:`polyrl.protocols.Tool`."""
    name = getattr(obj, "name", None)
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{where}: a tool needs a string 'name' attribute, got {type(obj).__name__}")
    if not inspect.iscoroutinefunction(getattr(obj, "execute", None)):
        raise ConfigError(f"{where}: tool '{name}' needs 'async def execute(self, arguments, sample)'")
    obj.schema = validate_tool_schema(getattr(obj, "schema", None), f"{where}: tool '{name}'")
    if obj.schema["function"]["name"] != name:
        raise ConfigError(f"{where}: tool '{name}' has a schema for '{obj.schema['function']['name']}'")
    return obj


def build_tools(specs: Sequence[Any], plugins: Any) -> dict[str, Any]:
    """``{name: Tool}`` from ``agent.tools`` entries.

    An entry is a name in the ``tool`` registry (``calculator``), an import string
    (``my_pkg.tools:lookup``), or a mapping ``{name: ..., <options>}`` whose other keys
    are passed to the tool's factory as its config. A registered object that already
    is a tool (has ``execute`` and ``schema``) is used as it is.
    """
    from polyrl.registry import resolve_import_string

    try:
        from omegaconf import OmegaConf

        specs = OmegaConf.to_container(specs, resolve=True) if OmegaConf.is_config(specs) else specs
    except ImportError:  # pragma: no cover - omegaconf is a core dependency
        pass
    tools: dict[str, Any] = {}
    for i, spec in enumerate(specs or ()):
        where = f"agent.tools[{i}]"
        options: dict[str, Any] = {}
        if isinstance(spec, Mapping):
            options = dict(spec)
            spec = options.pop("name", None)
        if not isinstance(spec, str) or not spec:
            raise ConfigError(f"{where}: expected a tool name, an import string or {{name: ..., ...}}, got {spec!r}")
        target = resolve_import_string(spec) if ":" in spec else plugins.get("tool", spec)
        if callable(getattr(target, "execute", None)) and hasattr(target, "schema") and not options:
            obj = target
        else:
            try:
                obj = target(options or None)
            except TypeError as exc:
                raise ConfigError(f"{where}: building tool '{spec}' failed: {exc}") from exc
        obj = check_tool(obj, f"{where} ('{spec}')")
        if obj.name in tools:
            raise ConfigError(f"{where}: two tools are named '{obj.name}'; list each tool once")
        tools[obj.name] = obj
    return tools
