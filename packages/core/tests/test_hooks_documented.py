"""Every hookspec has a section in docs/plugins/hooks.md."""

from __future__ import annotations

import inspect
from pathlib import Path

from polyrl import hookspecs

DOC = Path(__file__).resolve().parents[3] / "docs" / "plugins" / "hooks.md"


def test_every_hookspec_is_documented():
    text = DOC.read_text()
    specs = [n for n, f in inspect.getmembers(hookspecs, inspect.isfunction) if n.startswith("register_")]
    assert specs
    missing = [n for n in specs if f"## `{n}`" not in text]
    assert not missing, f"hooks without a '## `name`' section in {DOC}: {missing}"
