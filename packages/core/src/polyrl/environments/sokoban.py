"""``sokoban``: push every box onto a target, on seeded generated levels.

A level is a ``height x width`` room (walls around it) with ``boxes`` boxes. It is made backwards, the way
gym-sokoban makes its levels: boxes start on their targets and the player walks ``pulls`` random moves, pulling a
box behind it now and then; the reverse of that walk pushes every box back, so every level can be solved (and
:func:`make_level` returns that solution). Rewards are gym-sokoban's: -0.1 a move, +1 for a box pushed onto a
target, -1 for one pushed off, +10 when the last box reaches its target (the episode ends, ``success``).

Observations use the usual text notation: ``#`` wall, ``_`` floor, ``.`` target, ``$`` box, ``*`` box on a
target, ``@`` the player, ``+`` the player on a target.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from polyrl.environments.grid import MOVES, read_move

Cell = tuple[int, int]
STEP_REWARD, BOX_ON, BOX_OFF, SOLVED = -0.1, 1.0, -1.0, 10.0
_OPPOSITE = {"up": "down", "down": "up", "left": "right", "right": "left"}


@dataclass(frozen=True)
class Level:
    """A generated level: its size, targets, the boxes' and the player's start, and one solution."""

    height: int
    width: int
    targets: frozenset[Cell]
    boxes: frozenset[Cell]
    player: Cell
    solution: tuple[str, ...]

    def is_wall(self, cell: Cell) -> bool:
        return not (0 < cell[0] < self.height - 1 and 0 < cell[1] < self.width - 1)


def make_level(height: int, width: int, boxes: int, seed: int, pulls: int | None = None) -> Level:
    """The level ``seed`` draws (see the module docstring); ``pulls`` random backward moves (default
    ``4 * (height + width)``)."""
    inner = [(r, c) for r in range(1, height - 1) for c in range(1, width - 1)]
    if boxes < 1 or len(inner) < boxes + 2:
        raise ValueError(f"sokoban: a {height}x{width} room has no space for {boxes} boxes and a player")
    rng = random.Random(seed)
    walk = pulls if pulls is not None else 4 * (height + width)
    for _ in range(100):
        targets = frozenset(rng.sample(inner, boxes))
        placed = set(targets)
        player = rng.choice([c for c in inner if c not in placed])
        moves: list[str] = []
        for _ in range(walk):
            name = rng.choice(list(MOVES))
            dr, dc = MOVES[name]
            ahead, behind = (player[0] + dr, player[1] + dc), (player[0] - dr, player[1] - dc)
            if ahead not in inner or ahead in placed:
                continue
            if behind in placed and rng.random() < 0.7:  # pull the box behind into the player's cell
                placed.remove(behind)
                placed.add(player)
            player = ahead
            moves.append(name)
        if placed != targets:
            solution = tuple(_OPPOSITE[m] for m in reversed(moves))
            return Level(height, width, targets, frozenset(placed), player, solution)
    raise ValueError(f"sokoban: no unsolved level drawn for {height}x{width}, boxes={boxes}, seed={seed}")


class Sokoban:
    """The ``sokoban`` environment; ``config``: ``height`` (6), ``width`` (6), ``boxes`` (1), ``pulls``."""

    def __init__(self, height: int = 6, width: int = 6, boxes: int = 1, pulls: int | None = None) -> None:
        self.height, self.width, self.n_boxes, self.pulls = int(height), int(width), int(boxes), pulls
        self.level: Level | None = None
        self.boxes: set[Cell] = set()
        self.player: Cell = (0, 0)
        self.done = True

    def reset(self, seed: int, row: Mapping[str, Any]) -> str:
        self.level = make_level(self.height, self.width, self.n_boxes, int(seed), self.pulls)
        self.boxes, self.player, self.done = set(self.level.boxes), self.level.player, False
        return self.render()

    def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        level = self.level
        if level is None or self.done:
            raise ValueError("sokoban: step() before reset() or after the episode ended")
        dr, dc = read_move(action, "sokoban")
        ahead = (self.player[0] + dr, self.player[1] + dc)
        reward = STEP_REWARD
        if not level.is_wall(ahead):
            if ahead in self.boxes:
                beyond = (ahead[0] + dr, ahead[1] + dc)
                if not level.is_wall(beyond) and beyond not in self.boxes:
                    self.boxes.remove(ahead)
                    self.boxes.add(beyond)
                    reward += (BOX_ON if beyond in level.targets else 0.0) + (BOX_OFF if ahead in level.targets
                                                                              else 0.0)
                    self.player = ahead
            else:
                self.player = ahead
        solved = self.boxes == set(level.targets)
        if solved:
            reward += SOLVED
        self.done = solved
        return self.render(), reward, solved, {"success": solved, "boxes_on_target": len(self.boxes & level.targets)}

    def state_key(self) -> tuple[Cell, tuple[Cell, ...]]:
        """The player's cell and the boxes' cells (the walls and targets are the row's, one seed)."""
        return self.player, tuple(sorted(self.boxes))

    def render(self) -> str:
        """The room in the notation of the module docstring."""
        level = self.level
        assert level is not None
        lines = []
        for r in range(self.height):
            line = []
            for c in range(self.width):
                cell = (r, c)
                target = cell in level.targets
                if level.is_wall(cell):
                    line.append("#")
                elif cell == self.player:
                    line.append("+" if target else "@")
                elif cell in self.boxes:
                    line.append("*" if target else "$")
                else:
                    line.append("." if target else "_")
            lines.append("".join(line))
        return "\n".join(lines)


def make_sokoban(config: Mapping[str, Any] | None = None) -> Sokoban:
    """The factory ``register_environments`` names: ``config`` is the row's ``extra_info.env_kwargs``."""
    options = dict(config or {})
    unknown = sorted(set(options) - {"height", "width", "boxes", "pulls"})
    if unknown:
        raise ValueError(f"sokoban: unknown env_kwargs {unknown}; it takes height, width, boxes, pulls")
    pulls = options.get("pulls")
    return Sokoban(height=int(options.get("height", 6)), width=int(options.get("width", 6)),
                   boxes=int(options.get("boxes", 1)), pulls=None if pulls is None else int(pulls))
