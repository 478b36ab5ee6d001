"""The built-in environments: conformance, gridworld's rewards against its optimal policy, Sokoban's levels."""

from __future__ import annotations

import random

import pytest

from polyrl.environments.gridworld import GridWorld, make_gridworld, make_level, shortest_path
from polyrl.environments.sokoban import BOX_OFF, BOX_ON, SOLVED, STEP_REWARD, Sokoban, make_sokoban
from polyrl.environments.sokoban import make_level as make_sokoban_level
from polyrl.plugins import PluginManager
from polyrl.testing import EnvironmentConformance


class TestGridWorldConformance(EnvironmentConformance):
    actions = ["right", "down", "down", "right", "left", "up"]
    config = {"size": 4, "holes": 3}

    @pytest.fixture
    def environment_factory(self):
        return make_gridworld


class TestSokobanConformance(EnvironmentConformance):
    actions = ["up", "left", "down", "right", "right", "down"]
    config = {"height": 6, "width": 7, "boxes": 2}

    @pytest.fixture
    def environment_factory(self):
        return make_sokoban


def test_both_are_registered_in_the_core():
    registry = PluginManager(entry_points=False).registry("environment")
    assert registry.get("gridworld") is make_gridworld and registry.get("sokoban") is make_sokoban


@pytest.mark.parametrize("seed", range(25))
def test_gridworld_optimal_policy_reaches_the_goal_in_the_fewest_moves(seed):
    env = GridWorld(size=5, holes=6)
    env.reset(seed, {})
    plan = shortest_path(5, env.holes)
    assert plan is not None and len(plan) >= 8  # at least the Manhattan distance
    total = 0.0
    for t, move in enumerate(plan):
        _, reward, done, info = env.step(move)
        total += reward
        assert done == (t == len(plan) - 1), "the optimal path ends exactly at the goal"
    assert total == 1.0 and info["success"]


def test_gridworld_no_random_policy_beats_the_optimal_one():
    """Over many random action sequences, none reaches the goal in fewer moves than the optimal policy; a hole
    ends the episode with reward 0."""
    rng = random.Random(0)
    seed = 4
    best = len(shortest_path(4, make_level(4, 3, seed)))
    fell = 0
    for _ in range(400):
        env = GridWorld(4, 3)
        env.reset(seed, {})
        for t in range(12):
            _, reward, done, info = env.step(rng.choice(["up", "down", "left", "right"]))
            if done:
                if info["success"]:
                    assert reward == 1.0 and t + 1 >= best
                else:
                    assert reward == 0.0 and env.pos in env.holes
                    fell += 1
                break
    assert fell > 0


def test_gridworld_walls_keep_the_player_and_bad_kwargs_are_named():
    env = GridWorld(4, 0)
    env.reset(0, {})
    observation, reward, done, _ = env.step("up")
    assert env.pos == (0, 0) and observation.startswith("P") and (reward, done) == (0.0, False)
    with pytest.raises(ValueError, match="gridworld.*size, holes"):
        make_gridworld({"size": 4, "lakes": 2})
    with pytest.raises(ValueError, match="gridworld.*path"):
        make_level(3, 7, 0)


@pytest.mark.parametrize("seed", range(10))
def test_sokoban_levels_are_seeded_unsolved_and_solved_by_their_solution(seed):
    level = make_sokoban_level(7, 7, 2, seed)
    assert level == make_sokoban_level(7, 7, 2, seed)
    assert level.boxes != level.targets and len(level.boxes) == 2
    env = Sokoban(7, 7, 2)
    env.reset(seed, {})
    total, done = 0.0, False
    for move in level.solution:
        _, reward, done, info = env.step(move)
        total += reward
        if done:
            break
    assert done and info["success"] and info["boxes_on_target"] == 2
    assert total >= SOLVED + 2 * BOX_ON + STEP_REWARD * len(level.solution) - 2 * BOX_ON  # boxes may leave targets


def test_sokoban_rewards_follow_gym_sokoban():
    env = Sokoban(5, 6, 1)
    env.reset(0, {})
    # a hand-made state: the player left of a box, the box left of the target
    env.player, env.boxes = (2, 1), {(2, 2)}
    object.__setattr__(env.level, "targets", frozenset({(2, 3)}))
    _, reward, done, info = env.step("right")
    assert reward == pytest.approx(STEP_REWARD + BOX_ON + SOLVED) and done and info["success"]
    env.done = False
    _, reward, _, _ = env.step("right")  # pushed off its target
    assert reward == pytest.approx(STEP_REWARD + BOX_OFF)
    _, reward, _, _ = env.step("right")  # against the wall: nothing moves
    assert reward == pytest.approx(STEP_REWARD) and env.boxes == {(2, 4)}
