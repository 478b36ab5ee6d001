"""The ``openai_agent`` loop: train an agent program written against the OpenAI API, unchanged.

For each sample, the loop opens a trajectory on this process's local endpoint
(:mod:`polyrl.agent_loops.openai_proxy`: ``127.0.0.1``, a free port, started once and reused) and calls the
user's program ``run(client_kwargs, row)`` in a thread of its own, with ``client_kwargs = {"base_url": ...,
"api_key": <this trajectory's key>}`` and a wall-clock deadline (``agent.openai_agent.timeout_s``). Every chat
completion the program makes is sampled by the run's rollout and recorded as token ids with their log-probs;
when the program returns (its reward), the episode becomes the sample trained on: the longest chain of calls
in which each call continued the one before token for token (``merged``), the tokens between the model's
turns (tool results, user messages, template text) masked out. See docs/agents.md, "Agent programs".
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import inspect
import logging
import math
import numbers
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from polyrl.agent_loops.openai_proxy import Call, Trajectory, get_proxy
from polyrl.errors import ConfigError
from polyrl.protocols import AgentLoopOutput, GenerationClient, SamplingParams

logger = logging.getLogger("polyrl")

__all__ = ["Episode", "OpenAIAgentLoop", "compute_score", "episode_samples", "hung_programs", "load_program", "trained_chain"]

#: What an episode can end as, besides ``ok``: each is counted in ``agent/program_<status>/total``.
FAILURES = ("raised", "timeouts", "no_calls", "bad_reward")

_HUNG = [0]  # program threads still running past their deadline, in this process
_HUNG_LOCK = threading.Lock()


@dataclass
class Episode:
    """One run of the agent program: how it ended, its reward, its recorded calls and counters."""

    status: str
    reward: float | None
    calls: list[Call]
    counters: dict[str, float] = field(default_factory=dict)
    detail: str = ""


def load_program(spec: str) -> Callable[..., Any]:
    """The function ``spec`` names: ``pkg.mod:fn`` or ``path/to/file.py:fn`` (a :class:`ConfigError`
    naming ``agent.openai_agent.run`` otherwise)."""
    key = "agent.openai_agent.run"
    if not spec or ":" not in spec:
        raise ConfigError(f"{key}={spec!r}: name the agent program as 'pkg.module:function' or 'file.py:function'")
    target, _, name = spec.rpartition(":")
    try:
        if target.endswith(".py"):
            path = Path(target)
            if not path.exists():
                raise ConfigError(f"{key}: file {path} does not exist")
            mspec = importlib.util.spec_from_file_location(f"polyrl_agent_program_{path.stem}", path)
            if mspec is None or mspec.loader is None:
                raise ConfigError(f"{key}: {path} cannot be imported as a Python module")
            module = importlib.util.module_from_spec(mspec)
            mspec.loader.exec_module(module)
        else:
            module = importlib.import_module(target)
    except ConfigError:
        raise
    except Exception as exc:
        raise ConfigError(f"{key}={spec!r}: importing {target} failed: {type(exc).__name__}: {exc}") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ConfigError(f"{key}={spec!r}: {target} has no function '{name}'")
    return fn


def _reward_of(value: Any) -> float | None:
    """The program's reward: a finite number, or a dict's ``reward`` (or ``score``); None otherwise."""
    if isinstance(value, Mapping):
        value = value.get("reward", value.get("score"))
    if isinstance(value, numbers.Real) and math.isfinite(float(value)):
        return float(value)
    return None


def episode_samples(calls: list[Call], mode: str) -> list[AgentLoopOutput]:
    """The training samples of an episode's calls.

    ``per_call``: one sample per call (its prompt, what it sampled). ``merged``: the longest chain of calls
    (each continuing its parent token for token; :func:`trained_chain`) as one sequence: the first call's prompt, then each call's
    sampled tokens (mask 1, their log-probs) and, between them, the tokens of the messages the program added
    (mask 0, log-prob 0). Empty when there are no calls.
    """
    if mode == "per_call":
        return [AgentLoopOutput(prompt_ids=list(c.prompt_ids), response_ids=list(c.response_ids),
                                response_mask=[1] * len(c.response_ids), log_probs=list(c.log_probs), num_turns=1,
                                finish_reason=c.finish_reason,
                                metrics={"tool_calls": float(c.tool_calls), "parse_errors": float(c.parse_errors)})
                for c in calls]
    if mode != "merged":
        raise ConfigError(f"agent.openai_agent.samples={mode!r}: choose 'merged' or 'per_call'")
    if not calls:
        return []
    chain = trained_chain(calls)
    root = chain[0]
    response: list[int] = []
    mask: list[int] = []
    logps: list[float] = []
    for i, c in enumerate(chain):
        if i:
            response += c.delta_ids
            mask += [0] * len(c.delta_ids)
            logps += [0.0] * len(c.delta_ids)
        if list(c.prompt_ids) != list(root.prompt_ids) + response:  # the chain is built so; a bug otherwise
            raise AssertionError(f"openai_agent: call {c.index} does not continue its chain token for token")
        response += c.response_ids
        mask += [1] * len(c.response_ids)
        logps += c.log_probs
    return [AgentLoopOutput(prompt_ids=list(root.prompt_ids), response_ids=response, response_mask=mask,
                            log_probs=logps, num_turns=len(chain), finish_reason=chain[-1].finish_reason,
                            metrics={"tool_calls": float(sum(c.tool_calls for c in chain)),
                                     "parse_errors": float(sum(c.parse_errors for c in chain))})]


def trained_chain(calls: list[Call]) -> list[Call]:
    """The chain ``merged`` trains, first call first: of the chains (a call, its parent, ...), the one with the
    most sampled tokens (then the longest sequence, then the earliest)."""
    if not calls:
        return []
    sampled: dict[int, int] = {}
    for c in calls:  # a parent is always recorded before its children
        sampled[c.index] = len(c.response_ids) + (sampled[c.parent] if c.parent is not None else 0)
    leaf = max(calls, key=lambda c: (sampled[c.index], len(c.prompt_ids) + len(c.response_ids), -c.index))
    chain = [leaf]
    while chain[-1].parent is not None:
        chain.append(calls[chain[-1].parent])
    return chain[::-1]


class OpenAIAgentLoop:
    """The ``openai_agent`` loop (see the module docstring); options in ``agent.openai_agent``
    (:class:`polyrl.config.schema.OpenAIAgentConfig`). Tool calls in responses are parsed with
    ``agent.tool_parser``."""

    def __init__(self, *, tokenizer: Any, config: Any = None, tools: Any = None, parser: Any = None,
                 max_prompt_length: int | None = None, program: Callable[..., Any] | None = None) -> None:
        from polyrl.agent_loops.tool_messages import ToolTurnRenderer
        from polyrl.config.schema import AgentConfig

        self.tokenizer = tokenizer
        self.config = config if config is not None else AgentConfig()
        self.options = self.config.openai_agent
        self.max_prompt_length = max_prompt_length
        self.renderer = ToolTurnRenderer(tokenizer)
        self._parser = parser
        self._program = program
        self._warned: set[str] = set()

    @property
    def program(self) -> Callable[..., Any]:
        if self._program is None:
            self._program = load_program(self.options.run)
        return self._program

    @property
    def parser(self) -> Any:
        if self._parser is None:
            from polyrl.plugins import get_plugin_manager

            self._parser = get_plugin_manager().get("tool_parser", self.config.tool_parser)()
        return self._parser

    def _check(self) -> None:
        opts = self.options
        if opts.samples not in ("merged", "per_call"):
            raise ConfigError(f"agent.openai_agent.samples={opts.samples!r}: choose 'merged' or 'per_call'")
        if opts.on_error not in ("score", "drop"):
            raise ConfigError(f"agent.openai_agent.on_error={opts.on_error!r}: choose 'score' or 'drop'")
        if not opts.timeout_s or opts.timeout_s <= 0:
            raise ConfigError(f"agent.openai_agent.timeout_s={opts.timeout_s}: give the program a deadline > 0")
        if not getattr(self.tokenizer, "chat_template", None):
            raise ConfigError("openai_agent needs a tokenizer with a chat template (tokenizer.chat_template is empty)")

    # ------------------------------------------------------------------ one episode
    async def run_episode(self, sample: Mapping[str, Any], sampling_params: SamplingParams,
                          client: GenerationClient) -> Episode:
        """Run the program once for ``sample`` against a fresh trajectory of the endpoint."""
        self._check()
        program = self.program
        opts = self.options
        proxy = get_proxy()
        loop = asyncio.get_running_loop()
        traj: Trajectory = proxy.open(
            loop=loop, client=client, tokenizer=self.tokenizer, renderer=self.renderer, parser=self.parser,
            sampling_params=sampling_params.replace(n=1), budget=sampling_params.max_new_tokens,
            max_prompt_length=self.max_prompt_length, max_calls=opts.max_calls,
            deadline=time.monotonic() + opts.timeout_s, uid=str(sample.get("uid", "")),
            per_call=opts.samples == "per_call")
        client_kwargs = {"base_url": proxy.base_url, "api_key": traj.key}
        row = {k: v for k, v in sample.items() if k != "multi_modal_data"}
        done: asyncio.Future = loop.create_future()
        finished = threading.Event()
        timed_out = [False]

        def deliver(outcome: tuple[str, Any]) -> None:
            if not done.done():
                done.set_result(outcome)

        def target() -> None:
            try:
                value = program(client_kwargs, row)
                if inspect.isawaitable(value):
                    value = asyncio.run(_awaited(value))
                outcome: tuple[str, Any] = ("ok", value)
            except BaseException:  # the program's failure is the episode's, never the run's
                outcome = ("raised", traceback.format_exc())
            finished.set()
            with _HUNG_LOCK:
                if timed_out[0]:
                    _HUNG[0] -= 1
            try:
                loop.call_soon_threadsafe(deliver, outcome)
            except RuntimeError:  # the event loop is gone (the program ran past its deadline)
                pass

        threading.Thread(target=target, name=f"polyrl-agent-program-{traj.uid}", daemon=True).start()
        try:
            status, value = await asyncio.wait_for(asyncio.shield(done), opts.timeout_s)
        except asyncio.TimeoutError:
            status, value = "timeouts", f"ran past agent.openai_agent.timeout_s={opts.timeout_s:g}s"
            with _HUNG_LOCK:
                if not finished.is_set():
                    timed_out[0] = True
                    _HUNG[0] += 1
        finally:
            proxy.close_trajectory(traj)
        with traj.lock:
            calls = list(traj.calls)
            counters = dict(traj.counters)
        reward = None
        detail = value if status != "ok" else ""
        if status == "ok":
            reward = _reward_of(value)
            if not calls:
                status, detail = "no_calls", "returned without calling the model"
            elif reward is None:
                status, detail = "bad_reward", f"returned {value!r} ({type(value).__name__}), not a finite number " \
                                               "or a dict with a finite 'reward'"
        if status != "ok":
            self._warn_once(status, detail, traj.first_error)
        return Episode(status=status, reward=reward, calls=calls, counters=counters, detail=str(detail))

    def _warn_once(self, status: str, detail: str, first_error: str | None) -> None:
        if status in self._warned:
            return
        self._warned.add(status)
        what = {"raised": "raised", "timeouts": "timed out", "no_calls": "never called the model",
                "bad_reward": "returned a non-number"}[status]
        extra = f" (its first refused request: {first_error})" if first_error else ""
        logger.warning("openai_agent: agent program %s %s%s; such episodes are %s (agent.openai_agent.on_error) "
                       "and counted in agent/program_%s/total (shown once):\n%s", self.options.run or "(given)", what,
                       extra, "dropped" if self.options.on_error == "drop" else
                       f"scored {self.options.error_score:g}", status, detail)

    # ------------------------------------------------------------------ the AgentLoop protocol
    async def run(self, sample: Mapping[str, Any], sampling_params: SamplingParams,
                  client: GenerationClient) -> AgentLoopOutput | list[AgentLoopOutput]:
        """The training samples of the program's episode: one (``merged``), or one per call (``per_call``: a
        list, the trainer's several-rows-per-sample seam, docs/environments.md)."""
        episode = await self.run_episode(sample, sampling_params, client)
        if self.options.samples == "per_call":
            return self.to_outputs(episode, sample)
        return self.to_output(episode, sample)

    def _placeholder(self, sample: Mapping[str, Any]) -> AgentLoopOutput:
        """The sample of an episode that sampled nothing: one token that trains nothing."""
        prompt = list(sample.get("prompt_ids") or [])
        eos = getattr(self.tokenizer, "eos_token_id", None)
        pad = eos if eos is not None else 0
        return AgentLoopOutput(prompt_ids=prompt or [pad], response_ids=[pad], response_mask=[0], log_probs=[0.0],
                               num_turns=0, finish_reason="stop")

    def _reward(self, episode: Episode) -> float:
        return self.options.error_score if episode.status != "ok" else float(episode.reward or 0.0)

    def _counters(self, episode: Episode, trained: int) -> dict[str, float]:
        counters = episode.counters
        return {
            "agent_model_calls": float(len(episode.calls)),
            "agent_calls_not_trained": float(len(episode.calls) - trained),
            "agent_history_edits": counters.get("history_edits", 0.0),
            "agent_bad_requests": counters.get("bad_requests", 0.0),
            **{f"agent_program_{s}": float(episode.status == s) for s in FAILURES},
        }

    def to_output(self, episode: Episode, sample: Mapping[str, Any]) -> AgentLoopOutput:
        """The ``merged`` sample of ``episode``, its reward in ``metrics['tool_reward']`` (how it reaches the
        score, see docs/agents.md) and its counters as ``agent_*`` extras."""
        samples = episode_samples(episode.calls, "merged")
        out = samples[0] if samples else self._placeholder(sample)
        if episode.status != "ok" and self.options.on_error == "drop":
            out.response_mask = [0] * len(out.response_ids)
        out.metrics = {**out.metrics, "tool_reward": self._reward(episode), "turns": float(out.num_turns),
                       "truncated": float(out.finish_reason == "length")}
        out.extra = self._counters(episode, len(trained_chain(episode.calls)))
        return out

    def to_outputs(self, episode: Episode, sample: Mapping[str, Any]) -> list[AgentLoopOutput]:
        """The ``per_call`` samples of ``episode``: one row per call, each with the episode's reward (every call
        of the episode is credited with its outcome), the counters on the first row (so batch totals count each
        episode once), and the fields of the trainer's step rows (``episode_end`` on the last row,
        ``episode_success``: reward > 0, ``episode_steps``: the calls)."""
        outs = episode_samples(episode.calls, "per_call") or [self._placeholder(sample)]
        reward = self._reward(episode)
        zero = dict.fromkeys(self._counters(episode, 0), 0.0)
        for t, out in enumerate(outs):
            if episode.status != "ok" and self.options.on_error == "drop":
                out.response_mask = [0] * len(out.response_ids)
            out.metrics = {**out.metrics, "tool_reward": reward, "turns": 1.0,
                           "truncated": float(out.finish_reason == "length")}
            out.extra = {**(self._counters(episode, len(episode.calls)) if t == 0 else zero),
                         "episode_end": float(t == len(outs) - 1),
                         "episode_success": float(reward > 0), "episode_steps": float(len(episode.calls))}
        return outs


def hung_programs() -> int:
    """Program threads of this process still running past their deadline (Python cannot stop a thread)."""
    return _HUNG[0]


def compute_score(data_source: Any, solution_str: Any, ground_truth: Any, extra_info: Any = None) -> float:
    """The reward function of data source ``openai_agent``: 0, because the program's own reward reaches the
    score through ``tool_reward`` (docs/agents.md, "Agent programs")."""
    return 0.0


async def _awaited(value: Any) -> Any:
    return await value
