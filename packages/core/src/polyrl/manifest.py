"""The plugin manifest: which plugins a run loads.

```toml
[plugins]
require = ["polyrl-engine-fsdp>=0.1,<0.2"]   # PEP 508, checked against installed versions
modules = ["my_project.polyrl_plugin"]       # extra hook modules by import path
block   = ["polyrl-hw-rocm"]                 # installed but not loaded
```

With a manifest, exactly the required distributions' plugins load (plus the
core's built-ins and ``modules``); with none, every installed plugin loads.
The same manifest rebuilds the same registries in any process.
"""

from __future__ import annotations

import difflib
import importlib.metadata
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name

from polyrl.errors import ManifestError

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser, as a package
    import tomli as tomllib

_SECTION_KEYS = {"plugins": {"require", "modules", "block"}}


@dataclass(frozen=True)
class Manifest:
    """A parsed manifest. ``source`` is the file it came from, for messages."""

    require: tuple[str, ...] = ()
    modules: tuple[str, ...] = ()
    block: tuple[str, ...] = ()
    source: str | None = None

    # ------------------------------------------------------------------ reading
    @classmethod
    def load(cls, path: str | Path) -> Manifest:
        """Read and validate a manifest file."""
        path = Path(path)
        try:
            text = path.read_text()
        except FileNotFoundError:
            raise ManifestError(
                f"manifest {path} does not exist; pass the path of a TOML file with a [plugins] table"
            ) from None
        except (OSError, UnicodeDecodeError) as exc:
            raise ManifestError(f"manifest {path} cannot be read: {exc}") from None
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ManifestError(f"manifest {path}: malformed TOML: {exc}") from None
        return cls.from_dict(data, source=str(path))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: str | None = None) -> Manifest:
        """Validate a manifest already parsed into a mapping."""
        where = source or "<manifest>"
        for key, value in data.items():
            if key not in _SECTION_KEYS:
                if key in _SECTION_KEYS["plugins"]:
                    raise ManifestError(
                        f"manifest {where}: key '{key}' must be inside the [plugins] table; "
                        "add a '[plugins]' line above it"
                    )
                raise ManifestError(_unknown_key(where, key, _SECTION_KEYS))
            if not isinstance(value, Mapping):
                raise ManifestError(f"manifest {where}: [{key}] must be a table")
            for sub in value:
                if sub not in _SECTION_KEYS[key]:
                    raise ManifestError(_unknown_key(where, f"{key}.{sub}", _SECTION_KEYS[key], sub))
        plugins = data.get("plugins", {})
        lists = {}
        for key in ("require", "modules", "block"):
            value = plugins.get(key, [])
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise ManifestError(f"manifest {where}: plugins.{key} must be a list of strings, got {value!r}")
            lists[key] = tuple(value)
        for req in lists["require"]:
            try:
                Requirement(req)
            except InvalidRequirement as exc:
                raise ManifestError(f"manifest {where}: plugins.require entry '{req}' is not PEP 508: {exc}") from None
        return cls(**lists, source=source)

    # ------------------------------------------------------------------ checks
    def check_requirements(self) -> dict[str, str]:
        """Check every ``require`` entry against installed versions; return ``{dist: version}``."""
        found = {}
        for text in self.require:
            req = Requirement(text)
            if req.marker is not None and not req.marker.evaluate():
                continue  # e.g. '; sys_platform == "linux"' on another platform
            try:
                version = importlib.metadata.version(req.name)
            except importlib.metadata.PackageNotFoundError:
                raise ManifestError(
                    f"manifest {self.source or '<manifest>'} requires '{text}', which is not installed. "
                    f"{_missing_distribution_hint(req.name, text)}"
                ) from None
            if req.specifier and not req.specifier.contains(version, prereleases=True):
                raise ManifestError(
                    f"manifest {self.source or '<manifest>'} requires '{text}', but {req.name} {version} "
                    f"is installed. Install a matching version: pip install '{text}'"
                )
            found[canonicalize_name(req.name)] = version
        return found

    def required_distributions(self) -> set[str]:
        """Canonical names of the required distributions (those whose environment marker applies)."""
        reqs = [Requirement(r) for r in self.require]
        return {canonicalize_name(r.name) for r in reqs if r.marker is None or r.marker.evaluate()}

    def is_blocked(self, *names: str | None) -> bool:
        """Whether any of ``names`` (entry-point name, distribution, module) is blocked."""
        blocked = {canonicalize_name(b) for b in self.block} | set(self.block)
        return any(n is not None and (n in blocked or canonicalize_name(n) in blocked) for n in names)

    # ------------------------------------------------------------------ writing
    def resolved(self) -> dict[str, Any]:
        """The manifest with exact installed versions (``==``), as written into a run directory."""
        versions = self.check_requirements()
        extras = {canonicalize_name(r.name): sorted(r.extras) for r in map(Requirement, self.require)}
        pinned = [
            name + (f"[{','.join(extras[name])}]" if extras.get(name) else "") + f"=={version}"
            for name, version in sorted(versions.items())
        ]
        return {
            "plugins": {
                "require": pinned,
                "modules": list(self.modules),
                "block": list(self.block),
            }
        }

    def to_toml(self, resolved: bool = False) -> str:
        """TOML text of this manifest (or of :meth:`resolved`)."""
        data = self.resolved() if resolved else {"plugins": {k: list(v) for k, v in asdict(self).items() if k != "source"}}
        lines = ["[plugins]"]
        for key, values in data["plugins"].items():
            lines.append(f"{key} = [{', '.join(_toml_str(v) for v in values)}]")
        return "\n".join(lines) + "\n"


#: polyrl's own plugin distributions: a manifest requiring one that is missing gets its ``pip install`` line.
OWN_DISTRIBUTIONS = ("polyrl-engine-fsdp", "polyrl-engine-megatron", "polyrl-rollout-vllm", "polyrl-rollout-sglang",
                     "polyrl-diffusion", "polyrl-recipes", "polyrl-hw-ascend", "polyrl-hw-rocm")


def _missing_distribution_hint(name: str, text: str) -> str:
    """What to do about a required distribution that is not installed. A ``pip install`` line only for polyrl's own
    packages; any other name gets the installed plugins (and polyrl's packages) it is close to, never an install
    line of its own (a misspelt name could be someone else's package on the index: typo-squatting)."""
    canon = canonicalize_name(name)
    if canon in OWN_DISTRIBUTIONS:
        return f"Install it: pip install '{text}'"
    installed = sorted({canonicalize_name(ep.dist.name) for ep in importlib.metadata.entry_points(group="polyrl")
                        if ep.dist is not None})
    close = difflib.get_close_matches(canon, sorted({*installed, *OWN_DISTRIBUTIONS}), n=2, cutoff=0.75)
    shown = [f"'{c}' (installed)" if c in installed else f"'{c}' (polyrl's: pip install '{c}')" for c in close]
    guess = f"Did you mean {' or '.join(shown)}? " if shown else ""
    return (f"{guess}Fix the name in [plugins].require, or install the distribution that provides the plugin "
            f"(installed polyrl plugins: {', '.join(installed) or 'none'})")


def _toml_str(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _unknown_key(where: str, key: str, allowed: Any, leaf: str | None = None) -> str:
    leaf = leaf or key
    close = difflib.get_close_matches(leaf, sorted(allowed), n=1)
    hint = f" Did you mean '{close[0]}'?" if close else ""
    return f"manifest {where}: unknown key '{key}'.{hint} Allowed: {', '.join(sorted(allowed))}."

