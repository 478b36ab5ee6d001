"""Every hookspec has a section in docs/plugins/hooks.md (and the docs name no hook that does not exist)."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

from polyrl import hookspecs
from polyrl.registry import HOOK_FOR_KIND

DOC = Path(__file__).resolve().parents[3] / "docs" / "plugins" / "hooks.md"


def hookspec_names() -> list[str]:
    marker = f"{hookspecs.PROJECT_NAME}_spec"
    return [n for n, f in inspect.getmembers(hookspecs, inspect.isfunction) if hasattr(f, marker)]


def sections() -> dict[str, str]:
    parts = re.split(r"^## ", DOC.read_text(), flags=re.M)
    return {part.split("\n", 1)[0].strip(): part for part in parts[1:]}


def test_every_hookspec_is_documented():
    specs = hookspec_names()
    assert len(specs) == len(HOOK_FOR_KIND)
    missing = [n for n in specs if f"`{n}`" not in sections()]
    assert not missing, f"hooks without a '## `name`' section in {DOC}: {missing}"


def test_each_section_says_kind_obj_and_metadata():
    found = sections()
    kind_of = {hook: kind for kind, hook in HOOK_FOR_KIND.items()}
    for name in hookspec_names():
        text = found[f"`{name}`"]
        assert f"`{kind_of[name]}`" in text, f"section {name} does not name its kind '{kind_of[name]}'"
        assert "**`obj`**" in text and "**Metadata**" in text, f"section {name} lacks **`obj`** or **Metadata**"


def test_docs_name_no_hook_that_does_not_exist():
    documented = {h.strip("`") for h in sections() if h.startswith("`register_")}
    assert documented == set(hookspec_names())


def test_every_hookspec_has_a_docstring():
    for name in hookspec_names():
        assert (getattr(hookspecs, name).__doc__ or "").strip(), name
