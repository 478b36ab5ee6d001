"""History policies of the ``stepwise`` loop: how each step's prompt is built from the episode so far.

A policy is ``(task messages, earlier turns, current observation, k) -> the step's chat messages``. Each earlier
turn is a :class:`Turn`: it unpacks as ``(observation, model text)`` (all a ``last_k``-style policy needs) and also
carries the action read from the text, the step's reward and the observation that followed.

- ``last_k``: the task, the last ``k`` turns as user / assistant messages, the current observation;
- ``transcript``: every turn (the prompt grows with the episode);
- ``summary``: the task, then one user message with a bounded memory of the whole episode (steps, total reward,
  how many distinct observations were seen and how often the current one was, the actions that changed nothing,
  the last ``k`` actions and their rewards) followed by the current observation. Its length does not grow with
  the episode: at most ``k + 4`` memory lines, each action cut to :data:`ACTION_CHARS` characters.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["ACTION_CHARS", "STALE_ACTIONS", "Turn", "last_k_history", "summary_history", "summary_memory",
           "transcript_history"]

#: Characters of an action the ``summary`` memory keeps.
ACTION_CHARS = 40
#: Distinct actions that changed nothing the ``summary`` memory lists (the most recent ones).
STALE_ACTIONS = 4


class Turn(tuple):
    """One earlier step of an episode. Unpacks (and compares) as ``(observation, text)``: the observation the
    model answered and its text (stripped); ``action`` is the action read from the text, ``reward`` the step's
    reward, ``next_observation`` the observation the step returned."""

    observation: str
    text: str
    action: str
    reward: float
    next_observation: str

    def __new__(cls, observation: str, text: str, action: str = "", reward: float = 0.0,
                next_observation: str = "") -> Turn:
        self = super().__new__(cls, (observation, text))
        self.observation, self.text = observation, text
        self.action, self.reward, self.next_observation = action, float(reward), next_observation
        return self


def last_k_history(task: Sequence[Mapping[str, Any]], turns: Sequence[tuple[str, str]], observation: str,
                   k: int) -> list[dict]:
    """The task messages, the last ``k`` (observation, model text) pairs as user / assistant messages, then the
    current observation as the last user message."""
    messages = [dict(m) for m in task]
    for obs, text in (list(turns)[-k:] if k > 0 else []):
        messages += [{"role": "user", "content": obs}, {"role": "assistant", "content": text}]
    messages.append({"role": "user", "content": observation})
    return messages


def transcript_history(task: Sequence[Mapping[str, Any]], turns: Sequence[tuple[str, str]], observation: str,
                       k: int) -> list[dict]:
    """The whole episode so far (``k`` is ignored): the prompt grows with every step."""
    return last_k_history(task, turns, observation, len(turns))


def _short(action: str) -> str:
    action = " ".join(action.split())
    return action if len(action) <= ACTION_CHARS else action[: ACTION_CHARS - 3] + "..."


def _number(x: float) -> str:
    return f"{x:g}"


def summary_memory(turns: Sequence[tuple[str, str]], observation: str, k: int) -> list[str]:
    """The ``summary`` policy's memory lines of the episode so far (empty before the first step): at most
    ``k + 4`` lines whatever the episode's length. Turns that are plain pairs (no :class:`Turn`) have no action,
    reward or next observation; their memory counts only steps and observations."""
    if not turns:
        return []
    steps = [t if isinstance(t, Turn) else Turn(t[0], t[1]) for t in turns]
    total = sum(t.reward for t in steps)
    lines = [f"Steps so far: {len(steps)}; total reward {_number(total)}."]
    seen = [t.observation for t in steps]
    before = seen.count(observation)
    lines.append(f"Distinct observations seen: {len(set(seen + [observation]))}; the current one "
                 + (f"{before} time{'s' if before != 1 else ''} before." if before else "is new."))
    stale: list[str] = []
    for t in reversed(steps):  # the most recent first
        if t.action and t.next_observation == t.observation and _short(t.action) not in stale:
            stale.append(_short(t.action))
    if stale:
        lines.append("Actions that changed nothing: " + ", ".join(stale[:STALE_ACTIONS]) + ".")
    recent = steps[-k:] if k > 0 else []
    if recent:
        lines.append("Last actions:")
        first = len(steps) - len(recent)
        for i, t in enumerate(recent):
            lines.append(f"- step {first + i + 1}: {_short(t.action) or '(none)'} -> reward {_number(t.reward)}")
    return lines


def summary_history(task: Sequence[Mapping[str, Any]], turns: Sequence[tuple[str, str]], observation: str,
                    k: int) -> list[dict]:
    """The task messages, then one user message: the episode's memory (:func:`summary_memory`) and the current
    observation. On the first step (no memory yet) the observation alone, as ``last_k``."""
    messages = [dict(m) for m in task]
    memory = summary_memory(turns, observation, k)
    if not memory:
        messages.append({"role": "user", "content": observation})
        return messages
    content = "Memory of this episode:\n" + "\n".join(memory) + "\n\nCurrent observation:\n" + observation
    messages.append({"role": "user", "content": content})
    return messages
