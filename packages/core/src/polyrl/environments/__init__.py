"""Environments the ``stepwise`` agent loop plays (:class:`polyrl.protocols.Environment`), registered through
``register_environments``: ``gridworld`` and ``sokoban`` are built in (docs/environments.md)."""

from __future__ import annotations

from typing import Any

__all__ = ["environment_score"]


def environment_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> float:
    """The reward function of ``env/*`` rows: 0. Their reward is what the environment returned, which the
    ``stepwise`` loop hands over as the sample's tool reward (folded in by ``agent.tool_reward=sum``)."""
    return 0.0
