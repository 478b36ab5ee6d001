"""Tools from typed Python functions, and validation of OpenAI function schemas.

::

    from polyrl.tools import tool

    @tool
    def lookup(city: str, unit: Literal["c", "f"] = "c") -> str:
        \"\"\"Current temperature of a city.

        Args:
            city: The city's name.
            unit: Celsius or Fahrenheit.
        \"\"\"
        ...

``lookup`` is now a :class:`FunctionTool` named ``lookup`` whose ``schema`` is the
OpenAI function schema built from the signature (types) and the docstring (the
description and the ``Args:`` section). A parameter named ``sample`` is not part
of the schema: it receives the dataset row the agent loop is working on.
"""

from __future__ import annotations

import asyncio
import collections.abc as cabc
import inspect
import json
import re
import types
import typing
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal, Union, get_args, get_origin

from polyrl.errors import ConfigError
from polyrl.protocols import ToolResult

__all__ = ["FunctionTool", "ToolSchemaError", "check_arguments", "tool", "validate_tool_schema"]

#: Synchronous tools run here, off the event loop, so one slow tool does not stall other agent loops.
#: A dedicated pool (not asyncio's default executor) so a hung tool never blocks ``asyncio.run`` from returning.
TOOL_EXECUTOR = ThreadPoolExecutor(max_workers=32, thread_name_prefix="polyrl-tool")

_NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class ToolSchemaError(ConfigError):
    """A tool's schema is not a valid OpenAI function schema (or its parameters not valid JSON Schema)."""


#: What installs the JSON Schema checker the tools need.
TOOLS_INSTALL = "pip install 'polyrl[tools]'"


def require_jsonschema() -> Any:
    """The ``jsonschema`` module (an extra of polyrl: ``polyrl[tools]``), or a ConfigError with the install line."""
    try:
        import jsonschema
    except ImportError:
        from polyrl.errors import ConfigError

        raise ConfigError(f"agent tools check their JSON schemas and arguments with jsonschema, which is not "
                          f"installed: {TOOLS_INSTALL}") from None
    return jsonschema


def validate_tool_schema(schema: Any, where: str = "tool") -> dict[str, Any]:
    """Check an OpenAI function schema; return it, or raise :class:`ToolSchemaError` naming what is wrong.

    Accepts ``{"type": "function", "function": {...}}`` or the inner ``{"name", "description",
    "parameters"}`` (returned wrapped). ``parameters`` must be a JSON Schema object schema, checked
    against the JSON Schema 2020-12 meta-schema with ``jsonschema``.
    """
    if not isinstance(schema, Mapping):
        raise ToolSchemaError(f"{where}: schema must be a mapping, got {type(schema).__name__}")
    fn = schema.get("function") if schema.get("type") == "function" else schema
    if not isinstance(fn, Mapping):
        raise ToolSchemaError(f"{where}: schema['function'] must be a mapping")
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ToolSchemaError(f"{where}: function name {name!r} must match {_NAME_RE.pattern}")
    if not isinstance(fn.get("description", ""), str):
        raise ToolSchemaError(f"{where}: 'description' of '{name}' must be a string")
    params = fn.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(params, Mapping) or params.get("type") != "object":
        raise ToolSchemaError(f"{where}: 'parameters' of '{name}' must be a JSON Schema with type 'object'")
    jsonschema = require_jsonschema()
    try:
        jsonschema.Draft202012Validator.check_schema(dict(params))
    except jsonschema.SchemaError as exc:
        path = "/".join(str(p) for p in exc.path) or "(root)"
        raise ToolSchemaError(f"{where}: 'parameters' of '{name}' is not valid JSON Schema at {path}: {exc.message}") from exc
    required = params.get("required", [])
    unknown = [r for r in required if r not in (params.get("properties") or {})]
    if unknown:
        raise ToolSchemaError(f"{where}: '{name}' requires {unknown}, which are not in its properties")
    return {"type": "function", "function": {"name": name, "description": fn.get("description", ""),
                                             "parameters": dict(params)}}


def check_arguments(schema: Mapping[str, Any], arguments: Any) -> None:
    """Raise ``ValueError`` (shown to the model) when ``arguments`` do not match the tool's parameters."""
    if not isinstance(arguments, Mapping):
        raise ValueError(f"arguments must be a JSON object, got {type(arguments).__name__}")
    jsonschema = require_jsonschema()
    params = schema["function"]["parameters"]
    errors = sorted(jsonschema.Draft202012Validator(params).iter_errors(dict(arguments)), key=lambda e: list(e.path))
    if errors:
        e = errors[0]
        at = "/".join(str(p) for p in e.path)
        raise ValueError(f"invalid arguments{' at ' + at if at else ''}: {e.message}")


# ---------------------------------------------------------------------- schema from a signature

_SIMPLE = {str: "string", int: "integer", float: "number", bool: "boolean", dict: "object", list: "array"}


def _json_type(annotation: Any, where: str) -> dict[str, Any]:
    if annotation is inspect.Parameter.empty or annotation is Any:
        return {}
    if annotation in _SIMPLE:
        return {"type": _SIMPLE[annotation]}
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Literal:
        return {"enum": list(args)}
    if origin in (Union, types.UnionType):
        options = [a for a in args if a is not type(None)]
        if len(options) == 1:
            return _json_type(options[0], where)
        return {"anyOf": [_json_type(a, where) for a in options]}
    if origin in (list, tuple, set, frozenset, cabc.Sequence):
        return {"type": "array", "items": _json_type(args[0], where)} if args else {"type": "array"}
    if origin in (dict, cabc.Mapping):
        return {"type": "object"}
    raise ToolSchemaError(f"{where}: cannot express type {annotation!r} in JSON Schema; use str, int, float, bool, "
                          "list[...], dict, Literal[...] or Optional[...]")


def _docstring_parts(doc: str) -> tuple[str, dict[str, str]]:
    """The description (text before ``Args:``) and each parameter's description (Google style)."""
    doc = inspect.cleandoc(doc or "")
    head, _, rest = doc.partition("\nArgs:")
    if not rest:
        head, _, rest = doc.partition("\nParameters:")
    params: dict[str, str] = {}
    current = None
    for line in rest.splitlines():
        if line.strip() and not line.startswith((" ", "\t")):  # next section (Returns:)
            break
        m = re.match(r"^\s+(\*{0,2}\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$", line)
        if m:
            current = m.group(1)
            params[current] = m.group(2).strip()
        elif current and line.strip():
            params[current] += " " + line.strip()
    return " ".join(head.split("\n\n")[0].split()), params


class FunctionTool:
    """A :class:`polyrl.protocols.Tool` around a Python function (sync or async).

    Sync functions run in :data:`TOOL_EXECUTOR` threads. The return value becomes
    the tool message: a ``str``, a :class:`ToolResult` (with a ``reward``), or
    anything ``json.dumps`` accepts; anything else is an error shown to the model.
    Being its own factory (``tool_obj(config)`` returns it), it can be registered
    directly with ``register_tools``.
    """

    def __init__(self, fn: Callable[..., Any], *, name: str | None = None, description: str | None = None,
                 schema: Mapping[str, Any] | None = None) -> None:
        self.fn = fn
        self.name = name or fn.__name__
        where = f"tool '{self.name}' ({getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', '?')})"
        self._wants_sample = "sample" in inspect.signature(fn).parameters
        self.schema = validate_tool_schema(schema if schema is not None else self._schema_from_signature(where), where)
        if self.schema["function"]["name"] != self.name:
            raise ToolSchemaError(f"{where}: schema names the function '{self.schema['function']['name']}'")
        self._description_override = description
        if description is not None:
            self.schema["function"]["description"] = description

    def _schema_from_signature(self, where: str) -> dict[str, Any]:
        sig = inspect.signature(self.fn)
        try:
            hints = typing.get_type_hints(self.fn)
        except Exception as exc:  # unresolvable forward references
            raise ToolSchemaError(f"{where}: cannot resolve the type hints: {exc}") from exc
        description, docs = _docstring_parts(self.fn.__doc__ or "")
        if not description:
            raise ToolSchemaError(f"{where}: the function needs a docstring (the tool's description for the model)")
        props: dict[str, Any] = {}
        required: list[str] = []
        for pname, p in sig.parameters.items():
            if pname == "sample":
                continue
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                raise ToolSchemaError(f"{where}: *args / **kwargs cannot be described to the model")
            prop = _json_type(hints.get(pname, p.annotation), f"{where} parameter '{pname}'")
            if pname in docs:
                prop["description"] = docs[pname]
            if p.default is inspect.Parameter.empty:
                required.append(pname)
            elif isinstance(p.default, (str, int, float, bool)) or p.default is None:
                prop["default"] = p.default
            props[pname] = prop
        return {"type": "function", "function": {
            "name": self.name, "description": description,
            "parameters": {"type": "object", "properties": props, "required": required}}}

    def __call__(self, config: Any = None) -> FunctionTool:
        """Factory form for the ``tool`` registry: the tool itself."""
        return self

    async def execute(self, arguments: dict[str, Any], sample: Mapping[str, Any]) -> ToolResult:
        """Check ``arguments`` against the schema, call the function, and turn its value into a ToolResult."""
        check_arguments(self.schema, arguments)
        kwargs = dict(arguments)
        if self._wants_sample:
            kwargs["sample"] = sample
        if inspect.iscoroutinefunction(self.fn):
            value = await self.fn(**kwargs)
        else:
            loop = asyncio.get_running_loop()
            value = await loop.run_in_executor(TOOL_EXECUTOR, lambda: self.fn(**kwargs))
        return to_tool_result(value, self.name)


def to_tool_result(value: Any, name: str) -> ToolResult:
    """A tool's return value as a :class:`ToolResult`; ``TypeError`` for values that are not text or JSON."""
    if isinstance(value, ToolResult):
        if not isinstance(value.text, str):
            raise TypeError(f"tool '{name}' returned a ToolResult whose text is {type(value.text).__name__}, not str")
        return value
    if isinstance(value, str):
        return ToolResult(text=value)
    try:
        return ToolResult(text=json.dumps(value))
    except (TypeError, ValueError) as exc:
        raise TypeError(f"tool '{name}' returned {type(value).__name__}, which is neither text nor JSON") from exc


def tool(fn: Callable[..., Any] | None = None, *, name: str | None = None,
         description: str | None = None) -> Any:
    """Decorator: a :class:`FunctionTool` from a typed, documented function (``@tool`` or ``@tool(name=...)``)."""
    if fn is None:
        return lambda f: FunctionTool(f, name=name, description=description)
    return FunctionTool(fn, name=name, description=description)
