"""``polyrl new-plugin NAME --kind KIND``: a new plugin package that works and passes its tests as generated.

The templates are package data (``files/``): ``common/`` for every kind (pyproject with the ``polyrl``
entry point, README, CHANGELOG, LICENSE, the package's ``__init__``/``__about__``, the tests' conftest) and
one folder per kind with its ``hooks.py``, the component's module and a test module that runs the matching
conformance suite of :mod:`polyrl.testing`. Placeholders are ``{{key}}``; see :func:`plugin_names`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from polyrl.__about__ import __version__
from polyrl.errors import PolyrlError


@dataclass(frozen=True)
class Kind:
    """What one ``--kind`` generates."""

    module: str  # the component's module in the package (estimator.py, ...)
    text: str  # "advantage estimator"
    plural: str
    registry: str  # the registry kind `polyrl plugins` lists it under
    description: str  # the package's default description; {registered} is filled in
    usage: str  # README's "Use" section
    extra_dependencies: tuple[str, ...] = ()


KINDS: dict[str, Kind] = {
    "engine": Kind("engine", "training engine", "engines", "engine",
                   "The {registered} training engine for polyrl.",
                   "Select it per role in a run's config: `actor.engine={registered}` (and `critic.engine`, "
                   "`ref.engine`).", ("polyrl-engine-fsdp>=0.1,<0.2",)),
    "rollout": Kind("rollout", "rollout", "rollouts", "rollout", "The {registered} rollout for polyrl.",
                    "Select it in a run's config: `rollout.name={registered}`."),
    "reward": Kind("reward", "reward function", "reward functions", "reward_function",
                   "The {registered} reward function for polyrl.",
                   "Rows whose `data_source` is `{registered}` are scored by it; or select it for every row with "
                   "`reward.function={registered}`."),
    "estimator": Kind("estimator", "advantage estimator", "advantage estimators", "advantage_estimator",
                      "The {registered} advantage estimator for polyrl.",
                      "Select it in a run's config: `algorithm.adv_estimator={registered}`."),
    "platform": Kind("platform", "platform", "platforms", "platform", "The {registered} device platform for polyrl.",
                     "Select it in a run's config: `trainer.device={registered}` (or raise its `priority` in "
                     "`hooks.py` to have it picked where it is available)."),
    "tool": Kind("tool", "tool", "tools", "tool", "The {registered} tool for polyrl agent loops.",
                 "List it in a run's `agent.tools` so agent loops may call it (see polyrl's docs/agents.md)."),
    "environment": Kind("environment", "environment", "environments", "environment",
                        "The {registered} environment for polyrl's stepwise agent loop.",
                        "Rows with `agent_name: stepwise` and `extra_info.env: {registered}` play it (see polyrl's "
                        "docs/environments.md)."),
}

#: A plugin name: lowercase words joined by dashes (``my-reward``); ``polyrl-`` in front is dropped.
_NAME = re.compile(r"^[a-z][a-z0-9]*(-[a-z0-9]+)*$")
_TEMPLATES = resources.files(__package__) / "files"


def plugin_names(name: str) -> dict[str, str]:
    """The names a plugin called ``name`` gets: ``name`` (entry point), ``dist``, ``module``, ``registered``
    (the name it registers), ``Class`` (its class-name prefix). ``PolyrlError`` for a name that cannot be one."""
    short = name.removeprefix("polyrl-")
    if not _NAME.match(short) or short == "polyrl":
        raise PolyrlError(f"plugin name {name!r}: use lowercase letters, digits and dashes, starting with a letter "
                          "(e.g. my-reward); the distribution becomes polyrl-NAME")
    registered = short.replace("-", "_")
    return {"name": short, "dist": f"polyrl-{short}", "module": f"polyrl_{registered}", "registered": registered,
            "Class": "".join(part.capitalize() for part in short.split("-"))}


def _polyrl_range() -> str:
    """``polyrl>=MAJOR.MINOR,<MAJOR.MINOR+1``: the minor series this core belongs to."""
    major, minor = (int(p) for p in __version__.split(".")[:2])
    return f"polyrl>={major}.{minor},<{major}.{minor + 1}"


def _render(text: str, values: dict[str, str], source: str) -> str:
    for key, value in values.items():
        text = text.replace("{{" + key + "}}", value)
    if "{{" in text:
        raise AssertionError(f"template {source} has an unknown placeholder: {text[text.index('{{'):][:40]}")
    return text


def _check_description(description: str) -> None:
    """``PolyrlError`` naming ``--description`` for a description the templates cannot hold."""
    if "{{" in description or "}}" in description:
        raise PolyrlError(f"--description {description!r}: '{{{{' and '}}}}' are template placeholders; "
                          "remove them (single braces are fine)")
    bad = sorted({repr(c) for c in description if ord(c) < 32 or 127 <= ord(c) < 160})
    if bad:
        raise PolyrlError(f"--description {description!r}: one line of text, without control characters "
                          f"({', '.join(bad)}); remove them")


def _string_body(text: str) -> str:
    """``text`` escaped for the inside of a double-quoted string, TOML basic and Python alike (``"`` and
    ``\\``; the text holds no control characters)."""
    return json.dumps(text, ensure_ascii=False)[1:-1]


def create_plugin(name: str, kind: str, dest: str | Path = ".", *, description: str | None = None) -> Path:
    """Write the package ``polyrl-NAME`` for a plugin of ``kind`` into ``dest`` and return its folder.

    ``PolyrlError`` for an unknown kind, a bad name, a description with ``{{``/``}}`` or control characters,
    or a folder that already exists (nothing is overwritten).
    """
    if kind not in KINDS:
        raise PolyrlError(f"unknown plugin kind {kind!r}; choose from {', '.join(KINDS)}")
    if description is not None:
        _check_description(description)
    spec = KINDS[kind]
    names = plugin_names(name)
    root = Path(dest) / names["dist"]
    if root.exists():
        raise PolyrlError(f"{root} already exists: choose another name or --dest, or remove it")
    deps = [_polyrl_range(), *spec.extra_dependencies]
    text = description or spec.description.format(registered=names["registered"])
    values = {
        **names,
        "kind": kind,
        "kind_text": spec.text,
        "kind_plural": spec.plural,
        "kind_module": spec.module,
        "registry_kind": spec.registry,
        "description": text,  # as is (README)
        "description_str": _string_body(text),  # inside "..." in TOML and Python
        "usage": spec.usage.format(registered=names["registered"]),
        "dependencies": ", ".join(f'"{d}"' for d in deps),
        "polyrl_range": _polyrl_range(),
        "polyrl_version": __version__,
    }
    package = f"src/{names['module']}"
    layout = {  # template -> path in the new package
        "common/pyproject.toml.tmpl": "pyproject.toml",
        "common/README.md.tmpl": "README.md",
        "common/CHANGELOG.md.tmpl": "CHANGELOG.md",
        "common/LICENSE": "LICENSE",
        "common/__init__.py.tmpl": f"{package}/__init__.py",
        "common/__about__.py.tmpl": f"{package}/__about__.py",
        f"{kind}/hooks.py.tmpl": f"{package}/hooks.py",
        f"{kind}/{spec.module}.py.tmpl": f"{package}/{spec.module}.py",
        "common/conftest.py.tmpl": "tests/conftest.py",
        f"{kind}/test.py.tmpl": f"tests/test_{names['registered']}.py",
    }
    rendered = {out: _render(_TEMPLATES.joinpath(src).read_text(encoding="utf-8"), values, src)
                for src, out in layout.items()}
    for out, text in rendered.items():
        path = root / out
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    (root / package / "py.typed").write_text("")
    return root
