"""Conformance suite for environments (:class:`polyrl.protocols.Environment`, kind ``environment``).

Subclass it, provide an ``environment_factory`` fixture (what ``register_environments`` registers: ``(config) ->
Environment``) and list a few of the environment's valid ``actions``; ``invalid_action`` is text it must reject
with ``ValueError`` (``None``: it accepts any text)::

    class TestMyEnv(EnvironmentConformance):
        actions = ["up", "down", "left", "right"]

        @pytest.fixture
        def environment_factory(self):
            return make_my_env

Either method of the environment may be ``async def``; the suite awaits what returns a coroutine.
"""

from __future__ import annotations

import asyncio
import inspect
import math
from collections.abc import Hashable
from typing import Any

import pytest


def call(fn: Any, *args: Any) -> Any:
    """``fn(*args)``, run to completion when it returns a coroutine (as the ``stepwise`` loop does)."""
    value = fn(*args)
    if not inspect.isawaitable(value):
        return value

    async def wait() -> Any:
        return await value

    return asyncio.run(wait())


class EnvironmentConformance:
    """What every environment promises: seeded resets, ``(observation, reward, done, info)`` steps, one instance
    per trajectory, a hashable state key, and ``ValueError`` for an action it cannot take."""

    #: Valid actions, played in turn by the suite (at least one).
    actions: list[str] = []
    #: Text the environment must reject with ``ValueError`` (``None`` when it accepts any text).
    invalid_action: str | None = "this is not an action"
    #: The ``config`` the factory gets (the row's ``extra_info.env_kwargs``).
    config: dict[str, Any] = {}
    #: Seeds the suite resets with.
    seeds: tuple[int, ...] = (0, 1, 7)
    #: Steps the suite plays at most per episode.
    max_steps: int = 12

    def _new(self, environment_factory: Any) -> Any:
        return environment_factory(dict(self.config))

    def _reset(self, env: Any, seed: int) -> str:
        return call(env.reset, seed, {"uid": "conformance", "extra_info": {"seed": seed}})

    def _play(self, env: Any, seed: int) -> list[tuple[str, float, bool, dict]]:
        self._reset(env, seed)
        out = []
        for t in range(self.max_steps):
            result = call(env.step, self.actions[t % len(self.actions)])
            out.append(result)
            if result[2]:
                break
        return out

    def test_lists_valid_actions(self):
        assert self.actions, f"{type(self).__name__}.actions must list at least one valid action"

    def test_reset_returns_text_and_the_same_seed_the_same_state(self, environment_factory):
        for seed in self.seeds:
            a, b = self._new(environment_factory), self._new(environment_factory)
            first = self._reset(a, seed)
            assert isinstance(first, str) and first, "reset() must return the first observation as non-empty text"
            assert self._reset(b, seed) == first, f"two instances reset with seed {seed} must start alike"
            assert self._reset(a, seed) == first, "reset() again with the same seed must start from the same state"

    def test_step_returns_observation_reward_done_info(self, environment_factory):
        env = self._new(environment_factory)
        for observation, reward, done, info in self._play(env, self.seeds[0]):
            assert isinstance(observation, str)
            assert isinstance(reward, (int, float)) and not isinstance(reward, bool) and math.isfinite(reward)
            assert isinstance(done, bool)
            assert isinstance(info, dict)
            if "success" in info:
                assert isinstance(info["success"], bool)

    def test_playing_is_deterministic_for_a_seed(self, environment_factory):
        for seed in self.seeds:
            assert self._play(self._new(environment_factory), seed) == self._play(self._new(environment_factory), seed)

    def test_instances_share_no_state(self, environment_factory):
        a, b = self._new(environment_factory), self._new(environment_factory)
        before = self._reset(b, self.seeds[0])
        self._reset(a, self.seeds[0])
        call(a.step, self.actions[0])
        # b has not moved: its next step from the start equals a fresh instance's first step
        fresh = self._new(environment_factory)
        self._reset(fresh, self.seeds[0])
        assert call(b.step, self.actions[0]) == call(fresh.step, self.actions[0]), before

    def test_invalid_action_raises_value_error(self, environment_factory):
        if self.invalid_action is None:
            pytest.skip("this environment accepts any text as an action")
        env = self._new(environment_factory)
        self._reset(env, self.seeds[0])
        with pytest.raises(ValueError):
            call(env.step, self.invalid_action)

    def test_state_key_is_hashable_and_follows_the_state(self, environment_factory):
        env = self._new(environment_factory)
        if not callable(getattr(env, "state_key", None)):
            pytest.skip("no state_key(): the observation text is the anchor state's key")
        other = self._new(environment_factory)
        self._reset(env, self.seeds[0])
        self._reset(other, self.seeds[0])
        key = env.state_key()
        assert isinstance(key, Hashable) and hash(key) == hash(other.state_key()) and key == other.state_key()
        repr_ok = repr(key)
        assert "object at 0x" not in repr_ok, "build state keys from str, int and tuples: GiGPO hashes their repr"
