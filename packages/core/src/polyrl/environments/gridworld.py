"""``gridworld``: a FrozenLake-like game with a known optimal policy.

A seeded ``size x size`` lake: the player starts at the top-left corner, the goal is the bottom-right one, and
``holes`` cells are holes. Every level has a path (levels without one are drawn again). Moving into the goal ends
the episode with reward 1 (``success``); into a hole ends it with reward 0; off the edge leaves the player where
it was. :func:`shortest_path` is the optimal policy (the fewest moves to the goal), which tests check the rewards
against.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Mapping
from typing import Any

from polyrl.environments.grid import MOVES, read_move

Cell = tuple[int, int]


def make_level(size: int, holes: int, seed: int) -> frozenset[Cell]:
    """The holes of the level ``seed`` draws: ``holes`` cells (never the start or the goal) leaving a path."""
    if size < 2:
        raise ValueError(f"gridworld: size={size} must be at least 2")
    free = [(r, c) for r in range(size) for c in range(size) if (r, c) not in ((0, 0), (size - 1, size - 1))]
    if not 0 <= holes <= len(free) - (size - 1) * 2 + 1:
        raise ValueError(f"gridworld: holes={holes} does not leave a path on a {size}x{size} lake")
    rng = random.Random(seed)
    for _ in range(1000):
        level = frozenset(rng.sample(free, holes))
        if shortest_path(size, level) is not None:
            return level
    raise ValueError(f"gridworld: no level with a path found for size={size}, holes={holes}, seed={seed}")


def shortest_path(size: int, holes: frozenset[Cell], start: Cell = (0, 0)) -> list[str] | None:
    """The optimal policy from ``start``: the fewest moves to the goal (breadth-first), or None without a path."""
    goal = (size - 1, size - 1)
    came: dict[Cell, tuple[Cell, str] | None] = {start: None}
    queue = deque([start])
    while queue:
        cell = queue.popleft()
        if cell == goal:
            moves: list[str] = []
            while came[cell] is not None:
                cell, move = came[cell]  # type: ignore[misc]
                moves.append(move)
            return moves[::-1]
        for move, (dr, dc) in MOVES.items():
            nxt = (cell[0] + dr, cell[1] + dc)
            if 0 <= nxt[0] < size and 0 <= nxt[1] < size and nxt not in holes and nxt not in came:
                came[nxt] = (cell, move)
                queue.append(nxt)
    return None


class GridWorld:
    """The ``gridworld`` environment (see the module docstring); ``config``: ``size`` (4), ``holes`` (3)."""

    def __init__(self, size: int = 4, holes: int = 3) -> None:
        self.size, self.n_holes = int(size), int(holes)
        self.holes: frozenset[Cell] = frozenset()
        self.pos: Cell = (0, 0)
        self.done = True

    def reset(self, seed: int, row: Mapping[str, Any]) -> str:
        self.holes = make_level(self.size, self.n_holes, int(seed))
        self.pos, self.done = (0, 0), False
        return self.render()

    def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        if self.done:
            raise ValueError("gridworld: step() after the episode ended; call reset()")
        dr, dc = read_move(action, "gridworld")
        r, c = self.pos[0] + dr, self.pos[1] + dc
        if 0 <= r < self.size and 0 <= c < self.size:
            self.pos = (r, c)
        goal = self.pos == (self.size - 1, self.size - 1)
        self.done = goal or self.pos in self.holes
        return self.render(), float(goal), self.done, {"success": goal}

    def state_key(self) -> Cell:
        """The player's cell: the level is the same for every trajectory of a row (one seed)."""
        return self.pos

    def render(self) -> str:
        """The lake as text: ``P`` the player, ``G`` the goal, ``O`` a hole, ``.`` ice."""
        lines = []
        for r in range(self.size):
            cells = []
            for c in range(self.size):
                cell = (r, c)
                cells.append("P" if cell == self.pos else "O" if cell in self.holes
                             else "G" if cell == (self.size - 1, self.size - 1) else ".")
            lines.append("".join(cells))
        return "\n".join(lines)


def make_gridworld(config: Mapping[str, Any] | None = None) -> GridWorld:
    """The factory ``register_environments`` names: ``config`` is the row's ``extra_info.env_kwargs``."""
    options = dict(config or {})
    unknown = sorted(set(options) - {"size", "holes"})
    if unknown:
        raise ValueError(f"gridworld: unknown env_kwargs {unknown}; it takes size, holes")
    return GridWorld(size=int(options.get("size", 4)), holes=int(options.get("holes", 3)))
