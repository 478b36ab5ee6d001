"""The stepwise loop: one token-exact sample per environment step, episodes that end cleanly on every failure,
and the trainer's seam that turns a sample's steps into batch rows.

The model is a scripted client (it answers the texts it is told; a test double of the rollout, so the episodes are
known in advance); the tokenizers are real: the tiny character tokenizer and, where ``make real-model`` fetched it,
SmolLM2-135M-Instruct's (ChatML template; the tokenizer only).
"""

from __future__ import annotations

import asyncio
import math
import threading
from pathlib import Path

import pytest
import torch

from polyrl.agent_loops import collate, run_agent_loops
from polyrl.agent_loops.runner import agent_metrics, sample_of_rows
from polyrl.agent_loops.stepwise import ENV_EXECUTOR, StepwiseAgentLoop, anchor_id, last_k_history, parse_action
from polyrl.config.schema import AgentConfig
from polyrl.environments.gridworld import GridWorld, make_gridworld, shortest_path
from polyrl.errors import DataError
from polyrl.protocols import GenerationResult, SamplingParams
from polyrl.trainer.step_rows import expand_to_rows, pad_step_rows

SMOLLM2 = Path.home() / ".cache" / "polyrl" / "models" / "SmolLM2-135M-Instruct"
TASK = [{"role": "system", "content": "Walk to G. Answer <action>up|down|left|right</action>."}]


class ScriptedClient:
    """A model that says what it is told: call k answers ``turns[k]`` + EOS, with made-up log-probs."""

    def __init__(self, tokenizer, turns):
        self.tok, self.turns, self.requests = tokenizer, list(turns), []

    async def agenerate(self, request):
        self.requests.append(request)
        text = self.turns[min(len(self.requests) - 1, len(self.turns) - 1)]
        ids = self.tok.encode(text, add_special_tokens=False) + [self.tok.eos_token_id]
        ids = ids[: request.sampling_params.max_new_tokens]
        return [GenerationResult(list(request.prompt_ids), ids, [-0.5 - 0.01 * i for i in range(len(ids))])]


def char_tokenizer():
    from polyrl.models.tiny import build_char_tokenizer

    return build_char_tokenizer()


def smollm2_tokenizer():
    if not (SMOLLM2 / "tokenizer.json").exists():
        pytest.skip(f"no SmolLM2 tokenizer at {SMOLLM2} (make real-model fetches it)")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(SMOLLM2))


@pytest.fixture(params=["char", "smollm2"])
def tokenizer(request):
    return char_tokenizer() if request.param == "char" else smollm2_tokenizer()


def row(uid="u0", seed=3, **extra_info):
    info = {"env": "gridworld", "env_kwargs": {"size": 4, "holes": 3}, "seed": seed, **extra_info}
    return {"uid": uid, "prompt": TASK, "data_source": "env/gridworld", "agent_name": "stepwise", "extra_info": info}


def loop(tokenizer, environments=None, **agent):
    return StepwiseAgentLoop(tokenizer=tokenizer, config=AgentConfig(**{"max_turns": 10, **agent}),
                             environments=environments, max_prompt_length=4096)


def play(agent_loop, sample, client, max_new_tokens=64):
    return asyncio.run(agent_loop.run(sample, SamplingParams(max_new_tokens=max_new_tokens, seed=0), client))


def render(tok, messages):
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"]) if hasattr(ids, "keys") else list(ids)


def test_each_step_is_a_token_exact_sample_through_the_chat_template(tokenizer):
    env = GridWorld(4, 3)
    first = env.reset(3, {})
    plan = shortest_path(4, env.holes)
    texts = [f"Step {t}: I go {m}. <action>{m}</action>" for t, m in enumerate(plan)]
    client = ScriptedClient(tokenizer, texts)
    outs = play(loop(tokenizer), row(history_k=2), client)
    assert len(outs) == len(plan) == len(client.requests)

    # what the prompts must be: the task, the last 2 (observation, model text) pairs, the current observation
    replay = GridWorld(4, 3)
    observation = replay.reset(3, {})
    assert observation == first
    turns = []
    episode = {int(o.extra["episode_id"]) for o in outs}
    assert len(episode) == 1
    for t, (out, text, move) in enumerate(zip(outs, texts, plan)):
        expected = last_k_history(TASK, turns, observation, 2)
        assert out.prompt_ids == render(tokenizer, expected), f"step {t}: prompt"
        assert out.prompt_ids == client.requests[t].prompt_ids
        sampled = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
        assert out.response_ids == sampled and out.response_mask == [1] * len(sampled)
        assert out.log_probs == pytest.approx([-0.5 - 0.01 * i for i in range(len(sampled))])
        assert int(out.extra["step_index"]) == t
        assert int(out.extra["anchor_key"]) == anchor_id(replay.state_key()), f"step {t}: the state before acting"
        decoded = tokenizer.decode(out.response_ids, skip_special_tokens=True)
        turns.append((observation, decoded.strip()))
        observation, reward, done, _ = replay.step(move)
        assert out.extra["step_rewards"] == reward
        assert out.metrics["tool_reward"] == 1.0  # the episode's return on every step row
    assert done
    assert [o.extra["episode_end"] for o in outs] == [0.0] * (len(outs) - 1) + [1.0]
    assert outs[-1].extra["episode_success"] == 1.0 and outs[-1].extra["episode_steps"] == len(plan)
    # the history is cut to the last 2 pairs: the last prompt does not hold the first step's text
    assert texts[0] not in tokenizer.decode(outs[-1].prompt_ids) and texts[-2] in tokenizer.decode(outs[-1].prompt_ids)


def test_transcript_history_keeps_every_step():
    tok = char_tokenizer()
    texts = ["<action>right</action>", "<action>left</action>", "<action>right</action>"]
    outs = play(loop(tok), row(history="transcript", env_kwargs={"size": 4, "holes": 0}, max_steps=3),
                ScriptedClient(tok, texts))
    assert len(outs) == 3 and all(len(a.prompt_ids) < len(b.prompt_ids) for a, b in zip(outs, outs[1:]))
    last = tok.decode(outs[-1].prompt_ids)
    assert last.count("<action>") == 1 + 2 and outs[-1].extra["episode_end"] == 1.0  # the task + 2 steps; max_steps
    assert outs[-1].extra["episode_success"] == 0.0
    # right then left: back in the start state, the same anchor as step 0
    assert int(outs[2].extra["anchor_key"]) == int(outs[0].extra["anchor_key"]) != int(outs[1].extra["anchor_key"])


@pytest.mark.parametrize("text", ["I would go up", "<action>jump</action>"])
def test_a_malformed_action_ends_the_episode_and_is_counted(text, caplog):
    tok = char_tokenizer()
    outs = play(loop(tok), row(), ScriptedClient(tok, ["<action>right</action>", text]))
    assert len(outs) == 2
    assert outs[-1].extra["malformed_actions"] == 1.0 and outs[-1].metrics["parse_errors"] == 1.0
    assert outs[0].extra["malformed_actions"] == 0.0
    assert "gridworld" in caplog.text and "u0" in caplog.text


class Misbehaving:
    """An environment that fails in the way ``how`` names at step 2 (reset works)."""

    def __init__(self, how):
        self.how, self.t = how, 0

    def reset(self, seed, row):
        self.t = 0
        return "start"

    def step(self, action):
        self.t += 1
        if self.t < 2:
            return f"at {self.t}", 0.5, False, {}
        if self.how == "raises":
            raise RuntimeError("the simulator crashed")
        if self.how == "hangs":
            threading.Event().wait(5)
        if self.how == "nan":
            return "at 2", math.nan, False, {}
        return f"at {self.t}", 0.5, self.t >= 3, {}

    def state_key(self):
        return ["unhashable", self.t] if self.how == "unhashable" else self.t


class AsyncHang:
    async def reset(self, seed, row):
        await asyncio.sleep(5)
        return "never"

    def step(self, action):
        raise AssertionError("not reached")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how,count,steps", [("raises", "env_errors", 2), ("hangs", "env_timeouts", 2),
                                             ("nan", "nonfinite_rewards", 2), ("unhashable", "unhashable_anchors", 3)])
def test_a_misbehaving_environment_is_counted_and_the_episode_ends(how, count, steps, caplog):
    tok = char_tokenizer()
    agent_loop = loop(tok, environments={"bad": lambda config: Misbehaving(how)})
    outs = play(agent_loop, row(env="bad", env_timeout_s=0.3, action_pattern=""), ScriptedClient(tok, ["go"]))
    assert len(outs) == steps
    assert sum(o.extra[count] for o in outs) == (steps if how == "unhashable" else 1)
    assert outs[-1].extra["episode_end"] == 1.0
    assert "environment 'bad'" in caplog.text
    if how == "nan":
        assert outs[-1].extra["step_rewards"] == 0.0 and outs[0].metrics["tool_reward"] == 0.5
    if how == "unhashable":  # each such step is a group of its own
        assert len({int(o.extra["anchor_key"]) for o in outs}) == steps
    if how == "hangs":
        assert ENV_EXECUTOR.hung <= 1


@pytest.mark.timeout(60)
def test_a_reset_that_hangs_gives_one_untrained_row():
    tok = char_tokenizer()
    outs = play(loop(tok, environments={"slow": lambda config: AsyncHang()}),
                row(env="slow", env_timeout_s=0.2), ScriptedClient(tok, ["go"]))
    assert len(outs) == 1 and outs[0].response_mask == [0] and outs[0].extra["env_timeouts"] == 1.0


def test_bad_rows_are_data_errors_naming_the_row():
    tok = char_tokenizer()
    with pytest.raises(DataError, match="u0.*extra_info.env"):
        play(loop(tok), {**row(), "extra_info": {}}, ScriptedClient(tok, ["x"]))
    with pytest.raises(DataError, match="u0.*'nowhere'.*gridworld"):
        play(loop(tok, environments={"gridworld": make_gridworld}), row(env="nowhere"), ScriptedClient(tok, ["x"]))
    with pytest.raises(DataError, match="u0.*gridworld.*env_kwargs"):
        play(loop(tok), row(env_kwargs={"lakes": 1}), ScriptedClient(tok, ["x"]))
    with pytest.raises(DataError, match="history='diary'.*summary"):
        play(loop(tok), row(history="diary"), ScriptedClient(tok, ["x"]))


def test_parse_action():
    assert parse_action("a <action> up </action> then <action>left</action>") == "left"
    assert parse_action("no tags") is None and parse_action("<action> </action>") is None
    assert parse_action("  down \n", "") == "down"
    assert parse_action("MOVE: up", r"MOVE: (\w+)") == "up"


def test_runner_collate_and_the_trainer_seam_make_one_row_per_step():
    """Two samples of one row and one of another: the runner flattens the steps, collate makes rows,
    ``sample_of_rows`` finds each row's sample, the rows get their sample's uid, and padding rows train nothing."""
    tok = char_tokenizer()
    env = GridWorld(4, 3)
    env.reset(3, {})
    plan = shortest_path(4, env.holes)
    turns = [f"<action>{m}</action>" for m in plan]

    class PerSampleClient:
        """Sample 0 walks the optimal path, sample 1 errs at once, sample 2 (another row) walks right and back."""

        async def agenerate(self, request):
            who = request.request_id.split("/")[0]
            step = int(request.request_id.rsplit("step", 1)[1])
            scripts = {"a": turns, "b": ["nothing"], "c": ["<action>right</action>", "<action>left</action>"]}
            text = scripts[who[0]][step]
            ids = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
            return [GenerationResult(list(request.prompt_ids), ids, [-1.0] * len(ids))]

    samples = [row(uid="a1"), row(uid="b1"), row(uid="c2", max_steps=2)]
    outs = run_agent_loops(samples, SamplingParams(max_new_tokens=32), PerSampleClient(),
                           {"stepwise": loop(tok)}, default="single_turn")
    assert len(outs) == len(plan) + 1 + 2
    batch = collate(outs, pad_token_id=0, max_prompt_length=512, max_response_length=32)
    owner = sample_of_rows(batch, 3)
    assert owner == [0] * len(plan) + [1] + [2, 2]
    expanded, ids = expand_to_rows(batch, samples, ["a/0", "b/0", "c/0"])
    assert [s["uid"] for s in expanded] == ["a1"] * len(plan) + ["b1", "c2", "c2"]
    assert ids[:2] == ["a/0/step0", "a/0/step1"] and ids[-1] == "c/0/step1"

    from polyrl import batch as batch_ops

    batch_ops.set_non_tensor(batch, "uid", [s["uid"] for s in expanded])
    padded = pad_step_rows(batch, 8)
    rows = padded.batch_size[0]
    assert rows % 8 == 0 and rows >= batch.batch_size[0]
    extra = rows - batch.batch_size[0]
    assert extra > 0  # 9 step rows: padded to 16
    assert padded["response_mask"][-extra:].sum() == 0 and padded["step_padding"].sum() == extra
    uids = batch_ops.non_tensor(padded, "uid")
    assert len(set(uids[-extra:])) == extra and not set(uids[-extra:]) & set(uids[:-extra])

    metrics = agent_metrics(padded)
    assert metrics["env/episodes"] == 3 and metrics["env/success_rate"] == pytest.approx(1 / 3)
    assert metrics["env/malformed_actions"] == 1 and metrics["env/step_rows"] == rows
    assert metrics["env/return/mean"] == pytest.approx(1 / 3)
    assert torch.equal(padded["step_index"][: len(plan)], torch.arange(len(plan)))


def test_one_row_per_sample_needs_no_step_index():
    from polyrl.protocols import AgentLoopOutput

    outs = [AgentLoopOutput(prompt_ids=[1, 2], response_ids=[3], response_mask=[1]) for _ in range(3)]
    batch = collate(outs, pad_token_id=0, max_prompt_length=4, max_response_length=4)
    assert sample_of_rows(batch, 3) is None
    with pytest.raises(ValueError, match="4 samples"):
        sample_of_rows(batch, 4)


def test_a_step_index_that_is_not_one_per_row_is_not_read_as_steps():
    """A diffusion rollout's ``step_index`` is ``[rows, T]`` (its sampler's steps): one row per sample, as usual."""
    from tensordict import TensorDict

    batch = TensorDict({"step_index": torch.arange(12).view(3, 4)}, batch_size=[3])
    assert sample_of_rows(batch, 3) is None


def test_summary_history_is_a_bounded_memory_token_exact_through_the_chat_template(tokenizer):
    from polyrl.agent_loops.history import Turn, summary_history

    moves = ["up", "right", "left", "right", "down"]  # up at the top edge changes nothing; left returns to start
    texts = [f"I try {m}. <action>{m}</action>" for m in moves]
    client = ScriptedClient(tokenizer, texts)
    outs = play(loop(tokenizer), row(history="summary", history_k=2, env_kwargs={"size": 4, "holes": 0},
                                     max_steps=len(moves)), client)
    assert len(outs) == len(moves)
    replay = GridWorld(4, 0)
    observation = replay.reset(3, {})
    turns: list = []
    for t, (out, move) in enumerate(zip(outs, moves)):
        assert out.prompt_ids == render(tokenizer, summary_history(TASK, turns, observation, 2)), f"step {t}"
        assert out.prompt_ids == client.requests[t].prompt_ids
        text = tokenizer.decode(out.response_ids, skip_special_tokens=True).strip()
        after, reward, _, _ = replay.step(move)
        turns.append(Turn(observation, text, move, reward, after))
        observation = after
    # the last prompt's memory, written out by hand: 4 steps, start / start / (0,1) / start seen, now (0,1) again
    start, one_right = "P...\n....\n....\n...G", ".P..\n....\n....\n...G"
    expected = ("Memory of this episode:\nSteps so far: 4; total reward 0.\n"
                "Distinct observations seen: 2; the current one 1 time before.\n"
                "Actions that changed nothing: up.\nLast actions:\n- step 3: left -> reward 0\n"
                "- step 4: right -> reward 0\n\nCurrent observation:\n" + one_right)
    assert outs[-1].prompt_ids == render(tokenizer, TASK + [{"role": "user", "content": expected}])
    assert outs[0].prompt_ids == render(tokenizer, TASK + [{"role": "user", "content": start}])
    # bounded: no model text of an earlier step reaches the prompt, and the memory does not grow past k + 4 lines
    assert "I try" not in tokenizer.decode(outs[-1].prompt_ids)
    long = [Turn(start, "x", f"move{i}", 1.0, start if i % 2 else one_right) for i in range(200)]
    memory = summary_history(TASK, long, start, 3)[-1]["content"]
    assert memory.count("\n- step") == 3 and len(memory) < 600 and "total reward 200." in memory


def test_group_slices_give_each_prompt_group_its_samples_step_rows():
    from tensordict import TensorDict

    from polyrl.trainer.step_rows import group_slices

    # 2 prompt groups x n=2 samples; the samples' episodes are 3, 1, 2 and 2 steps long
    steps = [0, 1, 2, 0, 0, 1, 0, 1]
    batch = TensorDict({"step_index": torch.tensor(steps)}, batch_size=[8])
    assert group_slices(batch, 2, 2) == [slice(0, 4), slice(4, 8)]
    batch = TensorDict({"step_index": torch.tensor([0, 0, 1, 2, 0, 0, 1])}, batch_size=[7])  # 1, 3 | 1, 2 steps
    assert group_slices(batch, 2, 2) == [slice(0, 4), slice(4, 7)]
    plain = TensorDict({"x": torch.zeros(6)}, batch_size=[6])  # one row per sample
    assert group_slices(plain, 3, 2) == [slice(0, 2), slice(2, 4), slice(4, 6)]
