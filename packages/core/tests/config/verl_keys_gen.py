"""Capture verl's trainer config trees: ``fixtures/verl_keys.json`` (every key with its default value) and
the trees polyrl ships for ``--config-name ppo_trainer`` / ``ppo_megatron_trainer``
(``polyrl/config/verl_defaults/*.yaml``).

This script reads a verl checkout, never polyrl, and is not collected by pytest. It takes the composed
trees verl keeps in ``verl/trainer/config/_generated_*.yaml`` (what Hydra makes of ``ppo_trainer.yaml``
and its ``defaults:`` list), flattens them to ``dotted.key -> default`` (interpolations kept as written, so
``${oc.select:...}`` still follows the keys it names) and writes both files.

verl commit: volcengine/verl b178a3cd56f58b2d502255daba591e92833930a7 (2026-01-29). How it was run:

    .venv/bin/python packages/core/tests/config/verl_keys_gen.py /path/to/verl-git-dir <commit>
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
SHIPPED = HERE.parents[1] / "src" / "polyrl" / "config" / "verl_defaults"
TREES = {"ppo_trainer": "_generated_ppo_trainer.yaml", "ppo_megatron_trainer": "_generated_ppo_megatron_trainer.yaml"}


def flatten(tree: dict, prefix: str = "") -> dict:
    out: dict = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def unflatten(flat: dict) -> dict:
    tree: dict = {}
    for key, value in flat.items():
        node = tree
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return tree


def main(git_dir: str, commit: str) -> None:
    fixture: dict = {"verl_commit": commit, "trees": {}}
    for name, file in TREES.items():
        text = subprocess.run(["git", "--git-dir", git_dir, "show", f"{commit}:verl/trainer/config/{file}"],
                              check=True, capture_output=True, text=True).stdout
        flat = flatten(yaml.safe_load(text))
        fixture["trees"][name] = flat
        header = (f"# verl's {name} defaults (verl {commit[:12]}), composed and flattened by\n"
                  "# packages/core/tests/config/verl_keys_gen.py. polyrl's verl front end starts from this tree\n"
                  f"# for --config-name {name}; docs/from_verl.md says what each key becomes.\n")
        (SHIPPED / f"{name}.yaml").write_text(header + yaml.safe_dump(unflatten(flat), sort_keys=False, width=120))
    (HERE / "fixtures" / "verl_keys.json").write_text(json.dumps(fixture, indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
