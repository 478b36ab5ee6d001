"""Generate docs/configuration.md from the schema dataclasses: ``python -m polyrl.config.reference``.

A test checks that the committed page matches what this prints, so the reference
never drifts from the code.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
import textwrap
import typing
from typing import Any

from polyrl.config.schema import PolyrlConfig, SFTConfig


def _field_docs(cls: type) -> dict[str, str]:
    """The ``#:`` comments above each field in the class source."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        lines = inspect.getsource(klass).splitlines()
        pending: list[str] = []
        for line in lines:
            stripped = line.strip()
            if stripped.startswith("#:"):
                pending.append(stripped[2:].strip())
            elif ":" in stripped and not stripped.startswith(("#", '"', "def ", "class ", "@")) and pending is not None:
                name = stripped.split(":", 1)[0].strip()
                if name.isidentifier() and pending:
                    docs[name] = " ".join(pending)
                pending = []
            elif stripped and not stripped.startswith("#"):
                pending = []
    return docs


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        value = f.default_factory()  # type: ignore[misc]
        return None if dataclasses.is_dataclass(value) else value
    return "???"


def _type_name(tp: Any) -> str:
    text = getattr(tp, "__name__", None) if not typing.get_args(tp) else None
    return text or str(tp).replace("typing.", "")


def _rows(cls: type, prefix: str) -> list[tuple[str, str, str, str]]:
    hints = typing.get_type_hints(cls)
    docs = _field_docs(cls)
    rows = []
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            rows.append((f"{prefix}{f.name}", "", "", (inspect.getdoc(tp) or "").split("\n\n")[0].replace("\n", " ")))
            rows += _rows(tp, f"{prefix}{f.name}.")
            continue
        if f.name == "plugin_config":
            rows.append((f"{prefix}<plugin>", "mapping", "", "the plugin's own options, under the plugin's name "
                         "(e.g. `fsdp:`), validated against its registered schema"))
            continue
        rows.append((f"{prefix}{f.name}", _type_name(tp), repr(_default(f)), docs.get(f.name, "")))
    return rows


def render() -> str:
    """The whole configuration reference as Markdown."""
    out = [
        "# Configuration reference",
        "",
        "Generated from `polyrl.config.schema` by `python -m polyrl.config.reference`; do not edit by hand.",
        "Set keys in a YAML file (`--config run.yaml`) or on the command line (`key=value`, dotted).",
        "An unknown key is an error with a did-you-mean; every error names the key and the file it came from.",
        "A config in verl's layout is read too and mapped onto these keys ([from_verl.md](from_verl.md)); "
        "`polyrl config show` prints what a config resolves to.",
        "",
    ]
    for title, cls in (("polyrl train", PolyrlConfig), ("polyrl sft", SFTConfig)):
        out += [f"## `{title}`", "", textwrap.dedent(inspect.getdoc(cls) or ""), "",
                "| key | type | default | meaning |", "|---|---|---|---|"]
        for key, tp, default, doc in _rows(cls, ""):
            if not tp:
                out.append(f"| **`{key}`** | | | {doc} |")
            else:
                out.append(f"| `{key}` | `{tp}` | `{default}` | {doc} |")
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    sys.stdout.write(render())
