"""``stepwise``: an agent that plays an environment, each step its own training sample (verl-agent's rollouts).

One episode for one dataset row: the row's ``extra_info.env`` names a registered environment
(:class:`polyrl.protocols.Environment`), built once per trajectory from ``extra_info.env_kwargs`` and reset with
``extra_info.seed`` (every sample of a row starts from the same state: GRPO's and GiGPO's episode group). Each step:

1. a **history policy** builds the step's prompt afresh from the row's ``prompt`` messages (the task), the
   earlier (observation, model text) pairs it keeps, and the current observation; the chat template renders it;
2. the model generates one turn; the **action** is read from its text (the last ``<action>...</action>``, or the
   pattern of ``extra_info.action_pattern``) and passed to ``env.step``;
3. the step becomes one :class:`~polyrl.protocols.AgentLoopOutput`: that prompt, the sampled tokens (all trained:
   ``response_mask`` 1, token for token what was sampled), linked to its episode by the extras ``episode_id``,
   ``step_index`` and ``anchor_key`` (GiGPO's step groups), with ``step_rewards`` (this step's reward).

The episode ends when the environment says ``done``, after ``max_steps`` (``extra_info.max_steps``, else
``agent.max_turns``), or at a malformed action (no action in the text, or one the environment rejects with
``ValueError``). An environment that raises, outlasts ``extra_info.env_timeout_s`` (else ``agent.tool_timeout_s``),
returns a non-finite reward, or a state key that cannot be hashed ends (or, for the key, only marks) the episode
with one warning naming the environment and the row; each is counted (``env/*`` metrics), never a crash.

Rewards: every step row carries the episode's return as its tool reward (``agent.tool_reward=sum`` folds it in at
the last token, as verl-agent puts the episode reward on each step), so ``grpo`` compares episodes and ``gigpo``
adds the step advantage from ``step_rewards``. docs/environments.md has the whole picture.
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import logging
import math
import re
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from polyrl.agent_loops.history import Turn, last_k_history, summary_history, transcript_history
from polyrl.errors import DataError
from polyrl.protocols import AgentLoopOutput, GenerationClient, GenerationRequest, GenerationResult, SamplingParams
from polyrl.tools.function import ToolThreads

logger = logging.getLogger(__name__)

__all__ = ["ENV_EXECUTOR", "HISTORY_POLICIES", "EPISODE_COUNTS", "StepwiseAgentLoop", "Turn", "anchor_id",
           "last_k_history", "parse_action", "summary_history", "transcript_history"]

#: A history policy: ``(task messages, earlier turns, current observation, k) -> the step's chat messages``; each
#: turn is a :class:`~polyrl.agent_loops.history.Turn` (it unpacks as the pair ``(observation, model text)``).
HistoryPolicy = Callable[[Sequence[Mapping[str, Any]], Sequence[tuple[str, str]], str, int], list[dict]]

#: Threads synchronous environments run in (a hung one is abandoned and counted, as for tools).
ENV_EXECUTOR = ToolThreads(name="polyrl-env")

#: Per-episode counts each episode's last row carries (``env/<name>`` metrics are their totals).
EPISODE_COUNTS = ("malformed_actions", "env_errors", "env_timeouts", "nonfinite_rewards", "unhashable_anchors",
                  "prompt_too_long")

DEFAULT_ACTION_PATTERN = r"<action>(.*?)</action>"


#: ``extra_info.history`` names one of these, or an import string ``"package.module:function"``.
HISTORY_POLICIES: dict[str, HistoryPolicy] = {"last_k": last_k_history, "transcript": transcript_history,
                                               "summary": summary_history}


def parse_action(text: str, pattern: str | None = DEFAULT_ACTION_PATTERN) -> str | None:
    """The action in a model's turn: the first group of the last match of ``pattern`` (stripped), or the whole
    stripped text when ``pattern`` is empty; None when there is none (a malformed action)."""
    if not pattern:
        action = text.strip()
        return action or None
    matches = re.findall(pattern, text, flags=re.S)
    if not matches:
        return None
    last = matches[-1]
    action = (last[0] if isinstance(last, tuple) else last).strip()
    return action or None


def anchor_id(key: Any) -> int:
    """A stable signed 64-bit id of a hashable state key (from its ``repr``: build keys from str, int, tuples)."""
    digest = hashlib.blake2b(repr(key).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


@dataclass
class _Step:
    prompt_ids: list[int]
    result: GenerationResult
    anchor: int
    reward: float = 0.0


@dataclass
class _Episode:
    env_name: str
    uid: str
    steps: list[_Step] = field(default_factory=list)
    counts: dict[str, float] = field(default_factory=lambda: dict.fromkeys(EPISODE_COUNTS, 0.0))
    success: bool = False
    end: str = "max_steps"

    def count(self, what: str, message: str) -> None:
        self.counts[what] += 1
        logger.warning("stepwise: environment '%s', row uid %s: %s", self.env_name, self.uid, message)


class StepwiseAgentLoop:
    """The step-wise environment loop (see the module docstring and docs/environments.md).

    ``config`` is the run's ``agent`` block: ``max_turns`` is the default ``max_steps``, ``max_new_tokens_per_turn``
    caps each step's generation (0: ``sampling_params.max_new_tokens``), ``tool_timeout_s`` is the default
    deadline of each environment call. ``max_prompt_length`` (the worker passes ``data.max_prompt_length``): a step
    prompt longer than it ends the episode (counted), or raises :class:`~polyrl.errors.DataError` on the first step.
    ``environments`` maps names to factories (default: the ``environment`` registry of the process's plugins).
    """

    def __init__(self, *, tokenizer: Any, config: Any = None, tools: Any = None, max_prompt_length: int | None = None,
                 environments: Mapping[str, Callable[[Any], Any]] | None = None) -> None:
        from polyrl.config.schema import AgentConfig

        self.tokenizer = tokenizer
        self.config = config if config is not None else AgentConfig()
        self.max_prompt_length = max_prompt_length
        self._environments = dict(environments) if environments is not None else None

    # ------------------------------------------------------------------ set-up
    def environment_factory(self, name: str, sample: Mapping[str, Any]) -> Callable[[Any], Any]:
        """The factory registered as ``name``; a :class:`DataError` naming the row for an unknown one."""
        if self._environments is not None:
            if name not in self._environments:
                raise DataError(f"stepwise: row uid {sample.get('uid')} asks for environment '{name}'; known: "
                                f"{', '.join(sorted(self._environments))}")
            return self._environments[name]
        from polyrl.errors import RegistryError
        from polyrl.plugins import get_plugin_manager

        try:
            return get_plugin_manager().get("environment", name)
        except RegistryError as exc:
            raise DataError(f"stepwise: row uid {sample.get('uid')}: extra_info.env: {exc}") from None

    def history_policy(self, name: str) -> HistoryPolicy:
        """``last_k``, ``transcript``, ``summary``, or a function named by an import string ``"pkg.mod:fn"``."""
        if name in HISTORY_POLICIES:
            return HISTORY_POLICIES[name]
        if ":" in name:
            from polyrl.registry import resolve_import_string

            return resolve_import_string(name)
        raise DataError(f"stepwise: extra_info.history={name!r}: choose {', '.join(HISTORY_POLICIES)} or an import "
                        "string 'package.module:function'")

    def render(self, messages: list[dict]) -> list[int]:
        """The step's prompt ids: the chat template over ``messages`` with the generation prompt."""
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)

    # ------------------------------------------------------------------ the loop
    async def run(self, sample: Mapping[str, Any], sampling_params: SamplingParams,
                  client: GenerationClient) -> list[AgentLoopOutput]:
        """One episode for ``sample``: one output per step (at least one)."""
        info = dict(sample.get("extra_info") or {})
        name = info.get("env")
        if not name:
            raise DataError(f"stepwise: row uid {sample.get('uid')} has no extra_info.env (the environment's name)")
        factory = self.environment_factory(str(name), sample)
        try:
            env = factory(dict(info.get("env_kwargs") or {}))
        except (TypeError, ValueError) as exc:
            raise DataError(f"stepwise: row uid {sample.get('uid')}: environment '{name}' rejects extra_info.env_kwargs "
                            f"{info.get('env_kwargs')}: {exc}") from exc
        max_steps = int(info.get("max_steps") or self.config.max_turns)
        policy = self.history_policy(str(info.get("history", "last_k")))
        k = int(info.get("history_k", 2))
        pattern = info.get("action_pattern", DEFAULT_ACTION_PATTERN)
        timeout = float(info.get("env_timeout_s") or self.config.tool_timeout_s)
        task = _task_messages(sample)
        episode = _Episode(str(name), str(sample.get("uid", "")))

        try:
            observation = str(await _call(env.reset, int(info.get("seed", 0)), sample, timeout=timeout, name=name))
        except Exception as exc:
            return [self._no_step(episode, task, exc)]
        anchor = self._anchor(env, observation, episode)
        turns: list[Turn] = []
        budget = sampling_params.max_new_tokens
        per_step = min(budget, self.config.max_new_tokens_per_turn or budget)
        for t in range(max_steps):
            prompt_ids = self.render(policy(task, turns, observation, k))
            limit = self.max_prompt_length
            if limit and len(prompt_ids) > limit:
                if t == 0:
                    raise DataError(f"stepwise: row uid {episode.uid}: the first step's prompt is {len(prompt_ids)} "
                                    f"tokens, longer than data.max_prompt_length={limit}; raise it or shorten the task")
                episode.count("prompt_too_long", f"step {t}'s prompt is {len(prompt_ids)} tokens, longer than "
                              f"data.max_prompt_length={limit}: the episode ends (a shorter history: history_k)")
                episode.end = "prompt_too_long"
                break
            params = sampling_params.replace(n=1, max_new_tokens=per_step, seed=_step_seed(sampling_params.seed, t))
            (result,) = await client.agenerate(GenerationRequest(prompt_ids=prompt_ids, sampling_params=params,
                                                                 request_id=f"{episode.uid}/step{t}"))
            step = _Step(prompt_ids, result, anchor)
            answered = observation
            episode.steps.append(step)
            text = self.tokenizer.decode(list(result.response_ids), skip_special_tokens=True)
            action = parse_action(text, pattern)
            if action is None:
                episode.count("malformed_actions", f"step {t}: no action in the model's text {text[:80]!r}")
                episode.end = "malformed"
                break
            try:
                observation, reward, done, step_info = await _call(env.step, action, timeout=timeout, name=name)
            except ValueError as exc:
                episode.count("malformed_actions", f"step {t}: the environment rejects action {action[:40]!r}: {exc}")
                episode.end = "malformed"
                break
            except Exception as exc:
                self._env_failed(episode, t, exc, timeout)
                break
            reward = float(reward)
            if not math.isfinite(reward):
                episode.count("nonfinite_rewards", f"step {t}: reward {reward} is not finite; counted as 0 and the "
                              "episode ends")
                episode.end = "env_error"
                break
            step.reward = reward
            episode.success = episode.success or bool((step_info or {}).get("success", False))
            observation = str(observation)
            turns.append(Turn(answered, text.strip(), action, reward, observation))
            if done:
                episode.end = "done"
                break
            anchor = self._anchor(env, observation, episode)
        return self._outputs(episode)

    # ------------------------------------------------------------------ pieces
    def _anchor(self, env: Any, observation: str, episode: _Episode) -> int:
        """The id of the current state's key (``env.state_key()``, else the observation); a key that cannot be
        hashed is counted and gets an id of its own (a step group of one)."""
        try:
            key = env.state_key() if callable(getattr(env, "state_key", None)) else observation
            hash(key)
        except Exception as exc:
            episode.count("unhashable_anchors", f"the state key cannot be hashed ({type(exc).__name__}: {exc}); this "
                          "step is a step group of its own")
            return anchor_id(uuid.uuid4().hex)
        return anchor_id(key)

    def _env_failed(self, episode: _Episode, t: int, exc: BaseException, timeout: float) -> None:
        if isinstance(exc, TimeoutError):
            episode.count("env_timeouts", f"step {t}: the environment did not answer within {timeout:g} s "
                          "(extra_info.env_timeout_s); the episode ends")
        else:
            episode.count("env_errors", f"step {t}: the environment raised {type(exc).__name__}: {exc}; the episode ends")
        episode.end = "env_error"

    def _no_step(self, episode: _Episode, task: list[dict], exc: BaseException) -> AgentLoopOutput:
        """The one row of an episode whose ``reset`` failed: nothing trained (``response_mask`` 0), counted."""
        if isinstance(exc, TimeoutError):
            episode.count("env_timeouts", "reset() did not answer within the deadline; the episode has no step")
            episode.end = "env_error"
        else:
            self._env_failed(episode, 0, exc, 0.0)
        eos = self.tokenizer.eos_token_id if self.tokenizer.eos_token_id is not None else 0
        out = AgentLoopOutput(prompt_ids=self.render(last_k_history(task, [], "", 0)), response_ids=[eos],
                              response_mask=[0], log_probs=[0.0], num_turns=0, finish_reason="env_error",
                              metrics={"tool_reward": 0.0})
        out.extra = self._extra(episode, 0, anchor_id(uuid.uuid4().hex), 0.0, last=True, episode_id=_new_id())
        return out

    def _outputs(self, episode: _Episode) -> list[AgentLoopOutput]:
        total = float(sum(s.reward for s in episode.steps))
        eid = _new_id()
        outs = []
        for t, step in enumerate(episode.steps):
            r = step.result
            ids = list(r.response_ids)
            out = AgentLoopOutput(prompt_ids=list(step.prompt_ids), response_ids=ids, response_mask=[1] * len(ids),
                                  log_probs=list(r.log_probs) or [0.0] * len(ids), num_turns=1,
                                  finish_reason=r.finish_reason,
                                  metrics={"tool_reward": total, "turns": 1.0,
                                           "parse_errors": episode.counts["malformed_actions"]
                                           if t == len(episode.steps) - 1 else 0.0})
            out.extra = self._extra(episode, t, step.anchor, step.reward, last=t == len(episode.steps) - 1,
                                    episode_id=eid)
            outs.append(out)
        return outs

    def _extra(self, episode: _Episode, t: int, anchor: int, reward: float, *, last: bool,
               episode_id: int) -> dict[str, Any]:
        per_episode = {name: (value if last else 0.0) for name, value in episode.counts.items()}
        return {"episode_id": torch.tensor(episode_id, dtype=torch.long),
                "step_index": torch.tensor(t, dtype=torch.long),
                "anchor_key": torch.tensor(anchor, dtype=torch.long),
                "step_rewards": float(reward),
                "episode_end": float(last),
                "episode_success": float(episode.success and last),
                "episode_steps": float(len(episode.steps) if last else 0),
                **per_episode}


def _task_messages(sample: Mapping[str, Any]) -> list[dict]:
    prompt = sample.get("prompt")
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    return [dict(m) for m in (prompt or [])]


def _new_id() -> int:
    return int.from_bytes(uuid.uuid4().bytes[:8], "little", signed=True)


def _step_seed(seed: int | None, step: int) -> int | None:
    """A seeded run's seed for step ``step`` (each step its own random stream)."""
    return seed if seed is None or step == 0 else (seed * 1_000_003 + step) % 2**31


async def _call(fn: Callable[..., Any], *args: Any, timeout: float, name: Any) -> Any:
    """``fn(*args)`` under ``timeout`` seconds: awaited when it is a coroutine function, else in an
    :data:`ENV_EXECUTOR` thread (abandoned, and counted as hung, when it outlasts the deadline)."""
    if inspect.iscoroutinefunction(fn):
        return await asyncio.wait_for(fn(*args), timeout)
    future = ENV_EXECUTOR.submit(fn, *args)
    try:
        return await asyncio.wait_for(asyncio.wrap_future(future), timeout)
    except (TimeoutError, asyncio.CancelledError):
        ENV_EXECUTOR.abandon(future, f"environment {name}")
        raise
