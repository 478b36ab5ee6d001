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
    assert str(path) in str(err.value) and "line" in str(err.value)


def test_unknown_keys_suggest(tmp_path):
    with pytest.raises(ManifestError, match="unknown key 'plugins.requires'.*Did you mean 'require'"):
        Manifest.load(write(tmp_path, '[plugins]\nrequires = ["x"]\n'))
    with pytest.raises(ManifestError, match="unknown key 'plugin'.*Did you mean 'plugins'"):
        Manifest.load(write(tmp_path, '[plugin]\nrequire = ["x"]\n'))


def test_missing_plugin_gives_pip_line(tmp_path):
    m = Manifest.load(write(tmp_path, '[plugins]\nrequire = ["polyrl-not-installed>=0.1"]\n'))
    with pytest.raises(ManifestError, match=r"not installed\. Install it: pip install 'polyrl-not-installed>=0.1'"):
        m.check_requirements()


def test_version_out_of_range_shows_both(tmp_path):
    m = Manifest.load(write(tmp_path, '[plugins]\nrequire = ["polyrl>=9.0"]\n'))
    with pytest.raises(ManifestError, match=r"requires 'polyrl>=9.0', but polyrl 0\.1\.0 is installed"):
        m.check_requirements()


def test_bad_requirement_syntax(tmp_path):
    with pytest.raises(ManifestError, match="not PEP 508"):
        Manifest.load(write(tmp_path, '[plugins]\nrequire = ["polyrl >>= 1"]\n'))


def test_module_that_does_not_import(tmp_path):
    m = Manifest.load(write(tmp_path, '[plugins]\nmodules = ["polyrl_missing_mod.hooks"]\n'))
    with pytest.raises(PluginLoadError) as err:
        PluginManager(m, entry_points=False)
    assert "polyrl_missing_mod.hooks" in str(err.value) and "Traceback" in str(err.value)


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
