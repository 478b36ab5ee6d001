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
