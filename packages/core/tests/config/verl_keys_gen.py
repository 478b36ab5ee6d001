"""Capture verl's trainer config trees: ``fixtures/verl_keys.json`` (every key with its default value) and
the trees polyrl ships for ``--config-name ppo_trainer`` / ``ppo_megatron_trainer``
(``polyrl/config/verl_defaults/*.yaml``).

This script reads a verl checkout, never polyrl, and is not collected by pytest. It takes the composed
trees verl keeps in ``verl/trainer/config/_generated_*.yaml`` (what Hydra makes of ``ppo_trainer.yaml``
and its ``defaults:`` list), flattens them to ``dotted.key -> default`` (interpolations kept as written, so
``${oc.select:...}`` still follows the keys it names) and writes both files.

The trees are verl's current ones with the keys of an older verl that the current one dropped kept at their
old defaults (:func:`union`), so that older scripts still resolve; the legacy reward keys verl now keeps as
nulls and migrates (``reward_model.*``, ``custom_reward_function.*``, ``legacy_reward_impl.yaml``) keep their
old defaults too, which the table maps.

verl commits: verl-project/verl 1dda039b9c6311889a9c9a26040677e1254814f9 (2026-08-22, current), over
volcengine/verl b178a3cd56f58b2d502255daba591e92833930a7 (2026-01-29, legacy). How it was run:

    .venv/bin/python packages/core/tests/config/verl_keys_gen.py /path/to/verl-git-dir <commit> \
        /path/to/older-verl-git-dir <older commit>
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


#: Legacy keys verl's current tree keeps as nulls (it migrates them to reward.*): their old defaults are kept.
LEGACY_REWARD = ("reward_model.", "custom_reward_function.")


def _tree(git_dir: str, commit: str, file: str) -> dict:
    text = subprocess.run(["git", "--git-dir", git_dir, "show", f"{commit}:verl/trainer/config/{file}"],
                          check=True, capture_output=True, text=True).stdout
    return flatten(yaml.safe_load(text))


def union(new: dict, old: dict) -> dict:
    """``new`` plus the keys of ``old`` it lacks (unless one is a subtree of the other), legacy reward keys at
    their old defaults."""
    parents = {k.rsplit(".", i)[0] for k in new for i in range(1, k.count(".") + 1)}
    out = dict(new)
    for key, value in old.items():
        if key in new:
            if key.startswith(LEGACY_REWARD) and new[key] is None and value is not None:
                out[key] = value
            continue
        prefixes = {key.rsplit(".", i)[0] for i in range(1, key.count(".") + 1)}
        if key in parents or prefixes & set(new):
            continue
        out[key] = value
    return out


def main(git_dir: str, commit: str, old_git_dir: str, old_commit: str) -> None:
    fixture: dict = {"verl_commit": commit, "legacy_verl_commit": old_commit, "trees": {}}
    for name, file in TREES.items():
        flat = union(_tree(git_dir, commit, file), _tree(old_git_dir, old_commit, file))
        # the choice verl's defaults list makes (`model_engine: dp`, `override model_engine: megatron`), which
        # Hydra keeps out of the composed tree but a command line may set
        flat["model_engine"] = "megatron" if "megatron" in name else "dp"
        fixture["trees"][name] = flat
        header = (f"# verl's {name} defaults (verl {commit[:12]}, with the keys verl {old_commit[:12]} had and it\n"
                  "# dropped kept at their old defaults), composed and flattened by\n"
                  "# packages/core/tests/config/verl_keys_gen.py. polyrl's verl front end starts from this tree\n"
                  f"# for --config-name {name}; docs/from_verl.md says what each key becomes.\n")
        (SHIPPED / f"{name}.yaml").write_text(header + yaml.safe_dump(unflatten(flat), sort_keys=False, width=120))
    (HERE / "fixtures" / "verl_keys.json").write_text(json.dumps(fixture, indent=1) + "\n")


if __name__ == "__main__":
    main(*sys.argv[1:5])
