"""The plugin as polyrl finds it: registered through its entry point, vLLM not imported until a run builds it."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.smoke  # also run on the package installed alone (make test-packages): no vLLM there

CODE = """
import sys
from polyrl.plugins import PluginManager
pm = PluginManager()
entry = pm.entry("rollout", "vllm")
print("plugin", entry.plugin.name)
print("target", entry.target_name)
print("vllm imported after loading plugins:", "vllm" in sys.modules)
schema = pm.get("config_schema", "rollout.vllm")
print("schema", schema.__name__, sorted(schema.__dataclass_fields__))
print("vllm imported after the schema:", "vllm" in sys.modules)
cls = entry.load()
print("rollout", cls.__name__)
print("vllm imported after loading the class:", "vllm" in sys.modules)
"""


def test_entry_point_registers_rollout_and_schema_lazily():
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout
    assert "plugin rollout-vllm" in lines
    assert "target polyrl_rollout_vllm.rollout:VLLMRollout" in lines
    assert "vllm imported after loading plugins: False" in lines
    assert "vllm imported after the schema: False" in lines
    assert "async_server" in lines and "cpu_kvcache_space_gib" in lines and "load_format" in lines
    assert "rollout VLLMRollout" in lines
    # building the rollout imports vLLM, importing its module does not
    assert "vllm imported after loading the class: False" in lines


def test_without_vllm_the_rollout_names_the_install_line(monkeypatch):
    """Building the rollout where vLLM does not import (the package installed without an extra) is one error that
    says which extra to install."""
    from polyrl_rollout_vllm.rollout import INSTALL_HINT, import_vllm

    monkeypatch.setitem(sys.modules, "vllm", None)  # what Python does for a module that is not installed
    with pytest.raises(Exception, match="polyrl-rollout-vllm") as err:
        import_vllm()
    assert INSTALL_HINT in str(err.value)
