"""verl's layout as verl's main branch has it (verl-project/verl 1dda039b, 2026-08-22), and errors in its words.

``fixtures/verl_example_overrides.json`` holds the override lists of verl's own example scripts, extracted by
``verl_scripts_gen.py`` (bash ran each script with ``python3`` stubbed out; see its docstring). They are read
here as ``polyrl config show --config-format verl`` reads them: the loader, model and data paths need not exist.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from polyrl.config.loader import load_with_origins, to_dict
from polyrl.config.overrides import parse_override
from polyrl.config.schema import PolyrlConfig
from polyrl.config.verl import speak_verl
from polyrl.errors import ConfigError

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[3]
SCRIPTS = json.loads((HERE / "fixtures" / "verl_example_overrides.json").read_text())
PAGE = ROOT / "docs" / "from_verl.md"
ARR = "actor_rollout_ref"
#: The least a verl-layout GRPO job needs besides the keys a test is about.
BASE = ["algorithm.adv_estimator=grpo", f"{ARR}.model.path=/m", "data.train_files=/d/t.parquet",
        "data.val_files=/d/v.parquet", f"{ARR}.rollout.name=vllm", f"{ARR}.actor.ppo_micro_batch_size_per_gpu=2"]


def _load(overrides, *, config_name=None, config_path=None):
    return load_with_origins(PolyrlConfig, [], overrides, config_format="verl", config_name=config_name,
                             config_path=config_path, strict_plugins=False)


def _resolve(script: dict) -> str | None:
    """None when the script's overrides resolve, else the one-line refusal (anything but a ConfigError fails)."""
    try:
        _load(script["overrides"], config_name=script["config_name"], config_path=script["config_path"])
    except ConfigError as exc:
        return str(exc)
    return None


def _documented_refusals() -> dict[str, str]:
    text = PAGE.read_text()
    block = text.partition("<!-- verl-scripts-refused:begin -->")[2].partition("<!-- verl-scripts-refused:end -->")[0]
    return dict(re.findall(r"^- `([^`]+)`: (.+)$", block, flags=re.M))


def test_the_script_lists_are_verls_with_their_provenance():
    assert SCRIPTS["source"] == "https://github.com/verl-project/verl" and len(SCRIPTS["commit"]) == 40
    assert "Apache-2.0" in SCRIPTS["license"]
    folders = {name.rsplit("/", 1)[0] for name in SCRIPTS["scripts"]}
    assert folders == {"examples/grpo_trainer", "examples/ppo_trainer", "examples/gspo_trainer", "examples/sapo_trainer"}
    assert len(SCRIPTS["scripts"]) >= 40
    for name, script in SCRIPTS["scripts"].items():
        assert script["entry"] == "verl.trainer.main_ppo", name
        assert any(o.startswith(f"{ARR}.model.path=") for o in script["overrides"]), name


@pytest.mark.timeout(120)
def test_verls_current_example_scripts_resolve_or_are_refused_in_one_line():
    results = {name: _resolve(script) for name, script in SCRIPTS["scripts"].items()}
    refused = {name: msg for name, msg in results.items() if msg is not None}
    for name, msg in refused.items():
        assert "\n" not in msg and "Traceback" not in msg, name
    assert 1 - len(refused) / len(results) >= 0.8, f"{len(refused)} of {len(results)} refused: {refused}"
    documented = _documented_refusals()
    assert set(documented) == set(refused), "docs/from_verl.md's list of refused example scripts is not the refused set"
    for name, why in documented.items():  # the page names the key each one is refused on
        key = re.match(r"`([^`=]+)", why).group(1)
        assert key in refused[name], (name, refused[name])


def test_what_verls_current_scripts_set_reaches_polyrl():
    sapo = SCRIPTS["scripts"]["examples/sapo_trainer/run_qwen3_8b_fsdp.sh"]["overrides"]
    loaded = _load(sapo)
    cfg = to_dict(loaded.config)
    assert cfg["actor"]["policy_loss"]["loss_mode"] == "sapo"
    tau = next(o for o in sapo if ".policy_loss.tau_pos=" in o)
    assert cfg["actor"]["policy_loss"]["extra"]["tau_pos"] == float(tau.split("=")[1])
    # blamed on the command line that set it, not on verl's defaults beside it
    assert tau in loaded.origins["actor.policy_loss.extra.tau_pos"]
    gspo = _load(SCRIPTS["scripts"]["examples/gspo_trainer/run_qwen3_30b_a3b_megatron.sh"]["overrides"])
    actor = to_dict(gspo.config)["actor"]  # model_engine=megatron on verl's default tree
    assert actor["engine"] == "megatron"
    assert actor["plugin_config"]["tensor_model_parallel_size"] == 2
    assert actor["plugin_config"]["expert_model_parallel_size"] == 8


def test_verls_reward_block_and_its_older_spellings_give_the_same_config():
    current = _load([*BASE, "reward.custom_reward_function.path=/r/score.py", "reward.custom_reward_function.name=f",
                     "reward.reward_manager.name=dapo", "reward.num_workers=2",
                     "+reward.reward_kwargs.overlong_buffer_cfg.enable=True",
                     "+reward.reward_kwargs.overlong_buffer_cfg.len=64", "reward.sandbox_fusion.url=http://127.0.0.1:1"])
    older = _load([*BASE, "custom_reward_function.path=/r/score.py", "custom_reward_function.name=f",
                   "reward_model.reward_manager=dapo", "reward_model.num_workers=2",
                   "+reward_model.reward_kwargs.overlong_buffer_cfg.enable=True",
                   "+reward_model.reward_kwargs.overlong_buffer_cfg.len=64",
                   "reward_model.sandbox_fusion.url=http://127.0.0.1:1"])
    a, b = to_dict(current.config)["reward"], to_dict(older.config)["reward"]
    assert a == b
    assert a["manager"] == "dapo" and a["num_workers"] == 2 and a["overlong_buffer_len"] == 64
    assert a["custom_reward_function"] == {"path": "/r/score.py", "name": "f"}
    with pytest.raises(ConfigError, match="two values"):  # both spellings, set differently: say so
        _load([*BASE, "reward.reward_manager.name=dapo", "reward_model.reward_manager=naive"])


def test_newer_verl_blocks_resolve_or_are_refused_by_key():
    loaded = _load([*BASE, "+ray_kwargs.ray_init.runtime_env.env_vars.NCCL_DEBUG=WARN",
                    "ray_kwargs.ray_init.runtime_env.py_executable=null", "trainer.use_v1=true",
                    "distillation.distillation_loss.topk=16", "model_engine=dp",
                    f"{ARR}.rollout.data_parallel_size=2", "critic.fsdp.param_offload=True"])
    assert any("ray_kwargs.ray_init.runtime_env" in w for w in loaded.warnings)  # set, no effect: said once
    for override, key in [("distillation.enabled=True", "distillation.enabled"),
                          ("model_engine=veomni", "model_engine=veomni"),
                          ("trainer.v1.trainer_mode=separate_async", "trainer.v1.trainer_mode"),
                          ("hydra.searchpath=[pkg://verl_mlite.config]", "hydra.searchpath")]:
        with pytest.raises(ConfigError) as err:
            _load([*BASE, override])
        assert key in str(err.value) and "\n" not in str(err.value)


def test_model_engine_in_a_file_or_its_defaults_list_picks_the_trees(tmp_path):
    megatron = "actor_rollout_ref:\n  actor:\n    megatron:\n      tensor_model_parallel_size: 2\n"
    listed = tmp_path / "listed.yaml"  # as verl's own ppo_megatron_trainer.yaml does it
    listed.write_text("defaults:\n  - ppo_trainer\n  - override model_engine: megatron\n  - _self_\n" + megatron)
    top = tmp_path / "top.yaml"
    top.write_text("model_engine: megatron\n" + megatron)
    for file in (listed, top):
        loaded = load_with_origins(PolyrlConfig, [file], BASE, config_format="verl", strict_plugins=False)
        actor = to_dict(loaded.config)["actor"]
        assert actor["engine"] == "megatron" and actor["plugin_config"]["tensor_model_parallel_size"] == 2, file
    (tmp_path / "veomni.yaml").write_text("model_engine: veomni\n")
    with pytest.raises(ConfigError, match="veomni.yaml"):
        load_with_origins(PolyrlConfig, [tmp_path / "veomni.yaml"], BASE, config_format="verl", strict_plugins=False)


def test_a_native_config_with_verls_newer_top_level_keys_is_told_to_use_verls_layout():
    from polyrl.config import loader, verl

    assert set(verl.VERL_ONLY) == loader._VERL_TOP
    with pytest.raises(ConfigError, match="key of verl's layout"):
        load_with_origins(PolyrlConfig, [], ["+distillation.enabled=true"], config_format="native",
                          strict_plugins=False)


def test_hydra_escapes_in_unquoted_values():
    value = parse_override(r"+a.plan={model.layers.\{*\}:{},lm_head:{}}").value
    assert value == {"model.layers.{*}": {}, "lm_head": {}}
    assert parse_override(r"a=x\,y").value == "x,y"
    assert parse_override(r"a=C:\dir").value == r"C:\dir"  # not an escape: kept


def test_errors_name_the_keys_a_verl_layout_config_writes():
    said = speak_verl("rollout.tensor_parallel_size=2 does not divide trainer.n_workers=1; set "
                      "rollout.tensor_parallel_size=1, or trainer.executor=local; or raise data.max_prompt_length, "
                      "or set data.truncation=filter; reward.function failed; actor.optim.lr_warmup_steps")
    assert said == (f"{ARR}.rollout.tensor_model_parallel_size=2 does not divide trainer.nnodes * "
                    f"trainer.n_gpus_per_node=1; set {ARR}.rollout.tensor_model_parallel_size=1, or "
                    "+trainer.executor=local; or raise data.max_prompt_length, or set "
                    "data.filter_overlong_prompts=True; custom_reward_function.path failed; "
                    f"{ARR}.actor.optim.lr_warmup_steps")
    assert speak_verl(f"{ARR}.rollout.name and +trainer.seed") == f"{ARR}.rollout.name and +trainer.seed"
    # the over-length hint: verl's way to drop long prompts; data.truncation is verl's own key and stays
    assert speak_verl("over data.max_prompt_length=8; raise it or set data.truncation to filter/left/right") == (
        "over data.max_prompt_length=8; raise it or set data.filter_overlong_prompts=True (or "
        "data.truncation=left/right)")
    assert speak_verl("data.truncation=left") == "data.truncation=left"


def _laptop_overrides(model: Path, data: Path) -> list[str]:
    text = PAGE.read_text().partition("<!-- laptop-run:begin -->")[2].partition("<!-- laptop-run:end -->")[0]
    command = text.split("```bash", 1)[1].split("```", 1)[0].replace("\\\n", " ")
    command = command.replace("$MODEL", str(model)).replace("$DATA", str(data))
    words = shlex.split(command)
    assert words[:4] == ["polyrl", "train", "--manifest", "polyrl-laptop.toml"]
    return words[4:]


@pytest.mark.timeout(180)
def test_the_laptop_run_of_from_verl_md_trains_as_written(tmp_path, tiny_model_dir, monkeypatch):
    """docs/from_verl.md's laptop block, run as written (one step, a tiny model, rows of the page's gsm8k.py);
    then a start-up check it fails names verl's keys."""
    import pandas as pd

    from polyrl.trainer.commands import train

    data = tmp_path / "data"
    data.mkdir()
    rows = [{"prompt": [{"role": "user", "content": f"What is {i} plus {i}?"}], "data_source": "openai/gsm8k",
             "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(2 * i)}} for i in range(8)]
    for split in ("train", "test"):
        pd.DataFrame(rows).to_parquet(data / f"{split}.parquet")
    (tmp_path / "polyrl-laptop.toml").write_text('[plugins]\nrequire = ["polyrl-engine-fsdp"]\n')
    monkeypatch.chdir(tmp_path)
    overrides = _laptop_overrides(tiny_model_dir, data)
    run = [*overrides, f"trainer.default_local_dir={tmp_path / 'run'}", "+trainer.progress_bar=false"]
    metrics = train("polyrl-laptop.toml", [], run)
    assert metrics and (tmp_path / "run" / "metrics.jsonl").exists()
    with pytest.raises(ConfigError) as err:  # verl's default rollout TP on a one-device laptop
        train("polyrl-laptop.toml", [], [o for o in run if "tensor_model_parallel_size" not in o], dry_run=True)
    assert f"{ARR}.rollout.tensor_model_parallel_size=2" in str(err.value)
    assert "rollout.tensor_parallel_size" not in str(err.value).replace(f"{ARR}.rollout.tensor_model", "")
