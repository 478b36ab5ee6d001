"""``tool_agent``: multi-turn generation with tool calls, token-exact.

One trajectory: generate a turn, parse its tool calls, run the tools (concurrently,
off the event loop), append their messages through the chat template, generate
again... until the model answers without calling a tool, ``agent.max_turns``, or
``data.max_response_length``.

Token exactness: the model's tokens are kept exactly as sampled (ids and log-probs;
``response_mask`` 1). Only the *appended* tool messages are tokenized, as the delta
between two chat-template renderings of a fixed stub conversation (with and without
the tool messages), so the sampled text is never decoded and re-tokenized (which can
give other ids: ``"<|end|>"`` sampled as characters re-tokenizes to one special token).
Tool / template tokens get ``response_mask`` 0 and log-prob 0.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from typing import Any

from polyrl.errors import ConfigError, DataError
from polyrl.protocols import AgentLoopOutput, GenerationClient, GenerationRequest, SamplingParams, ToolResult

logger = logging.getLogger(__name__)

_STUB_USER = "polyrl-stub-user"
_STUB_ASSISTANT = "polyrl-stub-assistant"


class ChatTemplateError(ConfigError):
    """The tokenizer's chat template cannot render what ``tool_agent`` appends."""


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
        self._template_checked = False
        self.max_prompt_length = max_prompt_length

    # ------------------------------------------------------------------ set-up
    @property
    def parser(self) -> Any:
        """The tool-call parser named by ``agent.tool_parser`` (resolved on first use)."""
        if self._parser is None:
            from polyrl.plugins import get_plugin_manager

            self._parser = get_plugin_manager().get("tool_parser", self.config.tool_parser)()
        return self._parser

    def _render(self, messages: list[dict], *, generation_prompt: bool, tools: Any = None) -> str:
        kwargs = {"tools": tools} if tools else {}
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False,
                                                  **kwargs)

    def _check_template(self) -> None:
        """Fail once, clearly, when the chat template has no tool role or is not prefix-stable."""
        if self._template_checked:
            return
        if not getattr(self.tokenizer, "chat_template", None):
            raise ChatTemplateError("tool_agent needs a tokenizer with a chat template (tokenizer.chat_template is "
                                    "empty); set one in tokenizer_config.json")
        probe = "polyrl-probe-tool-output"
        try:
            text = self._tool_delta_text([{"role": "tool", "content": probe}], None)
        except ChatTemplateError:
            raise
        except Exception as exc:  # jinja raises for roles a template does not know
            raise ChatTemplateError(f"the tokenizer's chat template cannot render a 'tool' message: {exc}. Use a "
                                    "template with a tool role (docs/agents.md)") from exc
        if probe not in text:
            raise ChatTemplateError("the tokenizer's chat template drops 'tool' messages (no tool role); use a "
                                    "template that renders {'role': 'tool'} (docs/agents.md)")
        self._template_checked = True

    def _tool_delta_text(self, messages: list[dict], sampled_end: str | None) -> str:
        """The text the chat template puts after an assistant turn's content for ``messages``, up to and
        including the next generation prompt, minus what the model already sampled (``sampled_end``, e.g.
        the EOS token that closed the turn)."""
        stub = [{"role": "user", "content": _STUB_USER}, {"role": "assistant", "content": _STUB_ASSISTANT}]
        before = self._render(stub, generation_prompt=False)
        after = self._render(stub + messages, generation_prompt=True)
        if not after.startswith(before):
            raise ChatTemplateError("the chat template is not prefix-stable: rendering more messages changed the "
                                    "text of earlier ones, so appended turns cannot be tokenized as a delta")
        end_of_turn = before[before.rindex(_STUB_ASSISTANT) + len(_STUB_ASSISTANT):]
        if sampled_end and end_of_turn.startswith(sampled_end):
            end_of_turn = end_of_turn[len(sampled_end):]
        return end_of_turn + after[len(before):]

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
        stats = {"tool_calls": 0.0, "tool_errors": 0.0, "tool_time_s": 0.0, "parse_errors": 0.0}
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
            parsed = self.parser.parse(self.tokenizer.decode(ids, skip_special_tokens=True))
            if not parsed.has_calls:
                break  # the model answered
            if turns >= cfg.max_turns:
                finish = "max_turns"
                break
            messages = await self._run_calls(parsed, allowed, sample, stats, rewards)
            sampled_end = self.tokenizer.decode([ids[-1]]) if ids and ids[-1] in stop_ids else None
            delta = self.tokenizer.encode(self._tool_delta_text(messages, sampled_end), add_special_tokens=False)
            if len(response) + len(delta) >= budget:
                finish = "length"  # no room for the tool messages and another turn: end at this turn's boundary
                break
            response += delta
            mask += [0] * len(delta)
            logps += [0.0] * len(delta)
        metrics = dict(stats, turns=float(turns), tool_reward=float(sum(rewards)),
                       truncated=float(finish in ("length", "max_turns")))
        return AgentLoopOutput(prompt_ids=prompt_ids, response_ids=response, response_mask=mask, log_probs=logps,
                               num_turns=turns, finish_reason=finish, metrics=metrics)

    async def _run_calls(self, parsed: Any, allowed: list[str], sample: Mapping[str, Any], stats: dict[str, float],
                         rewards: list[float]) -> list[dict]:
        """Run a turn's calls concurrently; every call (and every malformed one) becomes one tool message."""
        cfg = self.config
        calls = parsed.calls[: cfg.max_parallel_calls]
        outcomes = await asyncio.gather(*[self._call_one(c, allowed, sample) for c in calls])
        messages = []
        for text, ok, seconds, reward in outcomes:
            stats["tool_calls"] += 1
            stats["tool_time_s"] += seconds
            stats["tool_errors"] += 0.0 if ok else 1.0
            if reward is not None:
                rewards.append(float(reward))
            messages.append({"role": "tool", "content": self._clip(text)})
        for extra in parsed.calls[cfg.max_parallel_calls:]:
            stats["tool_calls"] += 1
            stats["tool_errors"] += 1
            messages.append({"role": "tool", "content": f"Error: at most {cfg.max_parallel_calls} tool calls per turn; "
                                                        f"'{extra.name}' was not run."})
        for err in parsed.errors:  # a malformed call is an attempted call that failed
            stats["parse_errors"] += 1
            stats["tool_calls"] += 1
            stats["tool_errors"] += 1
            messages.append({"role": "tool", "content": f"Error: {err}"})
        return messages

    async def _call_one(self, call: Any, allowed: list[str], sample: Mapping[str, Any]
                        ) -> tuple[str, bool, float, float | None]:
        """``(message, ok, seconds, reward)`` for one call; a failing tool is a message, never an exception."""
        start = time.perf_counter()
        if call.name not in allowed:
            return (f"Error: unknown tool '{call.name}'; available: {', '.join(allowed) or '(none)'}", False, 0.0, None)
        tool = self.tools[call.name]
        try:
            result = await asyncio.wait_for(tool.execute(dict(call.arguments), sample), self.config.tool_timeout_s)
            if not isinstance(result, ToolResult):
                from polyrl.tools.function import to_tool_result

                result = to_tool_result(result, call.name)
            return result.text, True, time.perf_counter() - start, result.reward
        except asyncio.TimeoutError:
            msg = f"Error: tool '{call.name}' timed out after {self.config.tool_timeout_s:g}s"
        except Exception as exc:  # a tool's failure is information for the model, not a crash of the step
            logger.debug("tool %s failed", call.name, exc_info=True)
            msg = f"Error: {type(exc).__name__}: {exc}"
        return msg, False, time.perf_counter() - start, None

    def _clip(self, text: str) -> str:
        limit = self.config.max_tool_response_length
        if limit and len(text) > limit:
            half = max(1, (limit - 5) // 2)
            return text[:half] + " ... " + text[-half:]
        return text


def _turn_seed(seed: int | None, turn: int) -> int | None:
    """The seed of turn ``turn``: the step's seed for the first turn, a distinct one for each later turn."""
    return seed if seed is None or turn == 0 else (seed * 1_000_003 + turn) % 2**31
