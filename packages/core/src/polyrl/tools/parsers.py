"""Tool-call parsers: find the calls in a model's turn (registered kind ``tool_parser``).

A parser is any object with ``parse(text) -> ParsedTurn`` (it may also accept ``tools=``: the allowed
tools' OpenAI schemas by name, which ``tool_agent`` passes when the signature takes it). Nothing a model
writes makes a parser raise: a malformed call (invalid JSON, nesting too deep for the decoder, a number
too long to convert, a missing name...) becomes an entry of ``ParsedTurn.errors``, which the agent loop
sends back to the model as a tool message, in the order the model wrote its calls (``ParsedTurn.order``).

Built-ins:

* ``hermes`` (default; Qwen2.5 / Qwen3 / Hermes): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.
* ``qwen3_coder`` (alias ``xml``): ``<tool_call><function=NAME><parameter=KEY>VALUE</parameter></function></tool_call>``;
  values are typed by the tool's JSON schema.
* ``llama3_json`` (alias ``json``): the turn starts with ``{"name": ..., "parameters": {...}}`` (or
  ``"arguments"``), optionally after ``<|python_tag|>``; several calls are a JSON list or separated by
  ``;`` / newlines.
"""

from __future__ import annotations

import ast
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

__all__ = ["HermesParser", "Llama3JsonParser", "ParsedTurn", "Qwen3CoderParser", "ToolCall", "ToolCallParser"]


@dataclass
class ToolCall:
    """One call the model made."""

    name: str
    arguments: dict[str, Any]
    #: The call's id when the model wrote one (Mistral-style ``"id"``); the loop makes one otherwise.
    id: str | None = None


@dataclass
class ParsedTurn:
    """A model turn split into its text, its well-formed calls, and messages for its malformed ones."""

    content: str
    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    #: Calls and error messages in the order the model wrote them (the built-in parsers fill it; a parser
    #: that does not is answered calls first, then errors).
    order: list[ToolCall | str] = field(default_factory=list)

    @property
    def has_calls(self) -> bool:
        """Whether the model tried to call a tool (well-formed or not)."""
        return bool(self.calls or self.errors)

    def in_order(self) -> list[ToolCall | str]:
        """Every call and error message, in the model's order when the parser recorded it."""
        if len(self.order) == len(self.calls) + len(self.errors):
            return list(self.order)
        return [*self.calls, *self.errors]


class ToolCallParser(Protocol):
    """Finds the tool calls in a model's decoded turn."""

    def parse(self, text: str) -> ParsedTurn:
        """Split ``text``; never raises for what the model wrote (malformed calls go to ``errors``)."""
        ...


class _Turn:
    """Collects calls and errors in order."""

    def __init__(self) -> None:
        self.calls: list[ToolCall] = []
        self.errors: list[str] = []
        self.order: list[ToolCall | str] = []

    def add(self, item: ToolCall | str) -> None:
        (self.calls if isinstance(item, ToolCall) else self.errors).append(item)  # type: ignore[arg-type]
        self.order.append(item)

    def done(self, content: str) -> ParsedTurn:
        return ParsedTurn(content, self.calls, self.errors, self.order)


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


_DECODER = json.JSONDecoder(parse_constant=_no_constants)


def _json_error(exc: Exception, body: str) -> str:
    """The message for JSON the model got wrong, whatever the decoder raised."""
    if isinstance(exc, json.JSONDecodeError):
        return f"tool call is not valid JSON: {exc.msg} (at char {exc.pos}) in {body[:80]!r}"
    if isinstance(exc, RecursionError):
        return f"tool call is nested too deeply to decode in {body[:80]!r}"
    return f"tool call is not valid JSON: {str(exc)[:200]} in {body[:80]!r}"


def _loads(body: str) -> Any:
    """``json.loads`` without NaN/Infinity (not JSON); raises ValueError / RecursionError like it."""
    obj, end = _DECODER.raw_decode(body, _skip_ws(body, 0))
    if _skip_ws(body, end) != len(body):
        raise json.JSONDecodeError("Extra data", body, _skip_ws(body, end))
    return obj


def _skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    return pos


def _call_from_json(obj: Any, arg_keys: tuple[str, ...] = ("arguments",)) -> ToolCall | str:
    """A :class:`ToolCall` from a decoded JSON object, or an error message."""
    if not isinstance(obj, dict):
        return f"a tool call must be a JSON object with 'name' and 'arguments', got {type(obj).__name__}"
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return "a tool call needs a string 'name'"
    args: Any = {}
    for key in arg_keys:
        if key in obj:
            args = obj[key]
            break
    if isinstance(args, str):  # OpenAI style: arguments as a JSON string
        try:
            args = _loads(args) if args.strip() else {}
        except (ValueError, RecursionError) as exc:
            detail = f"{exc.msg} (at char {exc.pos})" if isinstance(exc, json.JSONDecodeError) else str(exc)[:200]
            return f"the arguments of '{name}' are not valid JSON: {detail}"
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return f"the arguments of '{name}' must be a JSON object, got {type(args).__name__}"
    call_id = obj.get("id")
    return ToolCall(name, args, call_id if isinstance(call_id, str) else None)


def _parse_safely(parse: Any) -> Any:
    """Decorate a ``parse`` method: an exception it did not foresee is a malformed turn, not a crash."""

    def wrapper(self: Any, text: str, tools: Mapping[str, Any] | None = None) -> ParsedTurn:
        try:
            return parse(self, text, tools)
        except Exception as exc:  # nothing a model writes may end a run
            message = f"the tool calls could not be parsed: {type(exc).__name__}: {str(exc)[:200]}"
            return ParsedTurn(text.strip(), [], [message], [message])

    wrapper.__doc__ = parse.__doc__
    wrapper.__name__ = parse.__name__
    return wrapper


class HermesParser:
    """``<tool_call>{json}</tool_call>`` blocks; text outside them is the turn's content."""

    _BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)

    @_parse_safely
    def parse(self, text: str, tools: Mapping[str, Any] | None = None) -> ParsedTurn:
        """The turn's calls, in order; ``tools`` is not needed (JSON carries the types)."""
        turn = _Turn()
        for m in self._BLOCK.finditer(text):
            body = m.group(1).strip()
            try:
                obj = _loads(body)
            except (ValueError, RecursionError) as exc:
                turn.add(_json_error(exc, body))
                continue
            turn.add(_call_from_json(obj))
        rest = self._BLOCK.sub("", text)
        if "<tool_call>" in rest:
            turn.add("a <tool_call> was opened but never closed with </tool_call>")
            rest = rest.split("<tool_call>", 1)[0]
        return turn.done(rest.strip())


class Qwen3CoderParser:
    """Qwen3-coder's XML calls: ``<function=NAME>`` with ``<parameter=KEY>VALUE</parameter>`` children.

    A ``<tool_call>`` block may hold several functions (each is a call); a ``<function=...>`` outside any
    block is a call too. A value is the text between the tags, less the one newline the format puts after
    the opening and before the closing tag (its own newlines are kept); a ``</parameter>`` the model left
    out ends at the next ``<parameter=`` or ``</function>``. Values are typed by the tool's JSON schema
    (``tools``): a ``string`` parameter keeps its text even when it looks like a number, ``integer`` /
    ``number`` / ``boolean`` / ``null`` are converted, ``object`` / ``array`` are decoded as JSON (or a
    Python literal); a value that does not convert stays text, so the schema check reports it to the model.
    Without a schema for the parameter, a value that parses as JSON is decoded, else kept as text.
    """

    _BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)
    _FUNC = re.compile(r"<function=([^>\s]*)>(.*?)</function>", re.S)
    _PARAM = re.compile(r"<parameter=([^>\s]*)>(.*?)(?:</parameter>|(?=<parameter=)|\Z)", re.S)

    @_parse_safely
    def parse(self, text: str, tools: Mapping[str, Any] | None = None) -> ParsedTurn:
        """The turn's calls, in order; ``tools`` (``{name: OpenAI schema}``) types the values."""
        found: list[tuple[int, ToolCall | str]] = []  # (position in text, call or error)
        for m in self._BLOCK.finditer(text):
            body = m.group(1)
            calls = [(m.start() + fm.start(), self._call(fm.group(1), fm.group(2), tools))
                     for fm in self._FUNC.finditer(body)]
            found += calls
            if "<function=" in self._FUNC.sub("", body):
                found.append((m.start(), "a <function=...> was not closed with </function>"))
            elif not calls:
                found.append((m.start(), f"a <tool_call> must hold <function=NAME>...</function>; "
                                         f"got {body.strip()[:80]!r}"))
        rest = self._BLOCK.sub(lambda m: "\0" * len(m.group(0)), text)  # same positions, blocks blanked
        unclosed = rest.find("<tool_call>")
        if unclosed >= 0:
            found.append((unclosed, "a <tool_call> was opened but never closed with </tool_call>"))
            rest = rest[:unclosed]
        for fm in self._FUNC.finditer(rest):  # functions written without a <tool_call> around them
            found.append((fm.start(), self._call(fm.group(1), fm.group(2), tools)))
        turn = _Turn()
        for _, item in sorted(found, key=lambda pair: pair[0]):
            turn.add(item)
        return turn.done(self._FUNC.sub("", rest).replace("\0", "").strip())

    def _call(self, name: str, body: str, tools: Mapping[str, Any] | None) -> ToolCall | str:
        if not name:
            return "a <function=NAME> needs a name"
        props = _properties(tools, name)
        args: dict[str, Any] = {}
        for pm in self._PARAM.finditer(body):
            key, raw = pm.group(1), pm.group(2)
            raw = raw[1:] if raw.startswith("\n") else raw
            raw = raw[:-1] if raw.endswith("\n") else raw
            if key in args:
                return f"'{name}': parameter '{key}' is given twice"
            args[key] = _typed(raw, props.get(key)) if props is not None and key in props else _untyped(raw)
        return ToolCall(name, args)


def _properties(tools: Mapping[str, Any] | None, name: str) -> dict[str, Any] | None:
    schema = (tools or {}).get(name)
    if not isinstance(schema, Mapping):
        return None
    fn = schema.get("function", schema)
    props = (fn.get("parameters") or {}).get("properties") if isinstance(fn, Mapping) else None
    return dict(props) if isinstance(props, Mapping) else None


def _schema_types(schema: Any) -> list[str]:
    """The JSON types a parameter schema allows, in order (``type``, a type list, ``anyOf``/``oneOf``, enum)."""
    if not isinstance(schema, Mapping):
        return []
    kind = schema.get("type")
    if isinstance(kind, str):
        return [kind]
    if isinstance(kind, list):
        return [k for k in kind if isinstance(k, str)]
    out: list[str] = []
    for key in ("anyOf", "oneOf"):
        for option in schema.get(key) or []:
            out += [t for t in _schema_types(option) if t not in out]
    if not out and isinstance(schema.get("enum"), list):
        names = {str: "string", bool: "boolean", int: "integer", float: "number", type(None): "null"}
        for value in schema["enum"]:
            t = names.get(type(value))
            if t and t not in out:
                out.append(t)
    return out


def _typed(raw: str, schema: Any) -> Any:
    """``raw`` converted to the first type of ``schema`` it converts to (text when none fits)."""
    types_ = _schema_types(schema)
    if not types_:
        return _untyped(raw)
    text = raw.strip()
    if "null" in types_ and text.lower() in ("null", "none"):
        return None
    for kind in [t for t in types_ if t != "null"]:
        if kind == "string":
            return raw
        if kind == "integer" and re.fullmatch(r"[+-]?\d{1,4000}", text):
            return int(text)
        if kind == "number" and re.fullmatch(r"[+-]?(\d{1,4000}(\.\d*)?|\.\d+)([eE][+-]?\d+)?", text):
            value = float(text)
            if math.isfinite(value):
                return int(text) if re.fullmatch(r"[+-]?\d+", text) else value
        if kind == "boolean" and text.lower() in ("true", "false"):
            return text.lower() == "true"
        if kind in ("object", "array"):
            value = _structured(text)
            if isinstance(value, dict if kind == "object" else list):
                return value
    return raw


def _structured(text: str) -> Any:
    try:
        return _loads(text)
    except (ValueError, RecursionError):
        pass
    if len(text) > 100_000:
        return None
    try:
        return ast.literal_eval(text)  # Python literals (single quotes, True/None) models sometimes write
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return None


def _untyped(raw: str) -> Any:
    try:
        return _loads(raw)
    except (ValueError, RecursionError):
        return raw


class Llama3JsonParser:
    """Llama-3.x JSON calls: the turn starts with ``{"name": ..., "parameters": {...}}`` (or a list of them).

    Several calls may follow each other separated by ``;`` and/or whitespace; text after the last call is
    the turn's content. A turn that does not start with ``{`` / ``[`` (after an optional ``<|python_tag|>``)
    is a plain answer. A ``;`` inside a JSON string is part of the value, never a separator.
    """

    @_parse_safely
    def parse(self, text: str, tools: Mapping[str, Any] | None = None) -> ParsedTurn:
        """The turn's calls, in order; ``tools`` is not needed (JSON carries the types)."""
        body = text.strip()
        if body.startswith("<|python_tag|>"):
            body = body[len("<|python_tag|>"):].strip()
        if not body.startswith(("{", "[")):
            return ParsedTurn(text.strip())
        turn = _Turn()
        pos = 0
        while pos < len(body):
            try:
                obj, end = _DECODER.raw_decode(body, pos)
            except (ValueError, RecursionError) as exc:
                turn.add(_json_error(exc, body[pos:]))
                return turn.done("")
            for item in obj if isinstance(obj, list) else [obj]:
                turn.add(_call_from_json(item, ("parameters", "arguments")))
            pos = _skip_ws(body, end)
            if pos < len(body) and body[pos] == ";":
                pos = _skip_ws(body, pos + 1)
            if pos < len(body) and body[pos] not in "{[":
                return turn.done(body[pos:].strip())  # prose after the calls
        return turn.done("")
