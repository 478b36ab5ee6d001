"""Each polyrl package alone, from its wheel: a fresh venv with only its declared dependencies, then its smoke tests.

``make test-packages`` (after ``make dist``) runs this for the 9 packages; CI calls it from ``.ci/run``. Per
package:

1. a fresh venv (``--without-pip``: pip runs from outside it, with ``pip --python``) that also sees one shared
   *base* venv (a ``.pth`` line) holding torch 2.13.0, the core's dependencies and pytest;
2. ``pip install`` of the package's wheel and ``polyrl[testing]``, resolved against ``dist/`` for polyrl's own
   packages and the index for the rest, with the repository's lock as constraints; pip installs into the fresh
   venv whatever the package needs beyond the base (the core's wheel itself, peft, diffusers, megatron-core...);
3. ``pip check``, then ``polyrl plugins --json`` (the package's plugin must load through its entry point);
4. its smoke tests: ``pytest -m smoke`` over the test files of the package that hold smoke-marked tests,
   against the installed wheel (the tests import the package from the venv, never from ``src/``).

Why the base proves the same as a venv built from nothing: every package depends on ``polyrl`` (the core on
itself), so torch and the core's dependencies are in each package's own dependency closure; the base holds
exactly those (the core's wheel is installed into it and removed again, leaving its dependencies) plus pytest.
Nothing else is visible to a package: what it imports without declaring it, or without the core declaring it,
fails here. What it saves: unpacking torch, transformers, pyarrow... once per package (about 9 of the 11 minutes
this step took with a torch-only base on 2 cores).

The base venv and the pip cache make a second local run fast; the per-package venvs are rebuilt every time.
Standard library only: run it with any Python 3.10+.

    python3 .ci/test_packages.py --dist dist --venvs .venv-packages core engine-fsdp ...
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: package folder -> (distribution, the plugin name ``polyrl plugins`` shows; None for the core)
PACKAGES = {
    "core": ("polyrl", None),
    "engine-fsdp": ("polyrl-engine-fsdp", "engine-fsdp"),
    "engine-megatron": ("polyrl-engine-megatron", "engine-megatron"),
    "rollout-vllm": ("polyrl-rollout-vllm", "rollout-vllm"),
    "rollout-sglang": ("polyrl-rollout-sglang", "rollout-sglang"),
    "diffusion": ("polyrl-diffusion", "diffusion"),
    "hw-ascend": ("polyrl-hw-ascend", "hw-ascend"),
    "hw-rocm": ("polyrl-hw-rocm", "hw-rocm"),
    "recipes": ("polyrl-recipes", "recipes"),
}
#: extras a package's smoke tests need beyond ``polyrl[testing]`` (the recipes train with the FSDP engine)
EXTRAS = {"recipes": "[test]"}
CONSTRAINTS = ["-c", str(ROOT / "requirements" / "torch.txt"), "-c", str(ROOT / "requirements" / "lock.txt")]
ENV = dict(os.environ, OMP_NUM_THREADS="1", RAY_AUTH_MODE="disabled", TOKENIZERS_PARALLELISM="false",
           PIP_DISABLE_PIP_VERSION_CHECK="1", PYTHONDONTWRITEBYTECODE="1")


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, text=True, capture_output=True, env=ENV, **kw)
    if proc.returncode != 0:
        raise RuntimeError(f"$ {' '.join(cmd)}\n{proc.stdout[-4000:]}{proc.stderr[-4000:]}")
    return proc


def site_packages(venv: Path) -> Path:
    """The venv's purelib folder (``lib/pythonX.Y/site-packages``)."""
    rel = Path(sysconfig.get_path("purelib", vars={"base": ".", "platbase": "."}))
    return venv / rel


def base_venv(venvs: Path, dist: Path) -> Path:
    """The shared venv: torch 2.13.0, the core's dependencies (from its wheel's metadata) and pytest, without any
    polyrl package. Rebuilt when the core's wheel changed."""
    base = venvs / "base"
    python = base / "bin" / "python"
    core = _wheel(dist, "polyrl")
    stamp = base / "built-from"
    if python.exists() and stamp.exists() and stamp.read_text() == f"{core.name} {core.stat().st_size}":
        return base
    shutil.rmtree(base, ignore_errors=True)
    run([sys.executable, "-m", "venv", str(base)])
    pip = [str(python), "-m", "pip", "install", "-q", "--no-compile", *CONSTRAINTS]
    run([*pip, "torch==2.13.0"])
    run([*pip, "--find-links", str(dist), f"polyrl[testing] @ {core.as_uri()}"])
    run([str(python), "-m", "pip", "uninstall", "-q", "-y", "polyrl"])  # its dependencies stay
    stamp.write_text(f"{core.name} {core.stat().st_size}")
    return base


def _wheel(dist: Path, distribution: str) -> Path:
    wheels = sorted(dist.glob(f"{distribution.replace('-', '_')}-*.whl"))
    if not wheels:
        raise RuntimeError(f"no wheel of {distribution} in {dist}: run `make dist` first")
    return wheels[-1]


def smoke_files(package: str) -> list[Path]:
    """The package's test files that hold smoke-marked tests."""
    tests = ROOT / "packages" / package / "tests"
    return sorted(p for p in tests.rglob("test_*.py") if re.search(r"pytest\.mark\.smoke\b", p.read_text()))


def check_package(package: str, dist: Path, venvs: Path, base: Path) -> dict:
    distribution, plugin = PACKAGES[package]
    wheel = _wheel(dist, distribution)
    venv = venvs / package
    shutil.rmtree(venv, ignore_errors=True)
    started = time.perf_counter()
    run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    python = venv / "bin" / "python"
    site = site_packages(venv)
    site.mkdir(parents=True, exist_ok=True)
    (site / "_polyrl_base.pth").write_text(f"{site_packages(base)}\n")
    pip = [str(base / "bin" / "python"), "-m", "pip", "--python", str(python)]
    run([*pip, "install", "-q", "--no-compile", "--find-links", str(dist), *CONSTRAINTS, f"{wheel}{EXTRAS.get(package, '')}",
         "polyrl[testing]"])
    run([*pip, "check"])
    installed = [line.split("==")[0] for line in run([*pip, "list", "--format=freeze"]).stdout.splitlines() if line]
    installed_s = time.perf_counter() - started
    listing = json.loads(run([str(venv / "bin" / "polyrl"), "plugins", "--json"], cwd=venv).stdout)
    names = [p["name"] for p in listing["plugins"]]
    if plugin is not None and plugin not in names:
        raise RuntimeError(f"{distribution}: plugin '{plugin}' is not listed by `polyrl plugins` ({names})")
    files = smoke_files(package)
    if not files:
        raise RuntimeError(f"{distribution}: no smoke-marked tests under packages/{package}/tests")
    tested = time.perf_counter()
    proc = subprocess.run([str(python), "-m", "pytest", "-q", "-m", "smoke", "-p", "no:cacheprovider",
                           *[str(f.relative_to(ROOT / "packages" / package)) for f in files]],
                          cwd=ROOT / "packages" / package, text=True, capture_output=True, env=ENV)
    summary = (proc.stdout.strip().splitlines() or ["(no output)"])[-1]
    if proc.returncode != 0:
        raise RuntimeError(f"{distribution}: smoke tests failed\n{proc.stdout[-6000:]}{proc.stderr[-3000:]}")
    return {"package": distribution, "dists": len(installed), "install_s": installed_s,
            "smoke_s": time.perf_counter() - tested, "smoke": summary}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dist", default="dist")
    parser.add_argument("--venvs", default=".venv-packages")
    parser.add_argument("packages", nargs="*", help=f"package folders (default: all: {', '.join(PACKAGES)})")
    args = parser.parse_args()
    args.packages = args.packages or list(PACKAGES)
    unknown = [p for p in args.packages if p not in PACKAGES]
    if unknown:
        parser.error(f"unknown package(s) {unknown}; choose from {', '.join(PACKAGES)}")
    dist, venvs = (ROOT / args.dist).resolve(), (ROOT / args.venvs).resolve()
    venvs.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    base = base_venv(venvs, dist)
    print(f"base venv (torch, the core's dependencies, pytest) ready in {time.perf_counter() - started:.0f}s",
          flush=True)
    failed = []
    for package in args.packages:
        try:
            r = check_package(package, dist, venvs, base)
        except RuntimeError as exc:
            failed.append(package)
            print(f"FAIL {package}:\n{exc}", flush=True)
            continue
        print(f"ok   {r['package']:24s} {r['dists']:3d} dists in all, installed in {r['install_s']:4.0f}s, "
              f"smoke {r['smoke_s']:4.0f}s: {r['smoke']}", flush=True)
    print(f"test-packages: {len(args.packages) - len(failed)} of {len(args.packages)} packages passed in "
          f"{time.perf_counter() - started:.0f}s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
