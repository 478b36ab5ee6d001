"""Command-line overrides in Hydra's grammar, as verl's shell scripts write them.

One override is one of::

    key=value      set (the key must exist in a verl tree; any schema key in polyrl's layout)
    +key=value     add a key the tree does not have (verl's ``+trainer.val_before_train=False``)
    ++key=value    add or set
    ~key           delete (the key goes back to its default); ``~key=value`` only if it holds that value

Values follow Hydra's grammar: ``null``, ``true``/``false`` (any case), integers (``1_000``), floats
(``1e-6``, ``inf``), quoted strings (``'a b'``, ``"x"``), lists ``[a, 'b', 3]``, mappings ``{a: 1}``,
interpolations ``${data.max_prompt_length}`` / ``${oc.env:HOME,/tmp}`` (resolved once the whole config is
merged), and anything else as an unquoted string (``Qwen/Qwen2-7B-Instruct``). A top-level ``a,b`` is a
Hydra sweep, which a single run cannot do: it is refused with the fix (``[a,b]`` or quotes).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from polyrl.errors import ConfigError

_KEY = re.compile(r"^[A-Za-z_][\w\-]*(\.[\w\-]+)*$")
_INT = re.compile(r"^[+-]?\d[\d_]*$")
_FLOAT = re.compile(r"^[+-]?(\d[\d_]*\.?[\d_]*([eE][+-]?\d+)?|\.\d[\d_]*([eE][+-]?\d+)?|\d[\d_]*[eE][+-]?\d+)$")


@dataclass(frozen=True)
class Override:
    """One parsed override: ``op`` is ``set``, ``add`` (``+``), ``force`` (``++``) or ``delete`` (``~``)."""

    op: str
    key: str
    value: Any
    #: The override as it was written (for messages and origins).
    text: str
    #: ``~key`` without ``=value`` (delete whatever it holds).
    has_value: bool = True


def parse_override(text: str) -> Override:
    """Parse one command-line override; a :class:`ConfigError` names it and says what is wrong."""
    raw = text.strip()
    op = "set"
    if raw.startswith("++"):
        op, raw = "force", raw[2:]
    elif raw.startswith("+"):
        op, raw = "add", raw[1:]
    elif raw.startswith("~"):
        op, raw = "delete", raw[1:]
    key, eq, value_text = raw.partition("=")
    key = key.strip()
    if not eq and op != "delete":
        raise ConfigError(f"command-line override '{text}' must look like key=value (or ~key to delete a key)")
    if "/" in key or "@" in key:
        raise ConfigError(f"command-line override '{text}': config-group overrides (group/option, @package) are not "
                          "supported; set the keys themselves (key.sub=value)")
    if not _KEY.match(key):
        raise ConfigError(f"command-line override '{text}': '{key}' is not a dotted config key")
    if op == "delete" and not eq:
        return Override(op, key, None, text, has_value=False)
    try:
        value = parse_value(value_text)
    except ValueError as exc:
        raise ConfigError(f"command-line override '{text}': {exc}") from None
    return Override(op, key, value, text)


def parse_value(text: str) -> Any:
    """A Hydra override value as a Python value (interpolations stay ``${...}`` strings)."""
    parser = _Parser(text)
    value = parser.value(top=True)
    parser.skip_ws()
    if parser.pos != len(text):
        if text[parser.pos] == ",":
            raise ValueError("a comma-separated value is a Hydra sweep, which one run cannot do: write a list "
                             f"[{text.strip()}] or quote the value")
        raise ValueError(f"unexpected {text[parser.pos]!r} at position {parser.pos} of {text!r}")
    return value


#: Characters Hydra's override grammar lets an unquoted value escape with a backslash.
_ESCAPABLE = "\\()[]{}:=, \t"


class _Parser:
    def __init__(self, text: str) -> None:
        self.text, self.pos = text, 0

    def skip_ws(self) -> None:
        while self.pos < len(self.text) and self.text[self.pos] in " \t":
            self.pos += 1

    def peek(self) -> str:
        return self.text[self.pos] if self.pos < len(self.text) else ""

    def value(self, top: bool = False) -> Any:
        self.skip_ws()
        ch = self.peek()
        if ch == "[":
            return self.sequence()
        if ch == "{":
            return self.mapping()
        if ch and ch in "'\"":
            return self.quoted()
        return _scalar(self.primitive_text(stop="," if top else ",]}").strip())

    def quoted(self) -> str:
        quote = self.text[self.pos]
        self.pos += 1
        out = []
        while self.pos < len(self.text):
            ch = self.text[self.pos]
            if ch == "\\" and self.pos + 1 < len(self.text) and self.text[self.pos + 1] in (quote, "\\"):
                out.append(self.text[self.pos + 1])
                self.pos += 2
                continue
            if ch == quote:
                self.pos += 1
                return "".join(out)
            out.append(ch)
            self.pos += 1
        raise ValueError(f"unterminated {quote} quote")

    def sequence(self) -> list:
        self.pos += 1
        items: list = []
        self.skip_ws()
        if self.peek() == "]":
            self.pos += 1
            return items
        while True:
            items.append(self.value())
            self.skip_ws()
            ch = self.peek()
            self.pos += 1
            if ch == "]":
                return items
            if ch != ",":
                raise ValueError("a list must look like [a, b, c]")

    def mapping(self) -> dict:
        self.pos += 1
        out: dict = {}
        self.skip_ws()
        if self.peek() == "}":
            self.pos += 1
            return out
        while True:
            self.skip_ws()
            key = self.quoted() if self.peek() and self.peek() in "'\"" else self.primitive_text(stop=":,}")
            self.skip_ws()
            if self.peek() != ":":
                raise ValueError("a mapping must look like {a: 1, b: 2}")
            self.pos += 1
            out[str(key).strip()] = self.value()
            self.skip_ws()
            ch = self.peek()
            self.pos += 1
            if ch == "}":
                return out
            if ch != ",":
                raise ValueError("a mapping must look like {a: 1, b: 2}")

    def primitive_text(self, stop: str) -> str:
        """An unquoted value up to one of ``stop``; Hydra's escapes (``\\{``, ``\\,``, ``\\:``...) are kept as the
        character."""
        out: list[str] = []
        start = self.pos
        while self.pos < len(self.text):
            ch = self.text[self.pos]
            if ch == "$" and self.text.startswith("${", self.pos):
                self.interpolation()
                continue
            if ch == "\\" and self.pos + 1 < len(self.text) and self.text[self.pos + 1] in _ESCAPABLE:
                out.append(self.text[start:self.pos] + self.text[self.pos + 1])
                self.pos += 2
                start = self.pos
                continue
            if ch in stop:
                break
            self.pos += 1
        return "".join(out) + self.text[start:self.pos]

    def interpolation(self) -> None:
        depth = 0
        while self.pos < len(self.text):
            ch = self.text[self.pos]
            if ch == "{":
                depth += 1
            elif ch == "}":
                depth -= 1
                if depth == 0:
                    self.pos += 1
                    return
            self.pos += 1
        raise ValueError("unterminated ${...} interpolation")


def _scalar(text: str) -> Any:
    low = text.lower()
    if low == "null":
        return None
    if low in ("true", "false"):
        return low == "true"
    if _INT.match(text):
        return int(text.replace("_", ""))
    if low in ("inf", "+inf", "-inf", "nan"):
        return float(low)
    if _FLOAT.match(text) and any(c.isdigit() for c in text):
        value = float(text.replace("_", ""))
        return value if math.isfinite(value) else text
    return text


def apply_override(tree: dict, override: Override) -> None:
    """Apply ``override`` to the nested dict ``tree`` in place (the caller checks first that a plain
    ``key=value`` names a key the tree knows). Raises :class:`ConfigError` naming the override."""
    parts = override.key.split(".")
    node = tree
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if not isinstance(child, dict):
            if override.op == "delete":
                raise ConfigError(f"command-line override '{override.text}': there is no key "
                                  f"'{'.'.join(parts[: i + 1])}' to delete")
            if child is not None and override.op == "set":
                raise ConfigError(f"command-line override '{override.text}': '{'.'.join(parts[: i + 1])}' holds a "
                                  "value, not a mapping")
            child = {}
            node[part] = child
        node = child
    leaf = parts[-1]
    if override.op == "delete":
        if leaf not in node:
            raise ConfigError(f"command-line override '{override.text}': there is no key '{override.key}' to delete")
        if override.has_value and node[leaf] != override.value:
            raise ConfigError(f"command-line override '{override.text}': '{override.key}' holds {node[leaf]!r}, "
                              f"not {override.value!r}")
        del node[leaf]
        return
    node[leaf] = override.value
