"""``tool_agent``: multi-turn generation with tool calls, token-exact.

One trajectory: generate a turn, parse its tool calls, run the tools (concurrently,
off the event loop), append their messages through the chat template, generate
again... until the model answers without calling a tool, ``agent.max_turns``, or
``data.max_response_length``.

Token exactness: the model's tokens are kept exactly as sampled (ids and log-probs;
``response_mask`` 1). Only the *appended* tool messages are tokenized, as the text the
chat template puts after an assistant turn when tool messages follow it
(:mod:`polyrl.agent_loops.tool_messages`), so the sampled text is never decoded and
re-tokenized (which can give other ids: ``"<|end|>"`` sampled as characters re-tokenizes
to one special token), and tool output is data: it never becomes control tokens.
Tool / template tokens get ``response_mask`` 0 and log-prob 0.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import numbers
import re
import time
from collections.abc import Mapping
from typing import Any

from polyrl.agent_loops.tool_messages import ChatTemplateError, ToolTurnRenderer
from polyrl.errors import DataError
from polyrl.protocols import AgentLoopOutput, GenerationClient, GenerationRequest, SamplingParams, ToolResult
from polyrl.tools.function import TOOL_EXECUTOR, ToolError
from polyrl.tools.parsers import ParsedTurn

logger = logging.getLogger(__name__)

__all__ = ["ChatTemplateError", "ToolAgentLoop"]

_CALL_ID = re.compile(r"^[A-Za-z0-9]{9}$")


class ToolAgentLoop:
    """The multi-turn tool-calling loop (see the module docstring and docs/agents.md).

    ``config`` is the run's ``agent`` block (:class:`polyrl.config.schema.AgentConfig`);
    ``tools`` maps names to built tools. A row restricts its tools with ``tools`` or
    ``extra_info.tools`` (a list of names); without either it may use every tool.
    ``max_prompt_length`` is the run's ``data.max_prompt_length`` (the worker passes it):
    a prompt re-rendered with the tool schemas (``agent.tools_in_prompt``) longer than it
    is a :class:`~polyrl.errors.DataError` (``None``: not checked). The response budget
    is ``sampling_params.max_new_tokens`` (``data.max_response_length`` in a run).
    """

    def __init__(self, *, tokenizer: Any, config: Any = None, tools: Mapping[str, Any] | None = None,
                 parser: Any = None, max_prompt_length: int | None = None) -> None:
        from polyrl.config.schema import AgentConfig

        self.tokenizer = tokenizer
        self.config = config if config is not None else AgentConfig()
        self.tools = dict(tools or {})
        self._parser = parser
        self._parser_takes_tools: bool | None = None
        self.renderer = ToolTurnRenderer(tokenizer)
        self.max_prompt_length = max_prompt_length

    # ------------------------------------------------------------------ set-up
    @property
    def parser(self) -> Any:
        """The tool-call parser named by ``agent.tool_parser`` (resolved on first use)."""
        if self._parser is None:
            from polyrl.plugins import get_plugin_manager

            self._parser = get_plugin_manager().get("tool_parser", self.config.tool_parser)()
        return self._parser

    def _check_template(self) -> None:
        """Fail once, clearly, when the chat template cannot render tool messages (no tool role...)."""
        self.renderer.check()

    def _parse(self, text: str, allowed: list[str]) -> Any:
        """The turn's calls; a parser that raises on what the model wrote gives a malformed turn instead."""
        parser = self.parser
        try:
            if self._parser_takes_tools is None:
                try:
                    self._parser_takes_tools = "tools" in inspect.signature(parser.parse).parameters
                except (TypeError, ValueError):
                    self._parser_takes_tools = False
            if self._parser_takes_tools:
                return parser.parse(text, tools={n: self.tools[n].schema for n in allowed})
            return parser.parse(text)
        except Exception as exc:  # nothing a model writes may end a run
            logger.debug("tool parser %s raised on a model turn", type(parser).__name__, exc_info=True)
            message = f"the tool calls could not be parsed: {type(exc).__name__}: {str(exc)[:200]}"
            return ParsedTurn(text.strip(), [], [message], [message])

    def _prompt_ids(self, sample: Mapping[str, Any], allowed: list[str]) -> list[int]:
        if self.config.tools_in_prompt and allowed and sample.get("prompt") and not isinstance(sample["prompt"], str):
            schemas = [self.tools[n].schema for n in allowed]
            ids = self.tokenizer.apply_chat_template(list(sample["prompt"]), tools=schemas, add_generation_prompt=True,
                                                     tokenize=True)
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
            ids = list(ids)
            limit = self.max_prompt_length
            if limit and len(ids) > limit:
                # collate would cut the prompt's start: training would see another context than sampling did
                raise DataError(
                    f"tool_agent: row uid {sample.get('uid')} (data_source {sample.get('data_source')!r}): its prompt "
                    f"with the schemas of tools {allowed} is {len(ids)} tokens, longer than data.max_prompt_length="
                    f"{limit}. Raise data.max_prompt_length, set agent.tools_in_prompt=false (and describe the tools "
                    "in the prompt yourself), or give the row fewer tools (its tools / extra_info.tools)")
            return ids
        if "prompt_ids" not in sample:
            raise DataError(f"tool_agent: row uid {sample.get('uid')} has neither 'prompt' messages nor 'prompt_ids'")
        return list(sample["prompt_ids"])

    def allowed_tools(self, sample: Mapping[str, Any]) -> list[str]:
        """The tool names this row may call (``tools`` or ``extra_info.tools``; all configured tools if neither)."""
        names = sample.get("tools")
        if names is None:
            names = (sample.get("extra_info") or {}).get("tools")
        if names is None:
            return sorted(self.tools)
        if isinstance(names, str):
            names = [names]
        unknown = [n for n in names if n not in self.tools]
        if unknown:
            raise DataError(
                f"row uid {sample.get('uid')} (data_source {sample.get('data_source')!r}) asks for tool(s) {unknown}, "
                f"which agent.tools does not provide; configured: {sorted(self.tools) or '(none)'}. Add them to "
                "agent.tools (a registered name or an import string) or fix the row's extra_info.tools")
        return list(names)

    # ------------------------------------------------------------------ the loop
    async def run(self, sample: Mapping[str, Any], sampling_params: SamplingParams,
                  client: GenerationClient) -> AgentLoopOutput:
        """One multi-turn trajectory for ``sample``."""
        self._check_template()
        cfg = self.config
        allowed = self.allowed_tools(sample)
        prompt_ids = self._prompt_ids(sample, allowed)
        budget = sampling_params.max_new_tokens
        response: list[int] = []
        mask: list[int] = []
        logps: list[float] = []
        stats = {"tool_calls": 0.0, "tool_errors": 0.0, "tool_time_s": 0.0, "parse_errors": 0.0,
                 "tool_timeouts": 0.0}
        rewards: list[float] = []
        turns = 0
        finish = "stop"
        eos = self.tokenizer.eos_token_id
        stop_ids = set(sampling_params.stop_token_ids) | ({eos} if eos is not None else set())
        while True:
            left = budget - len(response)
            if left <= 0:
                finish = "length"
                break
            per_turn = min(left, cfg.max_new_tokens_per_turn or left)
            # same params for every turn but the budget, so concurrent turns batch together (BatchingClient);
            # a seeded run gets a new seed per turn, or every later turn would replay turn 0's random stream
            params = sampling_params.replace(n=1, max_new_tokens=per_turn, seed=_turn_seed(sampling_params.seed, turns))
            request = GenerationRequest(prompt_ids=prompt_ids + response,
                                        sampling_params=params,
                                        request_id=f"{sample.get('uid', '')}/turn{turns}")
            (result,) = await client.agenerate(request)
            turns += 1
            ids = list(result.response_ids)
            lp = list(result.log_probs) or [0.0] * len(ids)
            response += ids
            mask += [1] * len(ids)
            logps += lp
            if result.finish_reason != "stop":
                finish = result.finish_reason  # cut inside the turn by the length budget
                break
            parsed = self._parse(self.tokenizer.decode(ids, skip_special_tokens=True), allowed)
            if not parsed.has_calls:
                break  # the model answered
            if turns >= cfg.max_turns:
                finish = "max_turns"
                break
            messages = await self._run_calls(parsed, allowed, sample, stats, rewards, turns)
            sampled_end: list[str] = []
            if ids and ids[-1] in stop_ids:  # the end-of-turn token the model sampled first, then the others
                sampled_end = [self.tokenizer.decode([ids[-1]])]
                sampled_end += [self.tokenizer.decode([t]) for t in sorted(stop_ids - {ids[-1]})]
            delta = self.renderer.delta_ids(messages, sampled_end)
            if len(response) + len(delta) >= budget:
                finish = "length"  # no room for the tool messages and another turn: end at this turn's boundary
                break
            response += delta
            mask += [0] * len(delta)
            logps += [0.0] * len(delta)
        metrics = dict(stats, turns=float(turns), tool_reward=float(sum(rewards)),
                       truncated=float(finish in ("length", "max_turns")), tools_hung=float(TOOL_EXECUTOR.hung))
        return AgentLoopOutput(prompt_ids=prompt_ids, response_ids=response, response_mask=mask, log_probs=logps,
                               num_turns=turns, finish_reason=finish, metrics=metrics)

    async def _run_calls(self, parsed: Any, allowed: list[str], sample: Mapping[str, Any], stats: dict[str, float],
                         rewards: list[float], turn: int) -> list[dict]:
        """Run a turn's calls concurrently; every call (and every malformed one) becomes one tool message,
        in the order the model wrote them."""
        cfg = self.config
        items = parsed.in_order() if hasattr(parsed, "in_order") else [*parsed.calls, *parsed.errors]
        texts: list[str | None] = [None] * len(items)
        names: list[str] = ["error"] * len(items)
        ids: list[str | None] = [None] * len(items)
        to_run: list[tuple[int, Any]] = []
        for i, item in enumerate(items):
            stats["tool_calls"] += 1
            if isinstance(item, str):  # a malformed call is an attempted call that failed
                stats["parse_errors"] += 1
                stats["tool_errors"] += 1
                texts[i] = f"Error: {item}"
                continue
            # the model's text never reaches the message's name (only content is rendered as data)
            names[i] = item.name if isinstance(getattr(item, "name", None), str) and item.name in allowed else "error"
            ids[i] = getattr(item, "id", None)
            if len(to_run) < cfg.max_parallel_calls:
                to_run.append((i, item))
            else:
                stats["tool_errors"] += 1
                texts[i] = (f"Error: at most {cfg.max_parallel_calls} tool calls per turn; '{names[i]}' was not run.")
        outcomes = await asyncio.gather(*[self._call_one(c, allowed, sample) for _, c in to_run])
        for (i, call), (text, ok, seconds, reward, timed_out) in zip(to_run, outcomes):
            stats["tool_time_s"] += seconds
            stats["tool_errors"] += 0.0 if ok else 1.0
            stats["tool_timeouts"] += float(timed_out)
            if reward is not None:
                rewards.append(_checked_reward(reward, call.name))
            texts[i] = text
        return [{"role": "tool", "content": self._clip(text or ""), "name": name,
                 "tool_call_id": call_id if isinstance(call_id, str) and _CALL_ID.match(call_id)
                 else f"call{turn % 100:02d}{i % 1000:03d}"}
                for i, (text, name, call_id) in enumerate(zip(texts, names, ids))]

    async def _call_one(self, call: Any, allowed: list[str], sample: Mapping[str, Any]
                        ) -> tuple[str, bool, float, Any, bool]:
        """``(message, ok, seconds, reward, timed_out)`` for one call; a failing tool is a message, never an
        exception (except a tool's invalid reward: a bug of the tool, see :func:`_checked_reward`)."""
        start = time.perf_counter()
        if call.name not in allowed:
            return (f"Error: unknown tool '{call.name}'; available: {', '.join(allowed) or '(none)'}", False, 0.0,
                    None, False)
        tool = self.tools[call.name]
        timed_out = False
        try:
            result = await asyncio.wait_for(tool.execute(dict(call.arguments), sample), self.config.tool_timeout_s)
            if not isinstance(result, ToolResult):
                from polyrl.tools.function import to_tool_result

                result = to_tool_result(result, call.name)
            return result.text, True, time.perf_counter() - start, result.reward, False
        except asyncio.TimeoutError:
            timed_out = True
            msg = f"Error: tool '{call.name}' timed out after {self.config.tool_timeout_s:g}s"
        except Exception as exc:  # a tool's failure is information for the model, not a crash of the step
            logger.debug("tool %s failed", call.name, exc_info=True)
            msg = f"Error: {type(exc).__name__}: {exc}"
        return msg, False, time.perf_counter() - start, None, timed_out

    def _clip(self, text: str) -> str:
        limit = self.config.max_tool_response_length
        if limit and len(text) > limit:
            half = max(1, (limit - 5) // 2)
            return text[:half] + " ... " + text[-half:]
        return text


def _checked_reward(reward: Any, tool: str) -> float:
    """A tool's ``ToolResult.reward`` as a float; :class:`~polyrl.tools.function.ToolError` naming the tool and
    the value when it is not a finite number (a NaN or a string would otherwise surface later as a broken
    score, blamed on the reward function)."""
    if isinstance(reward, numbers.Real) and math.isfinite(float(reward)):
        return float(reward)
    raise ToolError(f"tool '{tool}' returned ToolResult(reward={reward!r}) ({type(reward).__name__}): a tool's reward "
                    "must be a finite number (or None for no reward); fix the tool")


def _turn_seed(seed: int | None, turn: int) -> int | None:
    """The seed of turn ``turn``: the step's seed for the first turn, a distinct one for each later turn."""
    return seed if seed is None or turn == 0 else (seed * 1_000_003 + turn) % 2**31
