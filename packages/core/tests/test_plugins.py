"""The plugin manager: built-ins, entry points, bad plugins, tracing, the test harness."""

from __future__ import annotations

import subprocess
import sys
import types

import pytest

from polyrl import hookimpl
from polyrl.errors import PluginLoadError, RegistryError
from polyrl.plugins import DEFAULT_PLUGINS, PluginManager
from polyrl.registry import HOOK_FOR_KIND, PluginInfo


def test_builtins_register_through_the_same_hooks():
    pm = PluginManager(None, entry_points=False)
    assert set(DEFAULT_PLUGINS) <= set(pm.plugins)
    assert "grpo" in pm.registry("advantage_estimator")
    assert "vanilla" in pm.registry("policy_loss")
    assert {"hf"} <= set(pm.registry("rollout").names())
    assert {"naive", "batch", "dapo"} <= set(pm.registry("reward_manager").names())
    assert {"cpu", "cuda"} <= set(pm.registry("platform").names())


def test_misspelled_hook_fails_at_load():
    plugin = types.ModuleType("typo_plugin")

    @hookimpl
    def register_engine(register):  # missing 's'
        register("x", object())

    plugin.register_engine = register_engine
    pm = PluginManager(None, entry_points=False)
    with pytest.raises(PluginLoadError) as err:
        pm.add_plugin(plugin, PluginInfo("typo_plugin"))
    assert "typo_plugin" in str(err.value) and "register_engine" in str(err.value) and "register_engines" in str(err.value)
    assert "typo_plugin" not in pm.plugins


def test_two_plugins_same_name_names_both():
    class First:
        @hookimpl
        def register_reward_managers(self, register):
            register("shared", object())

    class Second(First):
        pass

    pm = PluginManager(None, entry_points=False)
    pm.add_plugin(First(), PluginInfo("first", "first-dist", "1.0"))
    with pytest.raises(RegistryError) as err:
        pm.add_plugin(Second(), PluginInfo("second", "second-dist", "2.0"))
    assert "first-dist 1.0" in str(err.value) and "second-dist 2.0" in str(err.value)
    assert "second" not in pm.plugins  # a failed plugin leaves nothing behind


def test_a_plugin_may_accept_no_arguments():
    seen = []

    class NoArgs:
        @hookimpl
        def register_tools(self):
            seen.append(True)

    PluginManager(None, entry_points=False).add_plugin(NoArgs(), PluginInfo("noargs"))
    assert seen == [True]


def test_harness_registers_and_removes(polyrl_plugins):
    class Mine:
        @hookimpl
        def register_advantage_estimators(self, register):
            register("mine", lambda *a, **k: ("adv", "ret"))

    polyrl_plugins.register(Mine(), name="mine-plugin")
    from polyrl.algorithms import get_adv_estimator_fn

    assert get_adv_estimator_fn("mine")() == ("adv", "ret")
    polyrl_plugins.pm.remove_plugin("mine-plugin")
    with pytest.raises(RegistryError):
        get_adv_estimator_fn("mine")


def test_trace_hooks_prints_calls():
    code = "from polyrl.plugins import PluginManager; PluginManager(None, entry_points=False)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={"POLYRL_TRACE_HOOKS": "1", "PATH": ""}, timeout=120)
    assert "[polyrl hooks] register_advantage_estimators() -> polyrl.algorithms.hooks" in proc.stderr


def test_every_kind_has_a_hookspec():
    from polyrl import hookspecs

    for hook in HOOK_FOR_KIND.values():
        assert callable(getattr(hookspecs, hook))


def test_entry_point_plugin_loads_with_its_distribution():
    pytest.importorskip("polyrl_example", reason="pip install -e examples/plugins/polyrl-example (CI does)")
    pm = PluginManager(None)
    info = pm.plugins["example"]
    assert info.distribution == "polyrl-example" and info.version
    assert pm.entry("advantage_estimator", "sign").plugin.name == "example"
