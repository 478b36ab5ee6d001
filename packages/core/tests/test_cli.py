"""The polyrl CLI: --version, plugins (text and JSON), clean errors, room for more verbs."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from polyrl.__about__ import __version__
from polyrl.cli import COMMANDS, build_parser, main


def run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "polyrl", *args], capture_output=True, text=True, timeout=120,
                          env=env)


def plugins_json(capsys, *args: str) -> dict:
    assert main(["plugins", "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.smoke
def test_version():
    assert run("--version").stdout.strip() == f"polyrl {__version__}"


@pytest.mark.smoke
def test_console_script_is_installed():
    script = Path(sys.executable).parent / "polyrl"
    if not script.exists():
        script = shutil.which("polyrl")
    if script is None:
        pytest.skip("the polyrl console script is not on PATH (install the package, e.g. pip install -e packages/core)")
    proc = subprocess.run([str(script), "--version"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == f"polyrl {__version__}"


@pytest.mark.smoke
def test_plugins_json_lists_builtins_and_their_names(capsys):
    data = plugins_json(capsys)
    assert data["polyrl_version"] == __version__ and data["manifest"] is None
    by_name = {p["name"]: p for p in data["plugins"]}
    algo = by_name["polyrl.algorithms.hooks"]
    assert algo["distribution"] == "polyrl" and algo["version"] == __version__
    assert "register_advantage_estimators" in algo["hooks"]
    assert "grpo" in algo["registered"]["advantage_estimator"]
    grpo = next(e for e in algo["entries"]["advantage_estimator"] if e["name"] == "grpo")
    assert grpo["target"].startswith("polyrl.algorithms")
    for plugin in data["plugins"]:  # the stable keys machines rely on
        assert set(plugin) == {"name", "distribution", "version", "module", "hooks", "registered", "entries"}


def test_plugins_json_lists_an_installed_plugin(capsys, tmp_path, monkeypatch):
    site = tmp_path / "site"
    (site / "polyrl_cli_probe-0.4.0.dist-info").mkdir(parents=True)
    (site / "polyrl_cli_probe-0.4.0.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: polyrl-cli-probe\nVersion: 0.4.0\n")
    (site / "polyrl_cli_probe-0.4.0.dist-info" / "entry_points.txt").write_text("[polyrl]\nprobe = probe_hooks\n")
    (site / "probe_hooks.py").write_text(
        "from polyrl import hookimpl\n@hookimpl\ndef register_policy_losses(register):\n"
        "    register('probe_loss', 'probe_hooks:loss')\n")
    monkeypatch.syspath_prepend(str(site))
    probe = {p["name"]: p for p in plugins_json(capsys)["plugins"]}["probe"]
    assert probe["distribution"] == "polyrl-cli-probe" and probe["version"] == "0.4.0"
    assert probe["hooks"] == ["register_policy_losses"] and probe["registered"] == {"policy_loss": ["probe_loss"]}
    # a manifest that does not require it does not load it
    manifest = tmp_path / "m.toml"
    manifest.write_text("[plugins]\nrequire = []\n")
    names = [p["name"] for p in plugins_json(capsys, "--manifest", str(manifest))["plugins"]]
    assert "probe" not in names and "polyrl.algorithms.hooks" in names


def test_plugins_json_lists_the_example_plugin(capsys):
    pytest.importorskip("polyrl_example", reason="pip install -e examples/plugins/polyrl-example (CI does)")
    example = {p["name"]: p for p in plugins_json(capsys)["plugins"]}["example"]
    assert example["distribution"] == "polyrl-example"
    assert example["registered"] == {"reward_manager": ["clipped"], "reward_function": ["concise"],
                                     "advantage_estimator": ["sign"]}


def test_plugins_text_with_manifest(tmp_path, capsys):
    m = tmp_path / "m.toml"
    m.write_text("[plugins]\nrequire = []\n")
    assert main(["plugins", "--manifest", str(m)]) == 0
    out = capsys.readouterr().out
    assert f"manifest {m}" in out and "polyrl.algorithms.hooks  (polyrl" in out
    assert "advantage_estimator: gae, " in out
    assert main(["plugins", "-m", str(m), "-v"]) == 0
    assert "grpo -> polyrl.algorithms" in capsys.readouterr().out


def test_bad_manifest_is_a_clean_error(tmp_path):
    m = tmp_path / "m.toml"
    m.write_text("[plugins]\nrequire = [\n")
    proc = run("plugins", "--manifest", str(m))
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith(f"polyrl plugins: error: manifest {m}: malformed TOML")
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_traceback_flag_and_debug_env(tmp_path, capsys, monkeypatch):
    m = tmp_path / "m.toml"
    m.write_text('[plugins]\nrequire = ["polyrl-not-installed"]\n')
    for argv in (["--traceback", "plugins", "-m", str(m)], ["plugins", "-m", str(m), "--traceback"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        # not one of polyrl's own distributions: named, with no pip line for a name that may be a typo
        assert "Traceback" in err and "'polyrl-not-installed'" in err and "pip install 'polyrl-not" not in err
    assert main(["plugins", "-m", str(m)]) == 2
    assert "Traceback" not in capsys.readouterr().err
    monkeypatch.setenv("POLYRL_DEBUG", "1")
    assert main(["plugins", "-m", str(m)]) == 2
    assert "Traceback" in capsys.readouterr().err


def test_no_verb_prints_help_and_every_verb_has_a_handler(capsys):
    assert main([]) == 1
    out = capsys.readouterr().out
    for verb, (handler, help_text, _) in COMMANDS.items():
        assert verb in out and help_text in out and handler.__name__ == f"cmd_{verb.replace('-', '_')}"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["no-such-verb"])


def test_overrides_may_follow_options(tmp_path, capsys, monkeypatch):
    """`polyrl export CKPT --to DIR key=value`: the override after `--to` reaches the verb (argparse alone stops)."""
    seen = {}

    def fake_export(args):
        seen.update(vars(args))
        return 0

    monkeypatch.setitem(COMMANDS, "export", (fake_export, *COMMANDS["export"][1:]))
    assert main(["export", "CKPT", "--to", str(tmp_path), "actor.fsdp.lora_export=adapter", "a.b=1"]) == 0
    assert seen["checkpoint"] == "CKPT" and seen["overrides"] == ["actor.fsdp.lora_export=adapter", "a.b=1"]
    with pytest.raises(SystemExit):
        main(["export", "CKPT", "--to", str(tmp_path), "--bogus"])
    with pytest.raises(SystemExit):
        main(["plugins", "a=1"])  # a verb without overrides
    assert "unrecognized arguments" in capsys.readouterr().err
