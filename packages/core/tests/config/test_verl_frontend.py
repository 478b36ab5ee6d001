"""verl's config layout as a front end: verl's example scripts resolve (or are refused on a refused key only),
the mapping table covers verl's whole tree, Hydra's override grammar, and bad input in one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from verl_examples import ARR, EXAMPLES  # beside this file (pytest puts its folder on sys.path)

from polyrl.config import verl_table
from polyrl.config.loader import load_with_origins, to_dict
from polyrl.config.schema import PolyrlConfig
from polyrl.config.verl import flatten, shipped_tree
from polyrl.errors import ConfigError

HERE = Path(__file__).resolve().parent
FIXTURE = json.loads((HERE / "fixtures" / "verl_keys.json").read_text())
VERL_KEYS = sorted(set(FIXTURE["trees"]["ppo_trainer"]) | set(FIXTURE["trees"]["ppo_megatron_trainer"]))
ROOT = HERE.parents[3]


def verl(overrides, files=(), **kwargs):
    return load_with_origins(PolyrlConfig, files, overrides, config_format="verl", strict_plugins=False, **kwargs)


def _get(tree: dict, dotted: str):
    node = tree
    for part in dotted.split("."):
        node = node[part]
    return node


# ---------------------------------------------------------------------------------------- the table


def test_every_verl_key_falls_in_exactly_one_list():
    kinds = {}
    for key in VERL_KEYS:
        entry = verl_table.classify(key)
        assert entry is not None, f"verl key {key} is in none of the lists"
        kinds[key] = verl_table.kind(entry)
    # exact entries never disagree with a pattern of another kind that matches the same key more broadly:
    # the three lists are disjoint by construction (one entry per key), checked here on the lists themselves
    lists = {k: {e.verl for e in verl_table.TABLE if verl_table.kind(e) == k} for k in ("mapped", "ignored", "refused")}
    assert not (lists["mapped"] & lists["ignored"]) and not (lists["mapped"] & lists["refused"])
    assert not (lists["ignored"] & lists["refused"])
    assert set(kinds.values()) == {"mapped", "ignored", "refused"}


def test_every_table_entry_names_verl_keys_or_is_a_documented_addition():
    for entry in verl_table.TABLE:
        if "*" in entry.verl:
            continue
        text = entry.note if isinstance(entry, verl_table.Mapped) else getattr(entry, "reason", "")
        added = (isinstance(entry, verl_table.Mapped) and "polyrl only" in entry.note) or "add with `+`" in text
        known = entry.verl in VERL_KEYS or any(k.startswith(entry.verl + ".") for k in VERL_KEYS)
        mixed_precision = ".fsdp_config.mixed_precision." in entry.verl  # verl's older FSDP keys, added with +
        assert known or added or mixed_precision, f"table entry {entry.verl} names no key of verl's trees"


def test_mapped_targets_are_polyrl_keys():
    from polyrl.config.loader import _schema_has

    for entry in verl_table.TABLE:
        if not isinstance(entry, verl_table.Mapped):
            continue
        for target in entry.native.split(" / "):
            target = target.split(" (")[0].rstrip(".*").removesuffix(".")
            assert _schema_has(PolyrlConfig, target), f"{entry.verl} maps to {target}, which polyrl does not have"


@pytest.mark.smoke  # also on the core installed alone from its wheel: the trees ship as package data
def test_shipped_trees_hold_exactly_the_captured_keys_and_defaults():
    for name, flat in FIXTURE["trees"].items():
        assert flatten(shipped_tree(name)) == flat, f"polyrl/config/verl_defaults/{name}.yaml differs from the fixture"


def test_from_verl_page_holds_the_current_table():
    page = (ROOT / "docs" / "from_verl.md").read_text()
    assert verl_table.generated_part(page) == verl_table.render(), (
        "docs/from_verl.md is stale: python -m polyrl.config.verl_table --write docs/from_verl.md")


def test_verl_defaults_are_verls():
    cfg = verl(["actor_rollout_ref.model.path=/m", f"{ARR}.actor.ppo_micro_batch_size_per_gpu=4",
                f"{ARR}.rollout.name=vllm", "critic.ppo_micro_batch_size_per_gpu=4"]).config
    tree = to_dict(cfg)
    assert cfg.actor.optim.lr == 1e-6 and cfg.critic.optim.lr == 1e-5
    assert cfg.actor.clip_ratio_low == 0.2 and cfg.actor.clip_ratio_high == 0.2
    assert cfg.data.train_batch_size == 1024 and cfg.actor.ppo_mini_batch_size == 256  # prompts, as verl counts them
    assert cfg.rollout.n == 1 and cfg.rollout.tensor_parallel_size == 2 and cfg.algorithm.adv_estimator == "gae"
    assert cfg.trainer.total_epochs == 30 and cfg.trainer.save_freq == 0 and cfg.trainer.test_freq == 0
    assert cfg.trainer.n_workers == 8 and cfg.data.truncation == "error" and cfg.data.max_prompt_length == 512
    assert tree["actor"]["plugin_config"]["param_dtype"] == "bfloat16" and cfg.actor.model.dtype == "float32"
    assert cfg.rollout.val_temperature == 0.0 and cfg.rollout.dtype == "bfloat16"
    # placeholders of verl's machines are not kept: polyrl's defaults stand
    assert cfg.data.train_files == [] and cfg.trainer.device == "auto"


# ---------------------------------------------------------------------------------------- verl's example scripts

#: verl's defaults the expectation below falls back on (ppo_trainer.yaml).
_VERL = {"data.train_batch_size": 1024, "data.max_prompt_length": 512, "data.max_response_length": 512,
         f"{ARR}.rollout.n": 1, f"{ARR}.rollout.tensor_model_parallel_size": 2, "trainer.nnodes": 1,
         "trainer.n_gpus_per_node": 8, f"{ARR}.actor.ppo_mini_batch_size": 256, f"{ARR}.actor.use_dynamic_bsz": False}


def _expected(overrides: list[str], config_name: str | None) -> dict:
    """What the mapping must give for the core keys, read from the override list independently of the
    front end's parser (plain ``key=value`` splitting and YAML scalars)."""
    given: dict = dict(_VERL)
    for item in overrides:
        key, _, value = item.lstrip("+").partition("=")
        given[key] = yaml.safe_load(value) if not value.startswith("[") else value
    num = lambda key: float(given[key])  # noqa: E731 - YAML 1.1 reads 1e-6 as a string
    world = int(given["trainer.nnodes"]) * int(given["trainer.n_gpus_per_node"])
    out = {
        "algorithm.adv_estimator": given.get("algorithm.adv_estimator", "gae"),
        "actor.optim.lr": num(f"{ARR}.actor.optim.lr"),
        "rollout.n": int(given[f"{ARR}.rollout.n"]),
        "rollout.name": given[f"{ARR}.rollout.name"],
        "rollout.tensor_parallel_size": int(given[f"{ARR}.rollout.tensor_model_parallel_size"]),
        "data.train_batch_size": int(given["data.train_batch_size"]),
        "data.max_prompt_length": int(given["data.max_prompt_length"]),
        "data.max_response_length": int(given["data.max_response_length"]),
        "actor.ppo_mini_batch_size": int(given[f"{ARR}.actor.ppo_mini_batch_size"]),
        "trainer.n_workers": world,
        "actor.engine": "megatron" if config_name and "megatron" in config_name else "fsdp",
        "actor.use_dynamic_bsz": bool(given[f"{ARR}.actor.use_dynamic_bsz"]),
        "actor.use_kl_loss": bool(given.get(f"{ARR}.actor.use_kl_loss", False)),
        "model.path": given[f"{ARR}.model.path"],
    }
    if f"{ARR}.actor.ppo_micro_batch_size_per_gpu" in given:
        out["actor.micro_batch_size"] = int(given[f"{ARR}.actor.ppo_micro_batch_size_per_gpu"])
    if f"{ARR}.ref.log_prob_micro_batch_size_per_gpu" in given:
        out["ref.micro_batch_size"] = int(given[f"{ARR}.ref.log_prob_micro_batch_size_per_gpu"])
    if f"{ARR}.actor.kl_loss_coef" in given:
        out["actor.kl_loss_coef"] = num(f"{ARR}.actor.kl_loss_coef")
    if f"{ARR}.actor.ppo_max_token_len_per_gpu" in given:
        out["actor.max_token_len_per_gpu"] = int(given[f"{ARR}.actor.ppo_max_token_len_per_gpu"])
    if f"{ARR}.model.lora_rank" in given:
        out["model.lora.rank"] = int(given[f"{ARR}.model.lora_rank"])
    for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size"):
        if f"{ARR}.actor.megatron.{key}" in given:
            out[f"actor.plugin_config.{key}"] = int(given[f"{ARR}.actor.megatron.{key}"])
    if out["algorithm.adv_estimator"] == "gae":
        out["critic.optim.lr"] = num("critic.optim.lr")
        if "critic.ppo_micro_batch_size_per_gpu" in given:
            out["critic.micro_batch_size"] = int(given["critic.ppo_micro_batch_size_per_gpu"])
    for key, native in (("trainer.save_freq", "trainer.save_freq"), ("trainer.test_freq", "trainer.test_freq"),
                        ("trainer.total_epochs", "trainer.total_epochs")):
        if key in given:
            out[native] = max(0, int(given[key]))
    if given.get("reward_model.reward_manager") == "dapo":
        out["reward.manager"] = "dapo"
        out["reward.max_response_length"] = int(given["reward_model.reward_kwargs.max_resp_len"])
    return out


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_verl_example_resolves_or_is_refused_on_a_refused_key(name):
    example = EXAMPLES[name]
    if example.refused:
        wanted = (example.refused,) if isinstance(example.refused, str) else example.refused
        with pytest.raises(ConfigError) as err:
            verl(example.overrides, config_name=example.config_name)
        msg = str(err.value)
        assert "\n" not in msg
        named = [k for k in wanted if f"'{k}'" in msg]
        assert named, f"{name}: refused for another reason: {msg}"
        entry = verl_table.classify(named[0])
        # a refused verl key, or (a key the script sets without verl's actor_rollout_ref prefix) one verl itself
        # does not have, which here reads as polyrl's layout mixed in
        assert isinstance(entry, verl_table.Refused) or "mixes verl's layout" in msg, msg
        return
    loaded = verl(example.overrides, config_name=example.config_name)
    tree = to_dict(loaded.config)
    for key, value in {**_expected(example.overrides, example.config_name), **example.expect}.items():
        got = _get(tree, key)
        assert got == pytest.approx(value) if isinstance(value, float) else got == value, (
            f"{name}: {key} is {got!r}, expected {value!r}")


def test_config_show_prints_a_verl_example_with_sources(capsys):
    from polyrl.cli import main

    example = EXAMPLES["grpo_trainer/run_qwen2-7b.sh"]
    assert main(["config", "show", "--config-format", "verl", *example.overrides]) == 0
    out = capsys.readouterr().out
    resolved = yaml.safe_load(out)  # YAML polyrl train reads back
    assert resolved["actor"]["micro_batch_size"] == 40 and resolved["rollout"]["n"] == 5
    line = next(ln for ln in out.splitlines() if ln.strip().startswith("micro_batch_size: 40"))
    assert f"verl {ARR}.actor.ppo_micro_batch_size_per_gpu (command line '{ARR}.actor.ppo_micro_batch_size_per_gpu=40')" in line
    lr = next(ln for ln in out.splitlines() if ln.strip().startswith("lr: 1.0e-06"))
    assert "#" not in lr  # verl's lr is polyrl's default: no source shown
    n_workers = next(ln for ln in out.splitlines() if ln.strip().startswith("n_workers:"))
    assert "trainer.nnodes" in n_workers


def test_config_show_native_layout_names_file_and_line(tmp_path, capsys):
    from polyrl.cli import main

    cfg = tmp_path / "run.yaml"
    cfg.write_text("model:\n  path: /m\nrollout:\n  n: 3\n")
    assert main(["config", "show", "-c", str(cfg), "actor.optim.lr=0.5"]) == 0
    out = capsys.readouterr().out
    assert f"n: 3  # {cfg} line 4" in out
    assert "lr: 0.5  # command line 'actor.optim.lr=0.5'" in out
    assert f"path: /m  # {cfg} line 2" in out  # the top-level model block, copied into actor.model


# ---------------------------------------------------------------------------------------- override grammar


def test_plus_tilde_interpolation_and_scalar_for_list(monkeypatch):
    monkeypatch.setenv("POLYRL_TEST_DATA", "/srv/data")
    monkeypatch.delenv("POLYRL_TEST_UNSET", raising=False)
    cfg = verl([
        f"{ARR}.model.path=${{oc.env:POLYRL_TEST_DATA}}/model", f"{ARR}.rollout.name=hf", "algorithm.adv_estimator=grpo",
        f"{ARR}.actor.ppo_micro_batch_size_per_gpu=4",
        "data.train_files=${oc.env:POLYRL_TEST_DATA}/train.parquet",  # one path where verl wants a list
        "data.val_files=${oc.env:POLYRL_TEST_UNSET,/fallback}/val.parquet",
        "data.max_prompt_length=100", "data.max_response_length=${data.max_prompt_length}",  # interpolation
        "+trainer.val_before_train=False",  # + on a key verl's tree has (verl's scripts do it)
        "+algorithm.filter_groups.enable=True", "++algorithm.filter_groups.metric=acc",  # keys verl's tree lacks
        f"~{ARR}.actor.optim.betas",  # deleted: polyrl's default
    ]).config
    assert cfg.actor.model.path == "/srv/data/model"
    assert cfg.data.train_files == ["/srv/data/train.parquet"] and cfg.data.val_files == ["/fallback/val.parquet"]
    assert cfg.data.max_response_length == 100 and cfg.trainer.val_before_train is False
    assert cfg.algorithm.filter_groups.enable is True and cfg.algorithm.filter_groups.metric == "acc"
    assert cfg.actor.optim.betas == [0.9, 0.999]


def test_verl_values_read_from_the_environment_are_recorded_as_written(monkeypatch):
    from polyrl.config.loader import record_dict

    monkeypatch.setenv("POLYRL_TEST_SECRET", "s3cret")
    cfg = verl([f"{ARR}.model.path=/m", f"{ARR}.rollout.name=hf", "algorithm.adv_estimator=grpo",
                f"{ARR}.actor.ppo_micro_batch_size_per_gpu=2", "trainer.project_name=${oc.env:POLYRL_TEST_SECRET}"]).config
    assert cfg.trainer.project_name == "s3cret"
    assert record_dict(cfg)["trainer"]["project_name"] == "${oc.env:POLYRL_TEST_SECRET}"


def test_native_layout_takes_the_same_grammar_and_verl_spellings(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("model:\n  path: /m\nrollout:\n  n: 3\ndata:\n  train_files: [a.jsonl]\n")
    loaded = load_with_origins(PolyrlConfig, [cfg], [
        "~rollout.n", "+trainer.total_steps=5", "++data.max_prompt_length=64", "data.val_files=b.jsonl",
        "actor.ppo_micro_batch_size_per_gpu=3", "rollout.tensor_model_parallel_size=1",
        "trainer.total_training_steps=5", "actor.optim.clip_grad=0.5"])
    c = loaded.config
    assert c.rollout.n == 4  # deleted from the file: back to the default
    assert c.trainer.total_steps == 5 and c.data.max_prompt_length == 64 and c.data.val_files == ["b.jsonl"]
    assert c.actor.micro_batch_size == 3 and c.actor.optim.grad_clip == 0.5
    assert loaded.origins["actor.micro_batch_size"] == "command line 'actor.ppo_micro_batch_size_per_gpu=3'"
    with pytest.raises(ConfigError, match="two spellings of one key"):
        load_with_origins(PolyrlConfig, [cfg], ["actor.micro_batch_size=2", "actor.ppo_micro_batch_size_per_gpu=3"])
    with pytest.raises(ConfigError, match="Hydra sweep"):
        load_with_origins(PolyrlConfig, [cfg], ["data.val_files=a,b"])
    with pytest.raises(ConfigError, match="no key 'trainer.totl_steps' to delete"):
        load_with_origins(PolyrlConfig, [cfg], ["~trainer.totl_steps"])


def test_verl_yaml_with_defaults_list_and_config_path(tmp_path):
    (tmp_path / "actor").mkdir()
    (tmp_path / "actor" / "my_actor.yaml").write_text("ppo_mini_batch_size: 8\nppo_micro_batch_size_per_gpu: 2\n")
    (tmp_path / "my_trainer.yaml").write_text(
        "hydra:\n  searchpath: [file://verl/trainer/config]\n"
        "defaults:\n  - ppo_megatron_trainer\n  - actor@actor_rollout_ref.actor: my_actor\n  - _self_\n"
        "actor_rollout_ref:\n  model: {path: /m}\n  rollout: {name: sglang, n: 4}\n"
        "data: {train_batch_size: 16}\n")
    loaded = verl(["trainer.n_gpus_per_node=4", "algorithm.adv_estimator=grpo"], config_path=tmp_path,
                  config_name="my_trainer")
    cfg = loaded.config
    assert cfg.actor.engine == "megatron" and cfg.actor.micro_batch_size == 2 and cfg.actor.ppo_mini_batch_size == 8
    assert cfg.rollout.name == "sglang" and cfg.rollout.n == 4 and cfg.data.train_batch_size == 16
    assert cfg.trainer.n_workers == 4
    assert loaded.origins["actor.micro_batch_size"].endswith(f"({tmp_path / 'actor' / 'my_actor.yaml'} line 2)")
    # verl's own config name, without --config-path: the shipped tree
    assert verl([f"{ARR}.actor.ppo_micro_batch_size_per_gpu=1", f"{ARR}.rollout.name=vllm", "algorithm.adv_estimator=grpo",
                 f"{ARR}.model.path=/m"],
                config_path="./config", config_name="ppo_megatron_trainer").config.actor.engine == "megatron"


def test_quickstart_verl_config_resolves_to_the_native_one():
    """examples/quickstart/grpo_verl.yaml is grpo.yaml in verl's layout: the settings that drive the run agree."""
    from polyrl.config.loader import load_config

    q = ROOT / "examples" / "quickstart"
    native = load_config(PolyrlConfig, [q / "grpo.yaml"], ["model.path=/m", "trainer.run_dir=r"])
    mapped = load_config(PolyrlConfig, [q / "grpo_verl.yaml"], [f"{ARR}.model.path=/m", "trainer.default_local_dir=r",
                                                                "+trainer.progress_bar=false"])
    from polyrl.trainer.executor import resolve_executor

    for cfg in (native, mapped):  # grpo.yaml names ray; verl's layout leaves auto, which its 2 workers make ray
        resolve_executor(cfg)
    a, b = to_dict(native), to_dict(mapped)
    for key in ("data", "rollout", "algorithm", "reward"):
        assert a[key] == b[key], key
    for key in ("ppo_mini_batch_size", "micro_batch_size", "shuffle", "optim", "model", "seed", "engine", "plugin_config",
                "use_kl_loss", "entropy_coeff", "loss_agg_mode"):
        if key == "optim":
            assert {k: v for k, v in a["actor"][key].items() if k != "num_cycles"} == \
                   {k: v for k, v in b["actor"][key].items() if k != "num_cycles"}
        else:
            assert a["actor"][key] == b["actor"][key], key
    for key in ("n_workers", "total_steps", "test_freq", "save_freq", "seed", "executor", "placement"):
        assert a["trainer"][key] == b["trainer"][key], key


# ---------------------------------------------------------------------------------------- bad input


def test_unknown_verl_key_did_you_mean():
    with pytest.raises(ConfigError) as err:
        verl([f"{ARR}.actor.ppo_mini_bach_size=8"])
    msg = str(err.value)
    assert f"unknown verl key '{ARR}.actor.ppo_mini_bach_size'" in msg and f"'{ARR}.actor.ppo_mini_batch_size'" in msg
    with pytest.raises(ConfigError, match=rf"Did you mean '{ARR}.rollout.multi_turn.enable'"):
        verl(["multi_turn.enable=True"])  # verl's prefix left out
    with pytest.raises(ConfigError, match=r"unknown verl key 'trainer.totl_steps' .*\+trainer"):
        verl(["+trainer.totl_steps=3"])  # added with +, but polyrl knows no such key either


def test_refused_verl_key_says_what_to_do():
    with pytest.raises(ConfigError) as err:
        verl(["reward_model.enable_resource_pool=True", "trainer.val_only=True"])
    msg = str(err.value)
    assert "'reward_model.enable_resource_pool'=True" in msg and "trainer.pools={rm: N}" in msg
    assert "trainer.val_only" in msg


def test_both_layouts_mixed_is_refused(tmp_path):
    f = tmp_path / "mixed.yaml"
    f.write_text("actor_rollout_ref:\n  model: {path: /m}\nactor:\n  optim: {lr: 0.1}\n")
    with pytest.raises(ConfigError, match=r"mixes verl's layout .* 'actor' \(from .*mixed.yaml"):
        load_with_origins(PolyrlConfig, [f], [])
    native = tmp_path / "native.yaml"
    native.write_text("model: {path: /m}\n")
    with pytest.raises(ConfigError, match="mixes verl's layout"):
        load_with_origins(PolyrlConfig, [native], [f"{ARR}.rollout.n=2"])
    with pytest.raises(ConfigError, match="--config-format native was given"):
        load_with_origins(PolyrlConfig, [f], [], config_format="native")


def test_defaults_naming_a_missing_file(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("defaults:\n  - ppo_trainer\n  - actor@actor_rollout_ref.actor: my_missing_actor\n  - _self_\n")
    with pytest.raises(ConfigError, match=r"defaults entry .*my_missing_actor.* names actor/my_missing_actor.yaml, "
                                          r"which is in none of"):
        load_with_origins(PolyrlConfig, [f], [])


@pytest.mark.parametrize(("args", "needle"), [
    ([f"{ARR}.actor.ppo_mini_bach_size=8"], "Did you mean"),
    (["actor_rollout_ref.hybrid_engine=False"], "not supported by polyrl"),
    (["model.path=/m", f"{ARR}.rollout.n=2"], "mixes verl's layout"),
    (["--config-name", "my_missing_trainer"], "--config-name my_missing_trainer"),
])
def test_cli_bad_verl_input_is_one_line_exit_2(args, needle, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "polyrl", "train", "--dry-run", *args], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in proc.stderr
    assert not any(tmp_path.iterdir())  # nothing started, nothing written
