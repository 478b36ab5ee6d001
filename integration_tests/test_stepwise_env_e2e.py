"""The stepwise agent loop end to end: the real trainer (Ray workers; sync, one_step_off_policy, fully_async), the hf
rollout, a tiny model, GiGPO over step rows.

A random tiny model cannot write ``<action>up</action>``, so the environment here is a plugin (loaded through the
manifest's ``modules``) that takes any text: three steps through shared states ``at 0 -> at 1 -> at 2``, a reward
of 1 for a step whose text has an even length. Every step is its own sample; GiGPO groups the steps taken from the
same state across the 4 episodes of a prompt. A second one is a learning check: GiGPO against a shuffled-reward
control on a corridor whose rewarded move starts as the tiny model's minority choice.
"""

from __future__ import annotations

import json
import os
import statistics

import pytest

from polyrl.trainer.commands import train

ENV_PLUGIN = '''
import random

from polyrl import hookimpl


class Corridor:
    def reset(self, seed, row):
        self.t = 0
        return "at 0"

    def step(self, action):
        self.t += 1
        return f"at {self.t}", float(len(action) % 2 == 0), self.t >= 3, {"success": self.t >= 3}

    def state_key(self):
        return self.t


class ParityCorridor:
    """Cells 0..3; a text whose first character has an even code moves right (the tiny model's initial minority: about
    1 in 4), else left. Reward 1 for each move right (with `shuffled`, a coin flip each move: the control). The
    episode ends at cell 3 (a success) or after 5 moves."""

    def __init__(self, shuffled):
        self.shuffled = shuffled

    def reset(self, seed, row):
        self.t, self.pos, self.rng = 0, 0, random.Random(seed * 7919 + 1)
        return f"at {self.pos}"

    def step(self, action):
        self.t += 1
        right = ord(action[0]) % 2 == 0
        self.pos = self.pos + 1 if right else max(0, self.pos - 1)
        won = self.pos >= 3
        reward = float(self.rng.random() < 0.5) if self.shuffled else float(right)
        return f"at {self.pos}", reward, won or self.t >= 5, {"success": won}

    def state_key(self):
        return self.pos


@hookimpl
def register_environments(register):
    register("corridor", lambda config: Corridor())
    register("parity_corridor", lambda config: ParityCorridor(bool(config.get("shuffled"))))
'''


#: sync: two Ray workers, each generating its share of the episodes (the driver joins their step rows);
#: one_step_off_policy: a split rollout worker generates the next step's episodes while this step trains
MODES = {
    "sync": ["trainer.n_workers=2"],
    "one_step_off_policy": ["trainer.n_workers=1", "trainer.placement=split", "trainer.rollout_workers=1",
                            "trainer.async_mode=one_step_off_policy"],
    # the rollout worker streams prompt groups (each its 4 episodes' step rows) into the queue, chunks of one group
    "fully_async": ["trainer.n_workers=1", "trainer.placement=split", "trainer.rollout_workers=1",
                    "trainer.async_mode=fully_async", "trainer.async_chunk_groups=1"],
}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", list(MODES))
def test_gigpo_trains_on_step_rows(tiny_model, tmp_path, monkeypatch, mode):
    from polyrl.data.synthetic import write_jsonl

    (tmp_path / "corridor_env.py").write_text(ENV_PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))  # workers
    manifest = tmp_path / "polyrl.toml"
    manifest.write_text('[plugins]\nrequire = ["polyrl-engine-fsdp>=0.1,<0.2"]\nmodules = ["corridor_env"]\n')
    rows = [{"prompt": [{"role": "user", "content": "Walk."}], "data_source": "env/corridor", "agent_name": "stepwise",
             "extra_info": {"env": "corridor", "seed": i, "action_pattern": "", "history_k": 1}} for i in range(4)]
    write_jsonl(rows, tmp_path / "train.jsonl")
    run = tmp_path / "run"
    train(manifest, [], [
        f"model.path={tiny_model}", f"data.train_files=[{tmp_path / 'train.jsonl'}]", "data.train_batch_size=2",
        f"data.val_files=[{tmp_path / 'train.jsonl'}]", "rollout.val_n=2",
        "data.max_prompt_length=160", "data.max_response_length=6", "actor.engine=fsdp", "actor.ppo_mini_batch_size=2",
        "actor.micro_batch_size=16", "actor.optim.lr=1e-3", "rollout.n=4", "algorithm.adv_estimator=gigpo",
        "algorithm.gamma=0.95", "trainer.executor=ray", "trainer.ray_num_cpus=2", *MODES[mode],
        "trainer.total_steps=2", "trainer.progress_bar=false",
        "trainer.logger=[jsonl]", "trainer.val_before_train=true", "trainer.test_freq=0", f"trainer.rollout_data_dir={run / 'rollouts'}",
        f"trainer.run_dir={run}"])
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    # validation: one result per episode (4 rows x val_n 2)
    val = [r for r in metrics if "val/env/corridor/success_rate" in r]
    assert val, "no validation metrics"
    rate = val[0]["val/env/corridor/success_rate"]
    assert 0.0 <= rate <= 1.0 and float(rate * 8).is_integer(), rate  # per episode (8), not per step row
    steps = [r for r in metrics if "env/episodes" in r]
    assert len(steps) == 2
    for r in steps:
        assert r["env/episodes"] == 8  # 2 prompts x 4 samples
        # an episode is 3 steps unless the model wrote nothing (a malformed action ends it)
        assert r["env/step_rows"] >= 8 and r["env/step_rows"] % 8 == 0  # padded to whole mini-batches
        assert 1.0 <= r["env/steps/mean"] <= 3.0 and r["env/malformed_actions"] <= 8
        # every step that is not the last of its episode was a full step of a 3-step walk (or the model wrote nothing)
        assert r["env/step_rows"] >= r["env/episodes"] * r["env/steps/mean"]
        assert "actor/pg_loss" in r and 0.0 <= r["env/return/mean"] <= 3.0
        print({k: v for k, v in r.items() if k.startswith("env/")})
    dumped = [json.loads(line) for line in (run / "rollouts" / "1.jsonl").read_text().splitlines()]
    ids = [d["sample_id"] for d in dumped]
    assert len(ids) == steps[0]["env/step_rows"] and any("/step2" in i for i in ids)
    # the step rows of one sample share its uid (the episode group) and keep their own prompts
    by_sample: dict[str, list[dict]] = {}
    for d in dumped:
        if "#pad" not in d["sample_id"]:
            by_sample.setdefault(d["sample_id"].rsplit("/step", 1)[0], []).append(d)
    assert len(by_sample) == 8
    for parts in by_sample.values():
        assert len({p["uid"] for p in parts}) == 1
        assert [p["prompt"].count("at ") for p in parts] == sorted(p["prompt"].count("at ") for p in parts)
    assert any(abs(d["advantage"]) > 0 for d in dumped)


def _learning_run(tiny_model, root, shuffled: bool) -> list[float]:
    from polyrl.data.synthetic import write_jsonl

    rows = [{"prompt": [{"role": "user", "content": "Walk."}], "data_source": "env/parity_corridor",
             "agent_name": "stepwise",
             "extra_info": {"env": "parity_corridor", "env_kwargs": {"shuffled": shuffled}, "seed": i,
                            "action_pattern": "", "history_k": 0, "max_steps": 6}} for i in range(64)]
    write_jsonl(rows, root / "train.jsonl")
    run = root / f"run-{shuffled}"
    train(root / "polyrl.toml", [], [
        f"model.path={tiny_model}", f"data.train_files=[{root / 'train.jsonl'}]", "data.train_batch_size=4",
        "data.max_prompt_length=48", "data.max_response_length=2", "actor.engine=fsdp", "actor.ppo_mini_batch_size=4",
        "actor.micro_batch_size=64", "actor.optim.lr=1e-2", "actor.optim.weight_decay=0.0", "rollout.n=4",
        "algorithm.adv_estimator=gigpo", "algorithm.gamma=1.0", "trainer.executor=local", "trainer.total_steps=20",
        "trainer.progress_bar=false", "trainer.logger=[jsonl]", "trainer.val_before_train=false", "trainer.seed=1",
        "data.seed=1", f"trainer.run_dir={run}"])
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["env/success_rate"] for r in metrics if "env/success_rate" in r]


@pytest.mark.timeout(300)
def test_gigpo_raises_success_against_a_shuffled_reward_control(tiny_model, tmp_path, monkeypatch):
    """The tiny model learns to walk right (to start its text with an even character, about 1 in 4 of its first
    characters before training) with GiGPO; with rewards that ignore what it did (a coin flip each move: the
    shuffled-reward control) it does not (its policy drifts, if anywhere, towards its majority: left)."""
    (tmp_path / "corridor_env.py").write_text(ENV_PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "polyrl.toml").write_text('[plugins]\nrequire = ["polyrl-engine-fsdp>=0.1,<0.2"]\n'
                                          'modules = ["corridor_env"]\n')
    learned = _learning_run(tiny_model, tmp_path, shuffled=False)
    control = _learning_run(tiny_model, tmp_path, shuffled=True)
    print("success per step: gigpo", learned, "control", control)
    assert len(learned) == len(control) == 20
    late = statistics.mean(learned[-5:])
    assert late >= statistics.mean(learned[:5]) + 0.3, learned
    assert late >= statistics.mean(control[-5:]) + 0.3, (learned, control)
