"""Extract the Hydra override lists of verl's example scripts: ``fixtures/verl_example_overrides.json``.

This script reads a verl checkout, never polyrl, and is not collected by pytest. For each example script it
runs the script under ``bash`` with ``python3``/``python``/``uv`` (and the tools a script may call: ``hf``,
``ray``, ``nvidia-smi``...) replaced by stubs on ``PATH``: the stub for ``python3 -m verl.trainer.main_*``
records its arguments and exits, ``python3 -c ...`` fails (no ``torch_npu``: ``DEVICE=gpu``), everything
else does nothing. So each list is exactly what the script passes to verl for its default settings
(``VERL_USE_UV=0``, ``HOME=/home/user``, no other environment; a script that stops on an unset variable is run
again with :data:`FALLBACK_ENV`, recorded with its list), shell variables expanded by bash itself; ``ulimit`` is
a no-op (a sandbox cannot raise limits).
Only the override lists are kept (verl is Apache-2.0; the scripts themselves are not copied).

verl commit: verl-project/verl 1dda039b9c6311889a9c9a26040677e1254814f9 (2026-08-22). How it was run:

    .venv/bin/python packages/core/tests/config/verl_scripts_gen.py /path/to/verl-git-dir <commit>
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT = HERE / "fixtures" / "verl_example_overrides.json"
#: The script folders read (verl's DAPO recipe lives in the separate verl-recipe repository).
FOLDERS = ("examples/grpo_trainer", "examples/ppo_trainer", "examples/gspo_trainer", "examples/sapo_trainer")

#: Variables some scripts require without a default (the values are placeholders, as the scripts' own are).
FALLBACK_ENV = {"HDFS_ROOT": "/hdfs", "RAY_DATA_HOME": "/home/user/verl", "DATA_ROOT": "/home/user/data",
                "MODEL_PATH": "/home/user/models/model", "INFER_BACKEND": "vllm"}

PY_STUB = r"""#!/usr/bin/env python3
import json, os, sys
args = sys.argv[1:]
while args and args[0] in ("uv", "run", "--frozen", "--all-packages", "-v") or (args and args[0] == "--extra"):
    args = args[2:] if args[0] == "--extra" else args[1:]
if args and args[0] in ("python", "python3"):
    args = args[1:]
if "-c" in args[:1]:
    sys.exit(1)
if args[:1] == ["-m"] and len(args) > 1 and args[1].startswith("verl."):
    with open(os.environ["CAPTURE"], "a") as f:
        f.write(json.dumps({"entry": args[1], "args": args[2:]}) + "\n")
sys.exit(0)
"""


def _stubs(folder: Path) -> None:
    real = sys.executable
    for name in ("python3", "python", "uv"):
        path = folder / name
        path.write_text(PY_STUB.replace("#!/usr/bin/env python3", f"#!{real}"))
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    for name in ("hf", "huggingface-cli", "ray", "nvidia-smi", "npu-smi", "wget", "curl", "pip", "torchrun",
                 "modelscope", "git"):
        path = folder / name
        path.write_text("#!/bin/sh\nexit 0\n")
        path.chmod(path.stat().st_mode | stat.S_IEXEC)


def extract(git_dir: str, commit: str) -> dict:
    names = subprocess.run(["git", "--git-dir", git_dir, "ls-tree", "-r", "--name-only", commit, *FOLDERS],
                           check=True, capture_output=True, text=True).stdout.split()
    scripts: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        bin_dir, home, work = Path(tmp, "bin"), Path(tmp, "home"), Path(tmp, "work")
        for d in (bin_dir, home, work):
            d.mkdir()
        _stubs(bin_dir)
        for name in sorted(n for n in names if n.endswith(".sh")):
            text = subprocess.run(["git", "--git-dir", git_dir, "show", f"{commit}:{name}"], check=True,
                                  capture_output=True, text=True).stdout
            script = work / "script.sh"
            script.write_text(text)
            capture = Path(tmp, "capture.jsonl")
            bash_env = Path(tmp, "bash_env")
            bash_env.write_text("ulimit() { :; }\n")
            for extra in ({}, FALLBACK_ENV):
                capture.unlink(missing_ok=True)
                env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": "/home/user", "VERL_USE_UV": "0",
                       "CAPTURE": str(capture), "BASH_ENV": str(bash_env), **extra}
                proc = subprocess.run(["bash", str(script)], cwd=work, env=env, capture_output=True, text=True,
                                      timeout=60)
                calls = [json.loads(line) for line in capture.read_text().splitlines()] if capture.exists() else []
                if calls:
                    break
            if not calls:
                print(f"{name}: no verl entry point called (exit {proc.returncode})", file=sys.stderr)
                continue
            call = calls[0]
            args, config_name, config_path = [], None, None
            for arg in call["args"]:
                if arg.startswith("--config-name="):
                    config_name = arg.split("=", 1)[1]
                elif arg.startswith("--config-path="):
                    config_path = arg.split("=", 1)[1]
                else:
                    args.append(arg)
            scripts[name] = {"entry": call["entry"], "config_name": config_name, "config_path": config_path,
                             "env": extra, "overrides": args}
    return scripts


def main() -> None:
    git_dir, commit = sys.argv[1], sys.argv[2]
    date = subprocess.run(["git", "--git-dir", git_dir, "show", "-s", "--format=%cs", commit], check=True,
                          capture_output=True, text=True).stdout.strip()
    data = {"source": "https://github.com/verl-project/verl", "commit": commit, "date": date,
            "license": "Apache-2.0 (verl); only the override lists the scripts pass to verl are kept",
            "how": "packages/core/tests/config/verl_scripts_gen.py", "scripts": extract(git_dir, commit)}
    OUT.write_text(json.dumps(data, indent=1) + "\n")
    print(f"{len(data['scripts'])} scripts -> {OUT}")


if __name__ == "__main__":
    os.umask(0o022)
    main()
