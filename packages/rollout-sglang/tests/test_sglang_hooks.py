"""The plugin as polyrl finds it: registered through its entry point, SGLang not imported until a run builds it,
and the install line when the plugin or SGLang is missing."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from polyrl.config.roles import RolloutConfig
from polyrl.errors import RegistryError
from polyrl.manifest import Manifest
from polyrl.plugins import PluginManager

pytestmark = pytest.mark.smoke  # also run on the package installed alone (make test-packages)

CODE = """
import sys
from polyrl.plugins import PluginManager
pm = PluginManager()
entry = pm.entry("rollout", "sglang")
print("plugin", entry.plugin.name)
print("target", entry.target_name)
schema = pm.get("config_schema", "rollout.sglang")
print("schema", schema.__name__, sorted(schema.__dataclass_fields__))
cls = entry.load()
print("rollout", cls.__name__)
print("sglang imported after loading the class:", "sglang" in sys.modules)
"""


def test_entry_point_registers_rollout_and_schema_lazily():
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout
    assert "plugin rollout-sglang" in lines
    assert "target polyrl_rollout_sglang.rollout:SGLangRollout" in lines
    assert "enable_memory_saver" in lines and "allow_untested_version" in lines
    assert "rollout SGLangRollout" in lines
    assert "sglang imported after loading the class: False" in lines


def test_plugin_not_loaded_gives_the_pip_line():
    pm = PluginManager(Manifest(block=("polyrl-rollout-sglang",)))
    with pytest.raises(RegistryError, match=r"rollout 'sglang' is provided by a polyrl plugin: "
                                            r"pip install 'polyrl-rollout-sglang\[cuda\]'"):
        pm.get("rollout", "sglang")


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="SGLang is installed here")
def test_selecting_sglang_without_sglang_gives_the_install_line(tiny_model_dir, tiny_tokenizer):
    from polyrl_rollout_sglang.rollout import SGLangNotInstalledError, SGLangRollout

    factory = PluginManager().get("rollout", "sglang")
    assert factory is SGLangRollout
    with pytest.raises(SGLangNotInstalledError, match=r"pip install 'polyrl-rollout-sglang\[cuda\]'") as info:
        factory(RolloutConfig(name="sglang"), model_path=str(tiny_model_dir), tokenizer=tiny_tokenizer)
    assert isinstance(info.value, ImportError)
