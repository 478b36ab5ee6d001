"""The same manifest rebuilds the same registries inside a real Ray actor."""

from __future__ import annotations

import shutil
import tempfile

import pytest


def _names(pm):
    return {kind: sorted(reg.names(include_aliases=True)) for kind, reg in pm.registries.items()}


def test_manifest_rebuilds_registries_in_a_ray_actor(tmp_path, monkeypatch):
    ray = pytest.importorskip("ray")
    (tmp_path / "extra_hooks.py").write_text(
        "from polyrl import hookimpl\n"
        "@hookimpl\n"
        "def register_reward_functions(register):\n"
        "    register('from_module', 'json:dumps')\n"
    )
    manifest = tmp_path / "polyrl.toml"
    manifest.write_text('[plugins]\nrequire = ["polyrl>=0.1"]\nmodules = ["extra_hooks"]\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    from polyrl.manifest import Manifest
    from polyrl.plugins import PluginManager

    local = _names(PluginManager(Manifest.load(manifest)))
    assert "from_module" in local["reward_function"]

    @ray.remote
    class Probe:
        def names(self, path):
            from polyrl import plugins

            pm = plugins.activate(path)
            return {kind: sorted(reg.names(include_aliases=True)) for kind, reg in pm.registries.items()}

    # Ray's unix socket paths must stay under 107 bytes; pytest's tmp_path is too deep for that.
    short = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    ray.init(num_cpus=1, _temp_dir=short, include_dashboard=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(tmp_path), "RAY_AUTH_MODE": "disabled"}})
    try:
        remote = ray.get(Probe.remote().names.remote(str(manifest)), timeout=300)
    finally:
        ray.shutdown()
        shutil.rmtree(short, ignore_errors=True)
    assert remote == local
