"""Config loading: YAML + overrides, unknown keys with did-you-mean, plugin blocks, errors naming the source."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from polyrl.config.loader import load_config, to_yaml
from polyrl.config.schema import PolyrlConfig
from polyrl.errors import ConfigError
from polyrl.hookspecs import hookimpl
from polyrl.plugins import PluginManager
from polyrl.registry import PluginInfo


@dataclass
class FakeEngineOptions:
    """A plugin's own config block."""

    param_offload: bool = False
    bucket_mb: int = 64


class _SchemaPlugin:
    @hookimpl
    def register_config_schemas(self, register):
        register("engine.fake", FakeEngineOptions)


@pytest.fixture
def pm() -> PluginManager:
    manager = PluginManager(None, entry_points=False)
    manager.add_plugin(_SchemaPlugin(), PluginInfo("schema-plugin"))
    return manager


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return path


def test_yaml_then_overrides_win(tmp_path, pm):
    f = write(tmp_path, "model: {path: /m}\ndata: {train_batch_size: 8}\nrollout: {n: 2}\n")
    cfg = load_config(PolyrlConfig, [f], ["rollout.n=5", "actor.optim.lr=0.5"], plugins=pm)
    assert cfg.data.train_batch_size == 8
    assert cfg.rollout.n == 5
    assert cfg.actor.optim.lr == 0.5
    # the top-level model block reaches the roles
    assert cfg.actor.model.path == "/m" and cfg.critic.model.path == "/m"


def test_unknown_key_names_file_and_suggests(tmp_path, pm):
    f = write(tmp_path, "model: {path: /m}\ndata: {train_batch_sise: 8}\n")
    with pytest.raises(ConfigError) as err:
        load_config(PolyrlConfig, [f], plugins=pm)
    msg = str(err.value)
    assert "data.train_batch_sise" in msg and str(f) in msg and "Did you mean 'data.train_batch_size'" in msg


def test_unknown_override_names_command_line(pm):
    with pytest.raises(ConfigError, match=r"unknown config key 'trainer.totl_steps' \(from command line"):
        load_config(PolyrlConfig, [], ["model.path=/m", "trainer.totl_steps=3"], plugins=pm)


def test_wrong_type_names_key(tmp_path, pm):
    f = write(tmp_path, "model: {path: /m}\nrollout: {n: many}\n")
    with pytest.raises(ConfigError, match=r"rollout.n.*run.yaml"):
        load_config(PolyrlConfig, [f], plugins=pm)


def test_plugin_block_validated_against_registered_schema(tmp_path, pm):
    f = write(tmp_path, "model: {path: /m}\nactor: {engine: fake, fake: {param_offload: true}}\n")
    cfg = load_config(PolyrlConfig, [f], plugins=pm)
    assert isinstance(cfg.actor.plugin_config, FakeEngineOptions)
    assert cfg.actor.plugin_config.param_offload is True
    f = write(tmp_path, "model: {path: /m}\nactor: {engine: fake, fake: {param_ofload: true}}\n")
    with pytest.raises(ConfigError, match="Did you mean 'actor.fake.param_offload'"):
        load_config(PolyrlConfig, [f], plugins=pm)


def test_plugin_block_without_schema_is_an_error(tmp_path, pm):
    f = write(tmp_path, "model: {path: /m}\nactor: {engine: nothere, nothere: {x: 1}}\n")
    with pytest.raises(ConfigError, match="no loaded plugin registers config schema 'engine.nothere'"):
        load_config(PolyrlConfig, [f], plugins=pm)


def test_resolved_yaml_round_trips(tmp_path, pm):
    f = write(tmp_path, "model: {path: /m}\nactor: {engine: fake, fake: {bucket_mb: 7}}\nrollout: {n: 3}\n")
    cfg = load_config(PolyrlConfig, [f], plugins=pm)
    again = load_config(PolyrlConfig, [write(tmp_path, to_yaml(cfg))], plugins=pm)
    assert again.actor.plugin_config == cfg.actor.plugin_config
    assert again.rollout.n == 3


def test_values_read_from_the_environment_are_recorded_as_their_interpolation(tmp_path, pm, monkeypatch):
    from polyrl.config.loader import record_dict

    monkeypatch.setenv("POLYRL_TEST_TOKEN", "s3cret-token")
    monkeypatch.setenv("POLYRL_TEST_BUCKET", "96")
    f = write(tmp_path, "model: {path: /m}\nactor: {engine: fake, fake: {bucket_mb: '${oc.env:POLYRL_TEST_BUCKET}'}}\n"
                        "trainer: {project_name: '${oc.env:POLYRL_TEST_TOKEN}'}\n")
    cfg = load_config(PolyrlConfig, [f], plugins=pm)
    assert cfg.trainer.project_name == "s3cret-token" and cfg.actor.plugin_config.bucket_mb == 96  # used resolved
    text = to_yaml(cfg)
    assert "s3cret-token" not in text and "${oc.env:POLYRL_TEST_TOKEN}" in text
    assert "${oc.env:POLYRL_TEST_BUCKET}" in text  # inside a plugin block too
    record = record_dict(cfg)
    assert record["trainer"]["project_name"] == "${oc.env:POLYRL_TEST_TOKEN}"
    monkeypatch.setenv("POLYRL_TEST_TOKEN", "rotated")
    again = load_config(PolyrlConfig, [write(tmp_path, text)], plugins=pm)  # a resumed run resolves it again
    assert again.trainer.project_name == "rotated" and again.actor.plugin_config.bucket_mb == 96


def test_missing_file_and_bad_yaml(tmp_path, pm):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(PolyrlConfig, [tmp_path / "nope.yaml"], plugins=pm)
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(PolyrlConfig, [write(tmp_path, "a: [1, 2\n")], plugins=pm)


def test_configuration_reference_is_current():
    from polyrl.config.reference import render

    page = Path(__file__).resolve().parents[4] / "docs" / "configuration.md"
    assert page.read_text() == render(), "docs/configuration.md is stale: python -m polyrl.config.reference > docs/configuration.md"


@pytest.mark.parametrize(("override", "key"), [
    ("data.train_batch_size=-4", "data.train_batch_size"),
    ("actor.ppo_mini_batch_size=0", "actor.ppo_mini_batch_size"),
    ("rollout.n=0", "rollout.n"),
    ("trainer.total_steps=-1", "trainer.total_steps"),
    ("reward.timeout_s=-1", "reward.timeout_s"),
    ("trainer.async_chunk_groups=-1", "trainer.async_chunk_groups"),
    ("trainer.async_queue_groups=-2", "trainer.async_queue_groups"),
    ("trainer.async_max_staleness=-1", "trainer.async_max_staleness"),
    ("trainer.async_tis_cap=-0.5", "trainer.async_tis_cap"),
    ("trainer.async_tis_cap=nan", "trainer.async_tis_cap"),
    ("trainer.weight_bucket_mb=0", "trainer.weight_bucket_mb"),
    ("rollout.tensor_parallel_size=0", "rollout.tensor_parallel_size"),
])
def test_out_of_range_values_name_the_key_and_source(override, key):
    with pytest.raises(ConfigError) as err:
        load_config(PolyrlConfig, [], ["model.path=m", override])
    msg = str(err.value)
    assert f"'{key}'" in msg and override in msg and "\n" not in msg


def test_run_that_trains_nothing_is_refused(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("model:\n  path: m\ntrainer:\n  total_epochs: 0\n")
    with pytest.raises(ConfigError, match=rf"total_epochs.*{cfg} line 4.*train nothing"):
        load_config(PolyrlConfig, [cfg])


def test_scalar_where_a_list_is_expected_becomes_a_list(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("model:\n  path: m\ndata:\n  train_files: train.jsonl\n")
    loaded = load_config(PolyrlConfig, [cfg], ["trainer.logger=jsonl", "rollout.stop_token_ids=7"])
    assert loaded.data.train_files == ["train.jsonl"]
    assert loaded.trainer.logger == ["jsonl"] and loaded.rollout.stop_token_ids == [7]
    cfg.write_text("model:\n  path: m\ndata:\n  train_files: {a: 1}\n")  # a mapping is still wrong
    with pytest.raises(ConfigError, match=rf"'data.train_files' \(from {cfg} line 4\)"):
        load_config(PolyrlConfig, [cfg])


def test_did_you_mean_hides_internal_keys():
    with pytest.raises(ConfigError) as err:
        load_config(PolyrlConfig, [], ["model.path=m", "ref.plugin_confi=1"])
    assert "plugin_config" not in str(err.value)


def test_reference_descriptions_sit_on_their_own_keys():
    from polyrl.config.reference import render

    rows = {line.split("|")[1].strip().strip("`"): line for line in render().splitlines() if line.startswith("| `")}
    assert "Checkpoint every N steps" in rows["trainer.save_freq"]
    assert "pass@k" in rows["trainer.test_freq"] and "pass@k" not in rows["trainer.save_freq"]
    assert "Key of the response text" in rows["response_key"]
