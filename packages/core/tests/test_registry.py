"""One registry rule for every kind: duplicates, unknown names, import strings, aliases."""

from __future__ import annotations

import pytest

from polyrl.errors import RegistryError
from polyrl.registry import PluginInfo, Registry

A = PluginInfo("plugin-a", "dist-a", "1.0")
B = PluginInfo("plugin-b", "dist-b", "2.0")


def test_duplicate_name_names_both_plugins():
    reg = Registry("engine")
    reg.register("fast", object(), plugin=A)
    with pytest.raises(RegistryError) as err:
        reg.register("fast", object(), plugin=B)
    msg = str(err.value)
    assert "plugin-a" in msg and "dist-a 1.0" in msg and "plugin-b" in msg and "block" in msg


def test_alias_collision_is_a_duplicate():
    reg = Registry("engine")
    reg.register("fsdp", object(), plugin=A, aliases=["fsdp2"])
    with pytest.raises(RegistryError, match="'fsdp2' is registered twice"):
        reg.register("fsdp2", object(), plugin=B)
    assert reg.get("fsdp2") is reg.get("fsdp")


def test_unknown_name_lists_choices_and_suggests():
    reg = Registry("advantage_estimator")
    for name in ("grpo", "gae", "rloo"):
        reg.register(name, object(), plugin=A)
    with pytest.raises(RegistryError) as err:
        reg.get("grp")
    msg = str(err.value)
    assert "Did you mean 'grpo'" in msg and "gae, grpo, rloo" in msg


def test_unknown_known_plugin_name_gives_pip_line():
    with pytest.raises(RegistryError, match=r"pip install 'polyrl-rollout-vllm\[cuda\]'"):
        Registry("rollout").get("vllm")
    with pytest.raises(RegistryError, match=r"pip install 'polyrl-engine-fsdp'"):
        Registry("engine").get("fsdp")


def test_import_string_loads_on_first_use_only():
    reg = Registry("reward_function")
    reg.register("later", "polyrl_no_such_module:fn", plugin=A)  # registering does not import
    with pytest.raises(RegistryError) as err:
        reg.get("later")
    assert "polyrl_no_such_module" in str(err.value) and "plugin-a" in str(err.value)
    reg.register("attr", "json:no_such_attr", plugin=A)
    with pytest.raises(RegistryError, match="has no attribute 'no_such_attr'"):
        reg.get("attr")
    reg.register("bad", "not-an-import-string", plugin=A)
    with pytest.raises(RegistryError, match="must look like 'package.module:attribute'"):
        reg.get("bad")
    reg.register("ok", "json:dumps", plugin=A)
    import json

    assert reg.get("ok") is json.dumps


def test_unregister_plugin_drops_its_names():
    reg = Registry("tool")
    reg.register("x", 1, plugin=A, aliases=["y"])
    reg.register("z", 2, plugin=B)
    reg.unregister_plugin("plugin-a")
    assert reg.names(include_aliases=True) == ["z"]


def test_aliases_may_be_one_string_but_not_garbage():
    reg = Registry("engine")
    reg.register("fsdp", "json:dumps", plugin=A, aliases="fsdp2")
    assert reg.names(include_aliases=True) == ["fsdp", "fsdp2"]
    assert reg.entry("fsdp2").metadata["aliases"] == ["fsdp2"]
    with pytest.raises(RegistryError, match="invalid aliases"):
        reg.register("megatron", object(), plugin=A, aliases=[1])


def test_invalid_name_names_the_plugin():
    with pytest.raises(RegistryError, match="plugin 'plugin-a'.*invalid name ''"):
        Registry("tool").register("", object(), plugin=A)


def test_import_string_whose_module_raises_shows_traceback(tmp_path, monkeypatch):
    (tmp_path / "polyrl_raises_on_import.py").write_text("raise RuntimeError('no GPU driver')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    reg = Registry("rollout")
    reg.register("fancy", "polyrl_raises_on_import:Rollout", plugin=B)
    with pytest.raises(RegistryError) as err:
        reg.get("fancy")
    msg = str(err.value)
    assert "rollout 'fancy'" in msg and "dist-b 2.0" in msg and "RuntimeError: no GPU driver" in msg


def test_objects_load_once_and_lookups_by_alias_share_it(tmp_path, monkeypatch):
    (tmp_path / "polyrl_counted.py").write_text("import itertools\nCOUNT = itertools.count()\nthing = object()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    reg = Registry("tool")
    reg.register("counted", "polyrl_counted:thing", plugin=A, aliases=["c"])
    assert "polyrl_counted" not in __import__("sys").modules  # registering imports nothing
    assert reg.get("counted") is reg.get("c")
    assert next(__import__("polyrl_counted").COUNT) == 0  # module imported once
