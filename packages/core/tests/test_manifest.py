"""The manifest: parsing, unknown keys, requirements, modules, resolved output."""

from __future__ import annotations

import pytest

from polyrl.errors import ManifestError, PluginLoadError
from polyrl.manifest import Manifest
from polyrl.plugins import PluginManager


def write(tmp_path, text):
    path = tmp_path / "polyrl.toml"
    path.write_text(text)
    return path


def test_malformed_toml_names_file_and_line(tmp_path):
    path = write(tmp_path, '[plugins]\nrequire = ["a"\nmodules = []\n')
    with pytest.raises(ManifestError) as err:
        Manifest.load(path)
    assert str(path) in str(err.value) and "malformed TOML" in str(err.value) and "line 3" in str(err.value)


def test_unknown_keys_suggest(tmp_path):
    with pytest.raises(ManifestError, match="unknown key 'plugins.requires'.*Did you mean 'require'"):
        Manifest.load(write(tmp_path, '[plugins]\nrequires = ["x"]\n'))
    with pytest.raises(ManifestError, match="unknown key 'plugin'.*Did you mean 'plugins'"):
        Manifest.load(write(tmp_path, '[plugin]\nrequire = ["x"]\n'))


def test_missing_plugin_gives_pip_line_only_for_polyrls_own(tmp_path, monkeypatch):
    import polyrl.manifest

    m = Manifest.load(write(tmp_path, '[plugins]\nrequire = ["polyrl-not-installed>=0.1"]\n'))
    with pytest.raises(ManifestError, match=r"not installed\. Fix the name in \[plugins\]\.require") as err:
        m.check_requirements()  # a name polyrl does not know: no install line (typo-squatting)
    assert "pip install 'polyrl-not-installed" not in str(err.value)
    # one of polyrl's own packages (all installed here: pretend this one is polyrl's) keeps its install line
    monkeypatch.setattr(polyrl.manifest, "OWN_DISTRIBUTIONS", ("polyrl-not-installed",))
    with pytest.raises(ManifestError, match=r"not installed\. Install it: pip install 'polyrl-not-installed>=0.1'"):
        m.check_requirements()


def test_version_out_of_range_shows_both(tmp_path):
    m = Manifest.load(write(tmp_path, '[plugins]\nrequire = ["polyrl>=9.0"]\n'))
    with pytest.raises(ManifestError, match=r"requires 'polyrl>=9.0', but polyrl 0\.1\.0 is installed"):
        m.check_requirements()


def test_bad_requirement_syntax(tmp_path):
    with pytest.raises(ManifestError, match="not PEP 508"):
        Manifest.load(write(tmp_path, '[plugins]\nrequire = ["polyrl >>= 1"]\n'))


def test_module_that_does_not_import(tmp_path, monkeypatch):
    m = Manifest.load(write(tmp_path, '[plugins]\nmodules = ["polyrl_missing_mod.hooks"]\n'))
    with pytest.raises(PluginLoadError) as err:
        PluginManager(m, entry_points=False)
    msg = str(err.value)
    assert f"manifest {tmp_path / 'polyrl.toml'} plugins.modules entry 'polyrl_missing_mod.hooks'" in msg
    assert "no module named 'polyrl_missing_mod'" in msg and "PYTHONPATH" in msg
    # a module that exists but fails inside: the traceback shows where
    (tmp_path / "polyrl_half_hooks.py").write_text("import polyrl_dependency_not_installed\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    m = Manifest.load(write(tmp_path, '[plugins]\nmodules = ["polyrl_half_hooks"]\n'))
    with pytest.raises(PluginLoadError) as err:
        PluginManager(m, entry_points=False)
    msg = str(err.value)
    assert "'polyrl_half_hooks' failed to import" in msg and "Traceback" in msg
    assert "polyrl_half_hooks.py" in msg and "No module named 'polyrl_dependency_not_installed'" in msg


def test_module_plugin_registers(tmp_path, monkeypatch):
    (tmp_path / "my_hooks.py").write_text(
        "from polyrl import hookimpl\n"
        "@hookimpl\n"
        "def register_reward_functions(register):\n"
        "    register('always_one', lambda *a, **k: 1.0)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    m = Manifest.load(write(tmp_path, '[plugins]\nmodules = ["my_hooks"]\n'))
    pm = PluginManager(m, entry_points=False)
    assert pm.get("reward_function", "always_one")("x", "y", "z") == 1.0


def test_resolved_pins_installed_versions(tmp_path):
    m = Manifest.load(write(tmp_path, '[plugins]\nrequire = ["polyrl>=0.1"]\nblock = ["polyrl-hw-rocm"]\n'))
    text = m.to_toml(resolved=True)
    assert 'require = ["polyrl==0.1.0"]' in text and 'block = ["polyrl-hw-rocm"]' in text
    assert Manifest.from_dict(__import__("tomllib").loads(text)).require == ("polyrl==0.1.0",)


def test_missing_file_and_key_outside_the_table(tmp_path):
    with pytest.raises(ManifestError, match=r"nope\.toml does not exist"):
        Manifest.load(tmp_path / "nope.toml")
    with pytest.raises(ManifestError, match=r"key 'require' must be inside the \[plugins\] table"):
        Manifest.load(write(tmp_path, 'require = ["polyrl"]\n'))


def test_wrong_value_types_name_the_key(tmp_path):
    with pytest.raises(ManifestError, match=r"plugins\.modules must be a list of strings, got 'my_hooks'"):
        Manifest.load(write(tmp_path, '[plugins]\nmodules = "my_hooks"\n'))
    with pytest.raises(ManifestError, match=r"\[plugins\] must be a table"):
        Manifest.load(write(tmp_path, 'plugins = 3\n'))


def test_requirement_for_another_platform_is_skipped(tmp_path):
    m = Manifest.load(write(tmp_path, '[plugins]\nrequire = ["polyrl-not-installed; sys_platform == \'nope\'"]\n'))
    assert m.check_requirements() == {} and m.required_distributions() == set()


def test_resolved_keeps_extras_and_round_trips(tmp_path):
    m = Manifest.load(write(tmp_path, '[plugins]\nrequire = ["polyrl[dev]>=0.1"]\nmodules = ["a.b"]\n'))
    resolved = Manifest.from_dict(__import__("tomllib").loads(m.to_toml(resolved=True)))
    assert resolved.require == ("polyrl[dev]==0.1.0",) and resolved.modules == ("a.b",)
    assert Manifest.from_dict(__import__("tomllib").loads(m.to_toml())) == Manifest(require=m.require, modules=m.modules)


def test_blocking_a_builtin(tmp_path):
    m = Manifest.load(write(tmp_path, '[plugins]\nblock = ["polyrl.data.hooks"]\n'))
    pm = PluginManager(m, entry_points=False)
    assert "polyrl.data.hooks" not in pm.plugins and len(pm.registry("dataset")) == 0
