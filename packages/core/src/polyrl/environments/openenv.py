"""OpenEnv-style environments as polyrl environments (:class:`polyrl.protocols.Environment`), taken as they are.

Written against openenv-core 0.3's interface (``openenv.core.env_server.interfaces.Environment`` and its
``types``), duck-typed: openenv-core is not installed here (it requires gradio, fastmcp, fastapi and uvicorn).
What is read:

- ``env.reset(seed=..., episode_id=...)`` returns an *observation object*: a pydantic model (``Observation``) with
  ``done``, ``reward`` and ``metadata`` besides its own fields; ``env.step(action)`` takes an *action object* (a
  pydantic ``Action`` subclass) and returns the next observation. A client's ``StepResult`` (``.observation``,
  ``.reward``, ``.done``) is read too; either call may be ``async def`` (OpenEnv's ``EnvClient``) or return an
  awaitable.
- The model's action text becomes the action object: through ``action=`` (a callable ``text -> action``), else
  the action class (``action_cls=``, else the first type argument of the environment's generic base,
  ``Environment[MyAction, MyObservation, MyState]``) built from the text: its one field other than ``metadata``
  set to the text (pydantic converts it: ``"3"`` for an ``int`` field), or a JSON object of its fields. A text it
  rejects (pydantic's ``ValidationError`` is a ``ValueError``) is a malformed action, as the loop counts them.
- The observation object becomes the text the model sees through ``observation=`` (a callable), else: a string as
  it is; an object with one field of its own (besides ``done``, ``reward``, ``metadata``) that field's value;
  with several, their JSON.
- ``reward`` None counts 0; ``metadata["success"]`` (else ``info`` of a client's result) feeds
  ``env/success_rate``. The state key (GiGPO's anchor) is ``state_key(env)`` when given, else the observation's
  text, as for any environment without ``state_key()``.

TRL's ``environment_factory`` classes are of another shape (their public methods are tools the model calls, and
the reward is read from the instance by a reward function): they belong to the ``tool_agent`` loop, not here.
"""

from __future__ import annotations

import inspect
import json
import typing
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["OpenEnvAdapter", "make_openenv", "observation_text", "openenv_factory"]

#: Fields every OpenEnv observation has that are not what the model should read.
_BASE_FIELDS = ("done", "reward", "metadata")


def _fields(obj: Any) -> dict[str, Any]:
    """An observation's or action class's own fields: a pydantic model's (v2 or v1), a dataclass's, or a mapping."""
    if isinstance(obj, Mapping):
        return dict(obj)
    fields = getattr(type(obj), "model_fields", None) or getattr(type(obj), "__fields__", None)
    if fields:
        return {**{name: getattr(obj, name) for name in fields}, **(getattr(obj, "model_extra", None) or {})}
    if hasattr(obj, "__dataclass_fields__"):
        return {name: getattr(obj, name) for name in obj.__dataclass_fields__}
    return dict(vars(obj)) if hasattr(obj, "__dict__") else {}


def observation_text(obs: Any) -> str:
    """The text the model sees of an OpenEnv observation (see the module docstring)."""
    if isinstance(obs, str):
        return obs
    own = {k: v for k, v in _fields(obs).items() if k not in _BASE_FIELDS}
    if len(own) == 1:
        (value,) = own.values()
        return value if isinstance(value, str) else json.dumps(value, default=str)
    return json.dumps(own, default=str, sort_keys=True)


def _action_class_of(env: Any) -> type | None:
    """The ``ActT`` of ``class MyEnv(Environment[ActT, ObsT, StateT])`` (the first type argument of a generic base)."""
    for klass in type(env).__mro__:
        for base in getattr(klass, "__orig_bases__", ()):
            args = typing.get_args(base)
            if args and isinstance(args[0], type):
                return args[0]
    return None


def _action_fields(cls: type) -> list[str]:
    fields = getattr(cls, "model_fields", None) or getattr(cls, "__fields__", None) \
        or getattr(cls, "__dataclass_fields__", None) or {}
    return [name for name in fields if name != "metadata"]


class OpenEnvAdapter:
    """One OpenEnv-style environment instance as a polyrl :class:`~polyrl.protocols.Environment`.

    ``env``: the instance (one per trajectory, as the ``stepwise`` loop builds one adapter per episode).
    ``action`` / ``action_cls`` / ``observation`` / ``state_key``: see the module docstring.
    """

    def __init__(self, env: Any, *, action: Callable[[str], Any] | None = None, action_cls: type | None = None,
                 observation: Callable[[Any], str] | None = None,
                 state_key: Callable[[Any], Any] | None = None) -> None:
        for method in ("reset", "step"):
            if not callable(getattr(env, method, None)):
                raise TypeError(f"OpenEnvAdapter: {type(env).__name__} has no {method}() method; an OpenEnv-style "
                                "environment has reset(seed=, episode_id=) and step(action)")
        self.env = env
        self._observation = observation or observation_text
        self._state_key = state_key
        self._text = ""
        if action is not None:
            self._action = action
        else:
            cls = action_cls or _action_class_of(env)
            if cls is None:
                raise TypeError(f"OpenEnvAdapter: cannot tell the action class of {type(env).__name__} (no "
                                "Environment[ActT, ...] base): pass action_cls= or action=")
            self._action = self._builder(cls)
        asynchronous = inspect.iscoroutinefunction(env.reset) or inspect.iscoroutinefunction(env.step)
        # the stepwise loop awaits an async method and runs a plain one in a worker thread
        self.reset = self._reset_async if asynchronous else self._reset_sync  # type: ignore[method-assign]
        self.step = self._step_async if asynchronous else self._step_sync  # type: ignore[method-assign]

    @staticmethod
    def _builder(cls: type) -> Callable[[str], Any]:
        names = _action_fields(cls)

        def build(text: str) -> Any:
            stripped = text.strip()
            if stripped.startswith("{"):
                try:
                    values = json.loads(stripped)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"the action is not valid JSON for {cls.__name__}: {exc}") from None
                if not isinstance(values, dict):
                    raise ValueError(f"a JSON action for {cls.__name__} must be an object of its fields {names}")
                return cls(**values)
            if len(names) != 1:
                raise ValueError(f"{cls.__name__} has the fields {names}: write the action as a JSON object of them")
            return cls(**{names[0]: stripped})

        return build

    # -- results
    def _read(self, result: Any) -> tuple[str, float, bool, dict]:
        obs = getattr(result, "observation", result) if not isinstance(result, Mapping) else result
        reward = getattr(result, "reward", None)
        done = getattr(result, "done", None)
        fields = _fields(obs)
        reward = fields.get("reward") if reward is None else reward
        done = fields.get("done", False) if done is None else done
        info = dict(fields.get("metadata") or {})
        if "success" not in info and isinstance(getattr(result, "info", None), Mapping):
            info.update(result.info)
        self._text = str(self._observation(obs))
        return self._text, 0.0 if reward is None else float(reward), bool(done), info

    def _reset_args(self, seed: int, row: Any) -> dict[str, Any]:
        episode = (row or {}).get("uid") if isinstance(row, Mapping) else None
        return {"seed": int(seed), "episode_id": None if episode is None else str(episode)}

    # -- the Environment protocol (bound in __init__ to the sync or async pair)
    def _reset_sync(self, seed: int, row: Any) -> str:
        result = self.env.reset(**self._reset_args(seed, row))
        if inspect.isawaitable(result):
            raise TypeError(f"{type(self.env).__name__}.reset returned an awaitable from a plain method: declare it "
                            "async def")
        return self._read(result)[0]

    def _step_sync(self, action: str) -> tuple[str, float, bool, dict]:
        return self._read(self.env.step(self._action(action)))

    async def _reset_async(self, seed: int, row: Any) -> str:
        result = self.env.reset(**self._reset_args(seed, row))
        return self._read(await result if inspect.isawaitable(result) else result)[0]

    async def _step_async(self, action: str) -> tuple[str, float, bool, dict]:
        result = self.env.step(self._action(action))
        return self._read(await result if inspect.isawaitable(result) else result)

    def state_key(self) -> Any:
        """``state_key(env)`` when given, else the current observation's text."""
        return self._state_key(self.env) if self._state_key is not None else self._text


def openenv_factory(env_cls: Callable[..., Any], **adapter: Any) -> Callable[[Any], OpenEnvAdapter]:
    """A factory for ``register_environments``: ``register("my-env", openenv_factory(MyEnv))`` builds
    ``MyEnv(**env_kwargs)`` per trajectory, wrapped in an :class:`OpenEnvAdapter` (``adapter``: its keywords)."""

    def factory(config: Any) -> OpenEnvAdapter:
        return OpenEnvAdapter(env_cls(**dict(config or {})), **adapter)

    return factory


def make_openenv(config: Mapping[str, Any]) -> OpenEnvAdapter:
    """The built-in ``openenv`` environment: an OpenEnv-style class named in the row, no code of one's own.

    ``env_kwargs``: ``class`` (required, an import string ``pkg.mod:MyEnv``), ``kwargs`` (its constructor's
    keywords), ``action_class`` / ``action`` / ``observation`` / ``state_key`` (import strings, optional)."""
    from polyrl.registry import resolve_import_string

    config = dict(config or {})
    unknown = sorted(set(config) - {"class", "kwargs", "action_class", "action", "observation", "state_key"})
    if unknown:
        raise ValueError(f"openenv: unknown env_kwargs {unknown}; known: class, kwargs, action_class, action, "
                         "observation, state_key")
    if not config.get("class"):
        raise ValueError("openenv: env_kwargs.class is required: the environment's import string 'pkg.mod:MyEnv'")
    from polyrl.errors import RegistryError

    def resolve(name: str) -> Any:
        try:
            return resolve_import_string(str(config[name]))
        except RegistryError as exc:
            raise ValueError(f"openenv: env_kwargs.{name}: {exc}") from None

    env_cls = resolve("class")
    options = {key: resolve(name) for name, key in (("action_class", "action_cls"), ("action", "action"),
                                                    ("observation", "observation"), ("state_key", "state_key"))
               if config.get(name)}
    return OpenEnvAdapter(env_cls(**dict(config.get("kwargs") or {})), **options)
