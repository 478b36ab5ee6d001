"""Tool-call parsers: find the calls in a model's turn (registered kind ``tool_parser``).

A parser is any object with ``parse(text) -> ParsedTurn``. A malformed call is
never an exception: it becomes an entry of ``ParsedTurn.errors``, which the agent
loop sends back to the model as a tool message, so the model can learn to call
tools properly.

Built-ins:

* ``hermes`` (default; Qwen2.5 / Hermes): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.
* ``qwen3_coder`` (alias ``xml``): ``<tool_call><function=NAME><parameter=KEY>VALUE</parameter></function></tool_call>``.
* ``llama3_json`` (alias ``json``): the whole turn is ``{"name": ..., "parameters": {...}}`` (or
  ``"arguments"``), optionally after ``<|python_tag|>``, or a JSON list of such objects.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Protocol

__all__ = ["HermesParser", "Llama3JsonParser", "ParsedTurn", "Qwen3CoderParser", "ToolCall", "ToolCallParser"]


@dataclass
class ToolCall:
    """One call the model made."""

    name: str
    arguments: dict[str, Any]


@dataclass
class ParsedTurn:
    """A model turn split into its text, its well-formed calls, and messages for its malformed ones."""

    content: str
    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def has_calls(self) -> bool:
        """Whether the model tried to call a tool (well-formed or not)."""
        return bool(self.calls or self.errors)


class ToolCallParser(Protocol):
    """Finds the tool calls in a model's decoded turn."""

    def parse(self, text: str) -> ParsedTurn:
        """Split ``text``; never raises for malformed calls (they go to ``errors``)."""
        ...


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
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as exc:
            return f"the arguments of '{name}' are not valid JSON: {exc.msg} (at char {exc.pos})"
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return f"the arguments of '{name}' must be a JSON object, got {type(args).__name__}"
    return ToolCall(name, args)


class HermesParser:
    """``<tool_call>{json}</tool_call>`` blocks; text outside them is the turn's content."""

    _BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)

    def parse(self, text: str) -> ParsedTurn:
        calls: list[ToolCall] = []
        errors: list[str] = []
        for m in self._BLOCK.finditer(text):
            body = m.group(1).strip()
            try:
                obj = json.loads(body)
            except json.JSONDecodeError as exc:
                errors.append(f"tool call is not valid JSON: {exc.msg} (at char {exc.pos}) in {body[:80]!r}")
                continue
            call = _call_from_json(obj)
            (calls if isinstance(call, ToolCall) else errors).append(call)
        rest = self._BLOCK.sub("", text)
        if "<tool_call>" in rest:
            errors.append("a <tool_call> was opened but never closed with </tool_call>")
            rest = rest.split("<tool_call>", 1)[0]
        return ParsedTurn(rest.strip(), calls, errors)


class Qwen3CoderParser:
    """Qwen3-coder's XML calls: ``<function=NAME>`` with ``<parameter=KEY>VALUE</parameter>`` children.

    A parameter's value is JSON-decoded when it parses as JSON (numbers, lists,
    objects, booleans), otherwise kept as text.
    """

    _BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)
    _FUNC = re.compile(r"^\s*<function=([^>\s]+)>(.*)</function>\s*$", re.S)
    _PARAM = re.compile(r"<parameter=([^>\s]+)>(.*?)</parameter>", re.S)

    def parse(self, text: str) -> ParsedTurn:
        calls: list[ToolCall] = []
        errors: list[str] = []
        for m in self._BLOCK.finditer(text):
            fm = self._FUNC.match(m.group(1))
            if not fm:
                errors.append(f"a <tool_call> must hold one <function=NAME>...</function>; got {m.group(1)[:80]!r}")
                continue
            name, body = fm.group(1), fm.group(2)
            args: dict[str, Any] = {}
            for pm in self._PARAM.finditer(body):
                raw = pm.group(2).strip("\n")
                try:
                    args[pm.group(1)] = json.loads(raw)
                except json.JSONDecodeError:
                    args[pm.group(1)] = raw
            leftover = self._PARAM.sub("", body).strip()
            if "<parameter=" in leftover:
                errors.append(f"'{name}': a <parameter=...> was not closed with </parameter>")
                continue
            calls.append(ToolCall(name, args))
        rest = self._BLOCK.sub("", text)
        if "<tool_call>" in rest:
            errors.append("a <tool_call> was opened but never closed with </tool_call>")
            rest = rest.split("<tool_call>", 1)[0]
        return ParsedTurn(rest.strip(), calls, errors)


class Llama3JsonParser:
    """Llama-3.x JSON calls: the turn is ``{"name": ..., "parameters": {...}}`` (or a list of them).

    A turn that does not start with ``{`` / ``[`` (after an optional ``<|python_tag|>``) is a plain answer.
    """

    def parse(self, text: str) -> ParsedTurn:
        body = text.strip()
        if body.startswith("<|python_tag|>"):
            body = body[len("<|python_tag|>"):].strip()
        if not body.startswith(("{", "[")):
            return ParsedTurn(text.strip())
        try:
            obj = json.loads(body)
        except json.JSONDecodeError:
            # several calls separated by ';' (Llama 3.2's multi-call form)
            parts = [p for p in body.split(";") if p.strip()]
            try:
                obj = [json.loads(p) for p in parts] if len(parts) > 1 else json.loads(body)
            except json.JSONDecodeError as exc:
                return ParsedTurn("", [], [f"tool call is not valid JSON: {exc.msg} (at char {exc.pos})"])
        items = obj if isinstance(obj, list) else [obj]
        calls: list[ToolCall] = []
        errors: list[str] = []
        for item in items:
            call = _call_from_json(item, ("parameters", "arguments"))
            (calls if isinstance(call, ToolCall) else errors).append(call)
        return ParsedTurn("", calls, errors)
