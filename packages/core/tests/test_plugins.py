"""The plugin manager: built-ins, entry points, bad plugins, tracing, the test harness."""

from __future__ import annotations

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


# ---------------------------------------------------------------------- installed distributions
def install_fake_dist(site, dist, version, entry_points, modules):
    """Write a real (minimal) installed distribution into ``site``: what pip leaves behind."""
    info = site / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text(
        "[polyrl]\n" + "".join(f"{name} = {target}\n" for name, target in entry_points.items())
    )
    for module, code in modules.items():
        (site / f"{module}.py").write_text(code)


GOOD_HOOKS = (
    "from polyrl import hookimpl\n"
    "@hookimpl\n"
    "def register_tools(register):\n"
    "    register('abacus', 'json:loads', aliases='calc', description='a calculator')\n"
)


@pytest.fixture
def site(tmp_path, monkeypatch):
    path = tmp_path / "site"
    path.mkdir()
    monkeypatch.syspath_prepend(str(path))
    return path


def test_entry_point_of_an_installed_distribution_loads(site):
    install_fake_dist(site, "polyrl-fake-tools", "1.2.3", {"fake-tools": "fake_tools_hooks"},
                      {"fake_tools_hooks": GOOD_HOOKS})
    pm = PluginManager(None)
    assert pm.plugins["fake-tools"] == PluginInfo("fake-tools", "polyrl-fake-tools", "1.2.3", "fake_tools_hooks")
    assert pm.get("tool", "calc") is __import__("json").loads
    [desc] = [p for p in pm.describe() if p["name"] == "fake-tools"]
    assert desc["hooks"] == ["register_tools"] and desc["registered"] == {"tool": ["abacus"]}
    assert desc["entries"]["tool"][0] == {"name": "abacus", "target": "json:loads", "aliases": ["calc"],
                                          "description": "a calculator"}


def test_manifest_selects_and_blocks_distributions(site, tmp_path):
    from polyrl.manifest import Manifest

    install_fake_dist(site, "polyrl-fake-tools", "1.2.3", {"fake-tools": "fake_tools_hooks"},
                      {"fake_tools_hooks": GOOD_HOOKS})
    assert "fake-tools" not in PluginManager(Manifest()).plugins  # not required: not loaded
    assert "fake-tools" in PluginManager(Manifest(require=("polyrl_fake_tools>=1.2",))).plugins  # any spelling
    blocked = Manifest(require=("polyrl-fake-tools",), block=("polyrl-fake-tools",))
    assert "fake-tools" not in PluginManager(blocked).plugins
    # a module listed in `modules` that an entry point already loaded is loaded once
    both = PluginManager(Manifest(require=("polyrl-fake-tools",), modules=("fake_tools_hooks",)))
    assert [n for n in both.plugins if not n.startswith("polyrl.")] == ["fake-tools"]


def test_entry_point_that_fails_to_import_names_plugin_and_shows_traceback(site):
    install_fake_dist(site, "polyrl-broken", "0.3.0", {"broken": "broken_hooks"},
                      {"broken_hooks": "import polyrl\nraise RuntimeError('boom at import')\n"})
    with pytest.raises(PluginLoadError) as err:
        PluginManager(None)
    msg = str(err.value)
    assert "plugin 'broken' (polyrl-broken 0.3.0" in msg and "broken_hooks" in msg
    assert "Traceback" in msg and "RuntimeError: boom at import" in msg and "block it in the manifest" in msg
    from polyrl.manifest import Manifest

    PluginManager(Manifest(block=("broken",)))  # blocking it is the way out


def test_entry_point_with_misspelled_hook_names_its_distribution(site):
    install_fake_dist(site, "polyrl-typo", "0.1.0", {"typo": "typo_hooks"}, {"typo_hooks": (
        "from polyrl import hookimpl\n@hookimpl\ndef register_advantage_estimator(register):\n    pass\n")})
    with pytest.raises(PluginLoadError) as err:
        PluginManager(None)
    msg = str(err.value)
    assert "polyrl-typo 0.1.0" in msg and "register_advantage_estimator" in msg
    assert "register_advantage_estimators" in msg  # the known hooks are listed


def test_hook_argument_the_hook_does_not_offer():
    class WrongArg:
        @hookimpl
        def register_tools(self, reg):
            pass

    pm = PluginManager(None, entry_points=False)
    with pytest.raises(PluginLoadError, match=r"(?s)plugin 'wrongarg'.*invalid hook implementation.*\{'reg'\}.*offers 'register'"):
        pm.add_plugin(WrongArg(), PluginInfo("wrongarg"))
    assert "wrongarg" not in pm.plugins


def test_exception_inside_a_hook_names_plugin_and_hook():
    class Raises:
        @hookimpl
        def register_datasets(self, register):
            raise KeyError("oops")

    pm = PluginManager(None, entry_points=False)
    with pytest.raises(PluginLoadError) as err:
        pm.add_plugin(Raises(), PluginInfo("raiser", "raiser-dist", "0.0.1"))
    msg = str(err.value)
    assert "raiser-dist 0.0.1" in msg and "register_datasets" in msg and "KeyError: 'oops'" in msg
    assert "raiser" not in pm.plugins


def test_same_module_under_two_names_is_an_error():
    mod = types.ModuleType("twice")
    pm = PluginManager(None, entry_points=False)
    pm.add_plugin(mod, PluginInfo("first"))
    with pytest.raises(PluginLoadError, match="already loaded as plugin 'first'"):
        pm.add_plugin(mod, PluginInfo("second"))
    with pytest.raises(PluginLoadError, match="loaded twice"):
        pm.add_plugin(types.ModuleType("other"), PluginInfo("first"))


def test_harness_is_the_process_wide_manager_and_remove(polyrl_plugins):
    from polyrl.plugins import get_plugin_manager, lookup

    assert get_plugin_manager() is polyrl_plugins.pm
    assert not [n for n in polyrl_plugins.pm.plugins if not n.startswith("polyrl.")]  # no entry points
    mod = types.ModuleType("harness_hooks")
    exec(GOOD_HOOKS, mod.__dict__)
    info = polyrl_plugins.register(mod)
    assert info.name == "harness_hooks" and polyrl_plugins.names("tool") == ["abacus", "calculator", "python"]
    assert lookup("tool", "abacus") is __import__("json").loads
    polyrl_plugins.remove("harness_hooks")
    with pytest.raises(RegistryError, match="unknown tool 'abacus'"):
        lookup("tool", "abacus")
    with pytest.raises(KeyError, match="no plugin 'harness_hooks'"):
        polyrl_plugins.remove("harness_hooks")


def test_trace_hooks_prints_every_hook_call_and_registration(monkeypatch, capsys):
    monkeypatch.setenv("POLYRL_TRACE_HOOKS", "1")
    PluginManager(None, entry_points=False)
    err = capsys.readouterr().err
    assert "[polyrl hooks] register_advantage_estimators() -> polyrl.algorithms.hooks" in err
    assert "[polyrl hooks]   register(advantage_estimator 'grpo')" in err
    monkeypatch.setenv("POLYRL_TRACE_HOOKS", "0")
    PluginManager(None, entry_points=False)
    assert "[polyrl hooks]" not in capsys.readouterr().err
