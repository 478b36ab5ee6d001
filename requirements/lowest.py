"""Print pip constraints that pin each direct dependency to its declared lower bound.

``make test-lowest`` installs the workspace packages with these constraints in a fresh venv, so the
floors the pyprojects declare (``transformers>=4.56``...) are the versions actually tested. A
requirement without a lower bound is left free; torch stays at the project's pin. Usage::

    python requirements/lowest.py packages/core/pyproject.toml[plot] packages/engine-fsdp/pyproject.toml
"""

from __future__ import annotations

import re
import sys

import tomllib
from packaging.requirements import Requirement
from packaging.version import Version

#: Distributions never pinned to their floor: torch is pinned for the whole project; the workspace's
#: own packages are installed from the tree.
KEEP = {"torch": "torch==2.13.0"}


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def floors(arguments: list[str]) -> dict[str, str]:
    """``{name: "name==floor"}`` over the dependencies (and the named extras) of each pyproject."""
    own: set[str] = set()
    reqs: list[Requirement] = []
    for arg in arguments:
        path, _, extras = arg.partition("[")
        with open(path, "rb") as f:
            project = tomllib.load(f)["project"]
        own.add(_canonical(project["name"]))
        reqs += [Requirement(r) for r in project.get("dependencies", [])]
        for extra in filter(None, extras.rstrip("]").split(",")):
            reqs += [Requirement(r) for r in project["optional-dependencies"][extra.strip()]]
    out: dict[str, str] = {}
    for req in reqs:
        name = _canonical(req.name)
        if name in own or (req.marker is not None and not req.marker.evaluate()):
            continue
        if name in KEEP:
            out[name] = KEEP[name]
            continue
        lows = [s.version for s in req.specifier if s.operator in (">=", "==", "~=")]
        if lows:
            out[name] = f"{req.name}=={max(lows, key=Version)}"
    return out


def main(argv: list[str]) -> int:
    """Print one ``name==floor`` line per direct dependency with a lower bound."""
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    for line in sorted(floors(argv).values(), key=str.lower):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
