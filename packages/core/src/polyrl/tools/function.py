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
import concurrent.futures
import inspect
import json
import logging
import queue
import re
import threading
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any, Literal, Union, get_args, get_origin

from polyrl.errors import ConfigError, PolyrlError
from polyrl.protocols import ToolResult

__all__ = ["FunctionTool", "ToolError", "ToolSchemaError", "ToolThreads", "check_arguments", "tool",
           "validate_tool_schema"]

logger = logging.getLogger("polyrl")


class ToolThreads(concurrent.futures.Executor):
    """The threads synchronous tools run in, off the event loop, so one slow tool does not stall the others.

    A Python thread cannot be killed, so a tool that hangs keeps its thread. Here that thread is
    *abandoned*: the caller that gave up on the call (the agent loop's ``tool_timeout_s``) says so with
    :meth:`abandon`, the thread no longer counts against ``max_workers`` (a new one serves the next call, so
    later calls are not starved), a warning names the tool, and :attr:`hung` counts the threads still stuck
    (the ``agent/tools_hung`` metric). Threads are daemons: a hung tool never keeps the process from
    exiting after its last step. More than ``max_hung`` stuck threads is a sign that a tool hangs on every
    call: new calls then fail at once with an error naming the tool that hangs, instead of piling up.
    """

    def __init__(self, max_workers: int = 32, *, max_hung: int = 256, name: str = "polyrl-tool") -> None:
        self.max_workers = max_workers
        self.max_hung = max_hung
        self.name = name
        self._work: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads = 0  # live worker threads, hung ones included
        self._idle = 0  # threads waiting for work
        self._pending = 0  # calls in the queue that no thread has taken yet
        self._idle_s = 60.0  # a thread idle this long ends (tests shorten it)
        self._hung: dict[concurrent.futures.Future, str] = {}  # abandoned calls still running -> tool name
        self._warned_at = 0

    @property
    def hung(self) -> int:
        """Threads stuck in calls their callers gave up on."""
        with self._lock:
            return len(self._hung)

    def hung_tools(self) -> list[str]:
        """Names of the tools whose abandoned calls are still running (one entry per stuck thread)."""
        with self._lock:
            return sorted(self._hung.values())

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if len(self._hung) >= self.max_hung:
                names = sorted(set(self._hung.values()))
                future.set_exception(RuntimeError(
                    f"{len(self._hung)} calls of synchronous tools ({', '.join(names)}) hang past their timeout; "
                    "no more threads are started for tool calls. Fix the tool that hangs (or make it async "
                    "with its own timeout)"))
                return future
            self._work.put((future, fn, args, kwargs))
            self._pending += 1
            self._start_threads()
        return future

    def _start_threads(self) -> None:
        """Start a thread for each queued call no idle thread will take, up to ``max_workers`` threads that
        are not hung (called with the lock held)."""
        while self._pending > self._idle and self._threads - len(self._hung) < self.max_workers:
            self._threads += 1
            self._idle += 1  # counted idle from its start: it goes straight to the queue
            threading.Thread(target=self._worker, name=f"{self.name}-{self._threads}", daemon=True).start()

    def abandon(self, future: concurrent.futures.Future, tool: str, timeout_s: float | None = None) -> None:
        """The caller stopped waiting for ``future`` (a call of ``tool``): cancel it if it has not started,
        else count its thread as hung until it returns."""
        if future.cancel() or future.done():
            return
        with self._lock:
            if future.done():
                return
            self._hung[future] = tool
            self._start_threads()  # calls queued behind the hung one get a thread of their own
            count = len(self._hung)
            warn = count >= 2 * self._warned_at or count == 1
            if warn:
                self._warned_at = count
        future.add_done_callback(self._returned)
        if warn:
            after = f" within its {timeout_s:g} s timeout" if timeout_s is not None else ""
            logger.warning("tool '%s' did not return%s; its thread is abandoned and keeps running (%d tool "
                           "thread(s) hang now: %s). Later calls get new threads; a tool that may hang should be "
                           "async with its own timeout, or run a subprocess it can kill", tool, after, count,
                           ", ".join(sorted(set(self.hung_tools()))))

    def _returned(self, future: concurrent.futures.Future) -> None:
        with self._lock:
            self._hung.pop(future, None)

    def _worker(self) -> None:
        # Accounting: ``_pending`` counts queued calls, ``_idle`` the threads waiting for one. A thread that
        # takes a call lowers both together, so they stay in step (a call submitted meanwhile still gets a
        # thread), and a cancelled call, taken and skipped, leaves the thread idle exactly once.
        while True:
            try:
                future, fn, args, kwargs = self._work.get(timeout=self._idle_s)
            except queue.Empty:
                with self._lock:
                    if self._idle > self._pending:  # idle for a while and not needed: give the thread back
                        self._idle -= 1
                        self._threads -= 1
                        return
                continue
            with self._lock:
                self._idle -= 1
                self._pending -= 1
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args, **kwargs))
                except BaseException as exc:  # the tool's failure goes to its caller
                    future.set_exception(exc)
            del future, fn, args, kwargs  # no reference to the last call's values while idle
            with self._lock:
                self._idle += 1

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Nothing to do: the threads are daemons and end with the process (a hung one cannot be joined)."""


#: Synchronous tools run here (see :class:`ToolThreads`), not in asyncio's default executor, which
#: ``asyncio.run`` joins on exit: a hung tool would keep the process from ending.
TOOL_EXECUTOR = ToolThreads()

_NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class ToolError(PolyrlError):
    """A tool did something no model turn can cause and the run cannot use (a NaN or text reward): a bug
    of the tool, named in the message."""


class ToolSchemaError(ConfigError):
    """A tool's schema is not a valid OpenAI function schema (or its parameters not valid JSON Schema)."""


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
    import jsonschema

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
    import jsonschema

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
        inner = _json_type(options[0], where) if len(options) == 1 else {"anyOf": [_json_type(a, where) for a in options]}
        return _nullable(inner) if len(options) < len(args) else inner
    if origin in (list, tuple, set, frozenset, cabc.Sequence):
        return {"type": "array", "items": _json_type(args[0], where)} if args else {"type": "array"}
    if origin in (dict, cabc.Mapping):
        return {"type": "object"}
    raise ToolSchemaError(f"{where}: cannot express type {annotation!r} in JSON Schema; use str, int, float, bool, "
                          "list[...], dict, Literal[...] or Optional[...]")


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` that also accepts ``null`` (an ``Optional[...]`` parameter)."""
    if not schema:
        return schema  # Any: already accepts null
    if isinstance(schema.get("type"), str) and "enum" not in schema:
        return {**schema, "type": [schema["type"], "null"]}
    if "enum" in schema and set(schema) <= {"enum", "description"}:
        return {**schema, "enum": [*schema["enum"], None]}
    if "anyOf" in schema and len(schema) == 1:
        return {"anyOf": [*schema["anyOf"], {"type": "null"}]}
    return {"anyOf": [schema, {"type": "null"}]}


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

    Sync functions run in :data:`TOOL_EXECUTOR` threads (:class:`ToolThreads`). The return value becomes
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
            future = TOOL_EXECUTOR.submit(self.fn, **kwargs)
            try:
                value = await asyncio.wrap_future(future)
            except asyncio.CancelledError:  # the caller's timeout: the thread may be stuck for good
                TOOL_EXECUTOR.abandon(future, self.name)
                raise
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
