"""The same manifest rebuilds the same registries inside a real Ray actor."""

from __future__ import annotations

import shutil
import tempfile

import pytest

PROBE_HOOKS = (
    "from polyrl import hookimpl\n"
    "@hookimpl\n"
    "def register_tools(register):\n"
    "    register('probe_tool', 'json:dumps', aliases=['pt'], description='from an installed distribution')\n"
)
MODULE_HOOKS = (
    "from polyrl import hookimpl\n"
    "@hookimpl\n"
    "def register_reward_functions(register):\n"
    "    register('from_module', 'json:dumps')\n"
)


def test_manifest_rebuilds_registries_in_a_ray_actor(tmp_path, monkeypatch):
    ray = pytest.importorskip("ray")
    # An installed distribution with a polyrl entry point, and a bare hooks module, both on PYTHONPATH
    # so that the worker process finds them exactly as the driver does.
    site = tmp_path / "site"
    info = site / "polyrl_ray_probe-1.0.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: polyrl-ray-probe\nVersion: 1.0.0\n")
    (info / "entry_points.txt").write_text("[polyrl]\nray-probe = ray_probe_hooks\n")
    (site / "ray_probe_hooks.py").write_text(PROBE_HOOKS)
    (site / "extra_hooks.py").write_text(MODULE_HOOKS)
    manifest = tmp_path / "polyrl.toml"
    manifest.write_text(
        "[plugins]\n"
        'require = ["polyrl>=0.1", "polyrl-ray-probe>=1.0,<2"]\n'
        'modules = ["extra_hooks"]\n'
        'block = ["polyrl.data.hooks"]\n'
    )
    monkeypatch.syspath_prepend(str(site))
    from polyrl.manifest import Manifest
    from polyrl.plugins import PluginManager

    local = PluginManager(Manifest.load(manifest)).describe()
    local_names = [p["name"] for p in local]
    assert "ray-probe" in local_names and "extra_hooks" in local_names and "polyrl.data.hooks" not in local_names

    @ray.remote
    class Probe:
        def describe(self, path):
            from polyrl import plugins

            pm = plugins.activate(path)
            assert plugins.get_plugin_manager() is pm
            # import strings resolve in the worker too
            return pm.describe(), pm.get("tool", "pt")({"a": 1}), pm.get("reward_function", "from_module")([2])

    # Ray's unix socket paths must stay under 107 bytes; pytest's tmp_path is too deep for that.
    short = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    ray.init(num_cpus=1, _temp_dir=short, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(site), "RAY_AUTH_MODE": "disabled", "OMP_NUM_THREADS": "1"}})
    try:
        remote, tool_out, reward_out = ray.get(Probe.remote().describe.remote(str(manifest)), timeout=300)
    finally:
        ray.shutdown()
        shutil.rmtree(short, ignore_errors=True)
    assert remote == local  # same plugins, distributions, versions, hooks, names, targets, in the same order
    assert (tool_out, reward_out) == ('{"a": 1}', "[2]")
