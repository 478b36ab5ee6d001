"""A manifest that does not require an installed plugin: the unknown-name errors say which installed plugin provides
the name; a misspelt requirement suggests only installed or known distributions (issue 47). The installed plugin is
examples/plugins/polyrl-example (installed in the development environment)."""

from __future__ import annotations

import importlib.metadata

import pytest

from polyrl.errors import ConfigError, ManifestError, RegistryError
from polyrl.manifest import Manifest
from polyrl.plugins import PluginManager

try:
    importlib.metadata.version("polyrl-example")
except importlib.metadata.PackageNotFoundError:  # the package installed alone (make test-packages)
    pytest.skip("needs the example plugin installed (pip install -e examples/plugins/polyrl-example)",
                allow_module_level=True)


@pytest.fixture
def manifest(tmp_path):
    path = tmp_path / "polyrl.toml"
    path.write_text('[plugins]\nrequire = ["polyrl-engine-fsdp"]\n')
    return Manifest.load(path)


def test_an_unknown_name_names_the_installed_plugin_the_manifest_leaves_out(manifest):
    pm = PluginManager(manifest)
    with pytest.raises(RegistryError) as err:
        pm.get("advantage_estimator", "sign")
    msg = str(err.value)
    assert "installed polyrl-example provides it: add it to [plugins].require in" in msg, msg
    assert manifest.source in msg and "\n" not in msg
    with pytest.raises(RegistryError) as err:  # a name no installed plugin has: no such sentence
        pm.get("advantage_estimator", "sing_never_registered")
    assert "provides it" not in str(err.value)
    blocked = Manifest(require=("polyrl-engine-fsdp",), block=("polyrl-example",), source="b.toml")
    with pytest.raises(RegistryError) as err:  # a blocked plugin is not imported, not even for the hint
        PluginManager(blocked).get("advantage_estimator", "sign")
    assert "provides it" not in str(err.value)
    # the fix the message names works
    assert PluginManager(Manifest(require=("polyrl-engine-fsdp", "polyrl-example"))).get("advantage_estimator", "sign")


def test_an_unscored_data_source_names_the_installed_plugin_that_scores_it(manifest):
    from polyrl.config.schema import PolyrlConfig
    from polyrl.rewards.reachability import check_rewards_reachable

    cfg = PolyrlConfig()
    pm = PluginManager(manifest)
    rows = [{"prompt": "hi", "data_source": "example/concise", "reward_model": {"ground_truth": "x"}}]
    with pytest.raises(ConfigError) as err:
        check_rewards_reachable(rows, cfg.reward, cfg.data, source="data.train_files (t.jsonl)", plugins=pm)
    msg = str(err.value)
    assert "'example/concise'" in msg and "installed polyrl-example provides it" in msg and manifest.source in msg


@pytest.mark.parametrize("typo", ["polyrl-exampel", "polyrl-engine-fsdpp"])
def test_a_misspelt_requirement_suggests_installed_or_known_names_only(typo, tmp_path):
    path = tmp_path / "polyrl.toml"
    path.write_text(f'[plugins]\nrequire = ["{typo}>=0.1"]\n')
    with pytest.raises(ManifestError) as err:
        Manifest.load(path).check_requirements()
    msg = str(err.value)
    assert typo in msg and f"pip install '{typo}" not in msg and "Did you mean" in msg, msg  # never the typo
    assert ("'polyrl-example'" if "exampel" in typo else "'polyrl-engine-fsdp'") in msg
