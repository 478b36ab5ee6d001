"""The OpenEnv adapter: OpenEnv-style environments (pydantic observation / action objects, reset(seed=,
episode_id=), step(action)) taken as they are, written here against openenv-core 0.3's interface (the package is
not installed: it requires gradio and fastmcp)."""

from __future__ import annotations

import asyncio
import random
import textwrap
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import pytest
from pydantic import BaseModel, ConfigDict, Field

from polyrl.agent_loops.stepwise import StepwiseAgentLoop
from polyrl.config.schema import AgentConfig
from polyrl.environments.openenv import OpenEnvAdapter, make_openenv, observation_text, openenv_factory
from polyrl.models.tiny import build_char_tokenizer
from polyrl.protocols import GenerationResult, SamplingParams
from polyrl.testing import EnvironmentConformance

# --- openenv.core.env_server's base classes, as openenv-core 0.3 defines them (types.py, interfaces.py)


class Action(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, arbitrary_types_allowed=True)
    metadata: dict[str, Any] = Field(default_factory=dict)


class Observation(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, arbitrary_types_allowed=True)
    done: bool = False
    reward: bool | int | float | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)


class State(BaseModel):
    model_config = ConfigDict(extra="allow", validate_assignment=True)
    episode_id: str | None = None
    step_count: int = 0


ActT, ObsT, StateT = TypeVar("ActT"), TypeVar("ObsT"), TypeVar("StateT")


class Environment(ABC, Generic[ActT, ObsT, StateT]):
    @abstractmethod
    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> ObsT: ...

    @abstractmethod
    def step(self, action: ActT, timeout_s: float | None = None, **kwargs: Any) -> ObsT: ...

    @property
    @abstractmethod
    def state(self) -> StateT: ...


# --- an environment written as an OpenEnv user writes one: a number line, walk to the target


class MoveAction(Action):
    step: int


class LineObservation(Observation):
    position: int
    target: int
    message: str


class NumberLine(Environment[MoveAction, LineObservation, State]):
    """Start at 0; the target is 2..4 to the right (from the seed); reward 1 at the target, -0.1 a move."""

    def __init__(self, limit: int = 6) -> None:
        self.limit = limit
        self._state = State()

    def reset(self, seed=None, episode_id=None, **kwargs):
        self.position, self.target = 0, random.Random(seed).randint(2, 4)
        self._state = State(episode_id=episode_id, step_count=0)
        return LineObservation(position=0, target=self.target, message=self._message())

    def _message(self):
        return f"You are at {self.position}; the target is at {self.target}."

    def step(self, action, timeout_s=None, **kwargs):
        if action.step not in (-1, 1):
            raise ValueError(f"step must be -1 or 1, not {action.step}")
        self.position += action.step
        self._state.step_count += 1
        won = self.position == self.target
        return LineObservation(position=self.position, target=self.target, message=self._message(), done=won
                               or self._state.step_count >= self.limit, reward=1.0 if won else -0.1,
                               metadata={"success": won})

    @property
    def state(self):
        return self._state


class TestOpenEnvConformance(EnvironmentConformance):
    actions = ["1", "1", "-1", "1", "1"]
    invalid_action = "forward"  # not an int: pydantic rejects it (ValidationError is a ValueError)

    @pytest.fixture
    def environment_factory(self):
        return openenv_factory(NumberLine, observation=lambda obs: obs.message)


def test_observation_objects_become_text_and_results_are_read():
    env = OpenEnvAdapter(NumberLine())  # the action class from Environment[MoveAction, ...]
    first = env.reset(3, {"uid": "row-7"})
    target = random.Random(3).randint(2, 4)
    # several fields of its own: their JSON (done, reward and metadata left out)
    assert first == f'{{"message": "You are at 0; the target is at {target}.", "position": 0, "target": {target}}}'
    assert env.env.state.episode_id == "row-7"
    text, reward, done, info = env.step("1")
    assert (reward, done, info) == (-0.1, False, {"success": False}) and '"position": 1' in text
    assert env.state_key() == text
    assert env.step('{"step": -1}')[0] == first  # a JSON object of the action's fields
    with pytest.raises(ValueError, match="-1 or 1"):
        env.step("2")
    with pytest.raises(ValueError):
        env.step('{"step": 1, "speed": 2}')  # extra="forbid"
    assert observation_text({"board": "..X", "done": False}) == "..X"
    assert observation_text("plain text") == "plain text"


@dataclass
class StepResult:  # openenv.core.client_types.StepResult
    observation: Any
    reward: float | None = None
    done: bool = False


class EchoObservation(Observation):  # openenv's echo_env
    echoed_message: str


class EchoClient:
    """An async client (as OpenEnv's EnvClient): results are StepResults; the episode ends on 'bye'."""

    def __init__(self):
        self.said: list[str] = []

    async def reset(self, seed=None, episode_id=None):
        await asyncio.sleep(0)
        return StepResult(EchoObservation(echoed_message="say something"))

    async def step(self, action):
        self.said.append(action.message)
        obs = EchoObservation(echoed_message=action.message)
        return StepResult(obs, reward=float(len(action.message)), done=action.message == "bye")


class EchoAction(Action):
    message: str


class Scripted:
    def __init__(self, tok, turns):
        self.tok, self.turns, self.requests = tok, turns, []

    async def agenerate(self, request):
        self.requests.append(request)
        ids = self.tok.encode(self.turns[len(self.requests) - 1], add_special_tokens=False) + [self.tok.eos_token_id]
        return [GenerationResult(list(request.prompt_ids), ids, [-0.5] * len(ids))]


def test_an_async_client_plays_through_the_stepwise_loop():
    tok = build_char_tokenizer()
    clients: list[EchoClient] = []

    def factory(config):
        clients.append(EchoClient())
        return OpenEnvAdapter(clients[-1], action_cls=EchoAction)

    loop = StepwiseAgentLoop(tokenizer=tok, config=AgentConfig(max_turns=5), environments={"echo": factory},
                             max_prompt_length=4096)
    client = Scripted(tok, ["<action>hi</action>", "<action>bye</action>"])
    row = {"uid": "u1", "prompt": [{"role": "user", "content": "Talk."}], "agent_name": "stepwise",
           "extra_info": {"env": "echo", "history_k": 1}}
    outs = asyncio.run(loop.run(row, SamplingParams(max_new_tokens=32, seed=0), client))
    assert clients[-1].said == ["hi", "bye"] and len(outs) == 2
    assert [o.extra["step_rewards"] for o in outs] == [2.0, 3.0] and outs[-1].extra["episode_end"] == 1.0
    assert "say something" in tok.decode(client.requests[0].prompt_ids)
    assert "hi" in tok.decode(client.requests[1].prompt_ids)  # the echoed observation reached the next prompt


def test_the_builtin_openenv_environment_names_the_class_by_import_string(tmp_path, monkeypatch):
    (tmp_path / "my_openenv_game.py").write_text(textwrap.dedent("""
        from pydantic import BaseModel

        class Say(BaseModel):
            word: str

        class Seen(BaseModel):
            text: str
            done: bool = False
            reward: float | None = None

        class Parrot:
            def __init__(self, goal="cracker"):
                self.goal = goal

            def reset(self, seed=None, episode_id=None):
                return Seen(text=f"say {self.goal}")

            def step(self, action):
                return Seen(text=action.word, done=action.word == self.goal, reward=float(action.word == self.goal))
        """))
    monkeypatch.syspath_prepend(str(tmp_path))
    env = make_openenv({"class": "my_openenv_game:Parrot", "kwargs": {"goal": "seed"},
                        "action_class": "my_openenv_game:Say"})
    assert env.reset(0, {}) == "say seed"
    assert env.step("seed") == ("seed", 1.0, True, {})
    with pytest.raises(ValueError, match="env_kwargs.class is required"):
        make_openenv({})
    with pytest.raises(ValueError, match=r"unknown env_kwargs \['klass'\]"):
        make_openenv({"klass": "x:y"})
    with pytest.raises(ValueError, match="env_kwargs.class: .*no_such_module"):
        make_openenv({"class": "no_such_module:Env"})
    with pytest.raises(TypeError, match="action class of Parrot.*action_cls"):
        make_openenv({"class": "my_openenv_game:Parrot"})
    with pytest.raises(TypeError, match=r"object has no reset.*reset\(seed=, episode_id=\) and step"):
        OpenEnvAdapter(object(), action=str)
