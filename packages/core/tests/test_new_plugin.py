"""``polyrl new-plugin``: each kind's generated package is well-formed and its generated tests pass."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

from polyrl.cli import main
from polyrl.plugin_template import KINDS, plugin_names

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def generated(tmp_path_factory) -> dict[str, Path]:
    """One package per kind, made through the CLI: ``{kind: package folder}``."""
    dest = tmp_path_factory.mktemp("plugins")
    out = {}
    for kind in KINDS:
        assert main(["new-plugin", f"acme-{kind}", "--kind", kind, "--dest", str(dest)]) == 0
        out[kind] = dest / f"polyrl-acme-{kind}"
    return out


@pytest.mark.parametrize("kind", list(KINDS))
def test_package_layout_and_metadata(generated, kind):
    root = generated[kind]
    module = f"polyrl_acme_{kind}"
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    assert project["name"] == f"polyrl-acme-{kind}"
    assert project["entry-points"]["polyrl"] == {f"acme-{kind}": f"{module}.hooks"}
    assert project["dependencies"][0].startswith("polyrl>=") and ",<" in project["dependencies"][0]
    assert project["license"] == "Apache-2.0" and project["optional-dependencies"]["test"] == ["polyrl[testing]"]
    assert (root / "LICENSE").read_text() == (ROOT / "LICENSE").read_text()
    assert "## Unreleased" in (root / "CHANGELOG.md").read_text()
    readme = (root / "README.md").read_text()
    assert f"acme_{kind}" in readme and "{{" not in readme
    for path in [root / "src" / module / name for name in ("__init__.py", "__about__.py", "hooks.py", "py.typed",
                                                           f"{KINDS[kind].module}.py")]:
        assert path.is_file(), path
    assert (root / "tests" / "conftest.py").read_text().strip().endswith('pytest_plugins = ["polyrl.testing"]')
    assert not [p for p in root.rglob("*") if p.is_file() and "{{" in p.read_text()]


def test_generated_tests_pass(generated):
    """Every kind's generated tests (its conformance suite) pass as generated, with the generated hooks module
    loaded from its source folder (no install needed)."""
    # the engine last: it leaves a torch.distributed group behind, and the platform suite needs none
    kinds = sorted(KINDS, key=lambda k: k == "engine")
    if not importlib.util.find_spec("polyrl_engine_fsdp"):  # the engine template builds on polyrl-engine-fsdp
        kinds.remove("engine")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(str(generated[k] / "src") for k in kinds))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--import-mode=importlib",
                           *[str(generated[k] / "tests") for k in kinds]],
                          cwd=generated[kinds[0]].parent, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    summary = proc.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "skipped" not in summary, summary


def test_generated_code_is_ruff_clean(generated):
    pytest.importorskip("ruff")
    for root in generated.values():
        proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--isolated", "--select", "E,F,I,UP,B,W",
                               "--line-length", "120", "--target-version", "py310", "."],
                              cwd=root, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stdout


def test_name_rules():
    assert plugin_names("polyrl-my-rm") == {"name": "my-rm", "dist": "polyrl-my-rm", "module": "polyrl_my_rm",
                                           "registered": "my_rm", "Class": "MyRm"}
    for bad in ("My-Plugin", "1abc", "a_b", "a--b", "polyrl", "x-"):
        assert main(["new-plugin", bad, "--kind", "reward", "--dest", "/nonexistent"]) == 2, bad


def test_existing_folder_is_not_overwritten(tmp_path, capsys):
    (tmp_path / "polyrl-mine").mkdir()
    assert main(["new-plugin", "mine", "--kind", "tool", "--dest", str(tmp_path)]) == 2
    assert "already exists" in capsys.readouterr().err
    assert not any((tmp_path / "polyrl-mine").iterdir())


def test_unknown_kind_is_a_usage_error(tmp_path):
    with pytest.raises(SystemExit) as exc:
        main(["new-plugin", "mine", "--kind", "sampler", "--dest", str(tmp_path)])
    assert exc.value.code == 2


def test_description_with_quotes_and_backslashes_is_escaped(tmp_path):
    import ast

    text = 'Scores "exact" answers, C:\\path\\ and {braces} \u2603 "'
    for kind in KINDS:
        assert main(["new-plugin", f"q-{kind}", "--kind", kind, "--dest", str(tmp_path), "--description", text]) == 0
        root = tmp_path / f"polyrl-q-{kind}"
        assert tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8"))["project"]["description"] == text
        module = root / "src" / f"polyrl_q_{kind.replace('-', '_')}"
        assert ast.get_docstring(ast.parse((module / "__init__.py").read_text(encoding="utf-8"))) == text
        hooks = ast.parse((module / "hooks.py").read_text(encoding="utf-8"))
        descriptions = [kw.value.value for node in ast.walk(hooks) if isinstance(node, ast.Call)
                        for kw in node.keywords if kw.arg == "description" and isinstance(kw.value, ast.Constant)]
        assert descriptions
        if "{{description_str}}" in (ROOT / f"packages/core/src/polyrl/plugin_template/files/{kind}/hooks.py.tmpl"
                                     ).read_text():
            assert descriptions == [text]
        assert text in (root / "README.md").read_text(encoding="utf-8")


@pytest.mark.parametrize("text", ["uses {{name}} here", "a }} b", "two\nlines"])
def test_description_the_templates_cannot_hold_is_refused(tmp_path, capsys, text):
    assert main(["new-plugin", "mine", "--kind", "reward", "--dest", str(tmp_path), "--description", text]) == 2
    err = capsys.readouterr().err
    assert "--description" in err and "Traceback" not in err
    assert not (tmp_path / "polyrl-mine").exists()
