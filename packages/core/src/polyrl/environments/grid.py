"""What the built-in grid games share: the four moves and how a move is read from an action."""

from __future__ import annotations

#: action word -> (row, column) offset
MOVES: dict[str, tuple[int, int]] = {"up": (-1, 0), "down": (1, 0), "left": (0, -1), "right": (0, 1)}


def read_move(action: str, game: str) -> tuple[int, int]:
    """The offset of ``action`` (``up``/``down``/``left``/``right``, any case, surrounding blanks ignored);
    ``ValueError`` naming ``game`` and the accepted words for anything else."""
    word = action.strip().lower()
    if word not in MOVES:
        raise ValueError(f"{game}: action {action[:40]!r} is not one of {', '.join(MOVES)}")
    return MOVES[word]
