"""The tool_agent loop: token-exact multi-turn trajectories, tools, errors, routing, rewards."""

from __future__ import annotations

import asyncio
import textwrap
import threading
import time

import pytest

from polyrl.agent_loops import BatchingClient, ToolAgentLoop, collate, fold_tool_rewards, run_agent_loops
from polyrl.agent_loops.arithmetic_task import tool_call_text
from polyrl.agent_loops.tool_agent import ChatTemplateError
from polyrl.config.schema import AgentConfig
from polyrl.errors import DataError
from polyrl.protocols import AgentLoopOutput, GenerationResult, SamplingParams, ToolResult
from polyrl.testing import AgentLoopConformance
from polyrl.tools import build_tools, tool
from polyrl.tools.parsers import HermesParser


class ScriptedClient:
    """A model that says what it is told: turn k answers ``turns[k]`` (text or token ids) + EOS."""

    def __init__(self, tokenizer, turns, log_prob=-0.25):
        self.tok, self.turns, self.log_prob = tokenizer, list(turns), log_prob
        self.requests = []

    async def agenerate(self, request):
        self.requests.append(request)
        k = min(len(self.requests) - 1, len(self.turns) - 1)
        turn = self.turns[k]
        ids = list(turn) if isinstance(turn, list) else self.tok.encode(turn, add_special_tokens=False)
        ids = ids + [self.tok.eos_token_id]
        budget = request.sampling_params.max_new_tokens
        finish = "stop" if len(ids) <= budget else "length"
        ids = ids[:budget]
        lps = [self.log_prob - 0.001 * i for i in range(len(ids))]
        return [GenerationResult(list(request.prompt_ids), ids, lps, finish_reason=finish)]


def make_sample(tok, content="123*456=", **extra):
    prompt = [{"role": "user", "content": content}]
    ids = tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"]) if hasattr(ids, "keys") else list(ids)
    return {"prompt": prompt, "prompt_ids": ids, "uid": "u0", **extra}


@pytest.fixture(scope="module")
def tools():
    from polyrl.plugins import PluginManager

    return build_tools(["calculator"], PluginManager(entry_points=False))


def make_loop(tok, tools, parser=None, **cfg):
    return ToolAgentLoop(tokenizer=tok, config=AgentConfig(tools=list(tools), **cfg), tools=tools,
                         parser=parser or HermesParser())


def run(loop, sample, client, max_new_tokens=256):
    return asyncio.run(loop.run(sample, SamplingParams(max_new_tokens=max_new_tokens, seed=0), client))


CALL = tool_call_text("123*456")


class TestToolAgentConformance(AgentLoopConformance):
    multi_turn = True

    @pytest.fixture
    def agent_loop(self, tiny_tokenizer, tools):
        return make_loop(tiny_tokenizer, tools)

    @pytest.fixture
    def client(self, tiny_tokenizer):
        return ScriptedClient(tiny_tokenizer, [CALL, "56088"])

    @pytest.fixture
    def sample(self, tiny_tokenizer):
        return make_sample(tiny_tokenizer)


class TestToolAgentOnRealRollout(AgentLoopConformance):
    """Single-turn behaviour against real sampling (the random model rarely calls a tool)."""

    @pytest.fixture
    def agent_loop(self, tiny_tokenizer, tools):
        return make_loop(tiny_tokenizer, tools)

    @pytest.fixture
    def client(self, tiny_model_dir, tiny_tokenizer):
        from polyrl.config.roles import RolloutConfig
        from polyrl.rollout.hf import HFRollout

        return BatchingClient(HFRollout(RolloutConfig(), model_path=str(tiny_model_dir), tokenizer=tiny_tokenizer))

    @pytest.fixture
    def sample(self, tiny_tokenizer):
        return make_sample(tiny_tokenizer)


def test_trajectory_layout_and_masks(tiny_tokenizer, tools):
    tok = tiny_tokenizer
    client = ScriptedClient(tok, [CALL, "56088"])
    out = run(make_loop(tok, tools), make_sample(tok), client)
    segments, cur = [], None
    for t, m in zip(out.response_ids, out.response_mask):
        if m != cur:
            segments.append((m, []))
            cur = m
        segments[-1][1].append(t)
    texts = [(m, tok.decode(ids)) for m, ids in segments]
    # model turn, then the tool message through the chat template, then the model's answer
    assert texts == [(1, CALL + "<|end|>"), (0, "\n<|tool|>56088\n<|assistant|>"), (1, "56088<|end|>")]
    assert out.num_turns == 2 and out.finish_reason == "stop"
    assert out.metrics["tool_calls"] == 1 and out.metrics["tool_errors"] == 0
    # the second request continued the first exactly
    assert client.requests[1].prompt_ids == list(out.prompt_ids) + out.response_ids[: len(client.requests[1].prompt_ids)
                                                                                    - len(out.prompt_ids)]


def test_each_turn_gets_its_own_seed(tiny_tokenizer, tools):
    # a rollout seeds its sampler from the request's seed: a later turn with the step's seed would replay
    # the random numbers of turn 0
    client = ScriptedClient(tiny_tokenizer, [CALL, CALL, "56088"])
    run(make_loop(tiny_tokenizer, tools, max_turns=3), make_sample(tiny_tokenizer), client)
    seeds = [r.sampling_params.seed for r in client.requests]
    assert len(seeds) == 3 and seeds[0] == 0 and len(set(seeds)) == 3


def test_no_retokenization_drift(tiny_tokenizer, tools):
    """The model samples '<', '|', 'e', ... as single characters: decoding and re-tokenizing would turn them
    into the one special token <|end|>. The trained ids must be the sampled ones."""
    tok = tiny_tokenizer
    odd = tok.encode(CALL, add_special_tokens=False) + [tok.convert_tokens_to_ids(c) for c in "<|end|>"]
    client = ScriptedClient(tok, [odd, "56088"])
    out = run(make_loop(tok, tools), make_sample(tok), client)
    first_turn = out.response_ids[: len(odd) + 1]
    assert first_turn == odd + [tok.eos_token_id]
    retokenized = tok.encode(tok.decode(first_turn), add_special_tokens=False)
    assert retokenized != first_turn  # the drift the delta tokenization avoids
    assert out.log_probs[: len(first_turn)] == pytest.approx([-0.25 - 0.001 * i for i in range(len(first_turn))])


@pytest.mark.parametrize("bad, message", [
    ("<tool_call>{not json}</tool_call>", "not valid JSON"),
    ('<tool_call>{"arguments": {}}</tool_call>', "needs a string 'name'"),
    ('<tool_call>{"name": "calculator", "arguments": [1]}</tool_call>', "must be a JSON object"),
    ('<tool_call>{"name": "calculator", "arguments": {"expression": "1+', "never closed"),
    ('<tool_call>{"name": "nope", "arguments": {}}</tool_call>', "unknown tool 'nope'; available: calculator"),
    ('<tool_call>{"name": "calculator", "arguments": {"expr": "1"}}</tool_call>', "'expression' is a required"),
    ('<tool_call>{"name": "calculator", "arguments": {"expression": "__import__(\'os\')"}}</tool_call>',
     "is not allowed"),
])
def test_malformed_calls_become_error_messages(tiny_tokenizer, tools, bad, message):
    tok = tiny_tokenizer
    out = run(make_loop(tok, tools), make_sample(tok), ScriptedClient(tok, [bad, "1"]))
    env = tok.decode([t for t, m in zip(out.response_ids, out.response_mask) if not m])
    assert "Error:" in env and message in env
    assert out.metrics["tool_errors"] == out.metrics["tool_calls"] == 1 and out.num_turns == 2 and out.finish_reason == "stop"


def test_parallel_calls_run_concurrently_and_off_the_event_loop(tiny_tokenizer):
    tok = tiny_tokenizer
    threads = set()

    @tool
    def slow(x: int) -> str:
        """Sleep, then echo.

        Args:
            x: a number.
        """
        threads.add(threading.current_thread().name)
        time.sleep(0.5)
        return str(x)

    tools = {"slow": slow}
    calls = "".join(tool_call_text("0", "slow").replace('"expression": "0"', f'"x": {i}') for i in range(3))
    loop = make_loop(tok, tools)
    ticks = []

    async def main():
        async def ticker():  # the event loop stays free while the tools sleep in threads
            for _ in range(8):
                ticks.append(time.perf_counter())
                await asyncio.sleep(0.05)

        start = time.perf_counter()
        out, _ = await asyncio.gather(loop.run(make_sample(tok), SamplingParams(max_new_tokens=256),
                                               ScriptedClient(tok, [calls, "ok"])), ticker())
        return out, time.perf_counter() - start

    out, took = asyncio.run(main())
    assert out.metrics["tool_calls"] == 3 and out.metrics["tool_errors"] == 0
    assert took < 1.2, f"3 calls of 0.5 s took {took:.2f}s: not concurrent"
    assert len(ticks) == 8 and max(b - a for a, b in zip(ticks, ticks[1:])) < 0.4
    assert all(name.startswith("polyrl-tool") for name in threads)


def test_tool_that_raises_hangs_or_returns_non_text(tiny_tokenizer):
    tok = tiny_tokenizer

    @tool
    def boom(x: int) -> str:
        """Always fails.

        Args:
            x: ignored.
        """
        raise RuntimeError("kaboom")

    @tool
    async def hang(x: int) -> str:
        """Never returns.

        Args:
            x: ignored.
        """
        await asyncio.sleep(3600)
        return ""

    @tool
    def weird(x: int) -> object:
        """Returns something that is not text.

        Args:
            x: ignored.
        """
        return object()

    tools = {"boom": boom, "hang": hang, "weird": weird}
    calls = "".join(f'<tool_call>{{"name": "{n}", "arguments": {{"x": 1}}}}</tool_call>' for n in tools)
    loop = make_loop(tok, tools, tool_timeout_s=0.5)
    start = time.perf_counter()
    out = run(loop, make_sample(tok), ScriptedClient(tok, [calls, "done"]), max_new_tokens=1024)
    assert time.perf_counter() - start < 5
    env = tok.decode([t for t, m in zip(out.response_ids, out.response_mask) if not m])
    assert "RuntimeError: kaboom" in env
    assert "'hang' timed out after 0.5s" in env
    assert "neither text nor JSON" in env
    assert out.metrics["tool_errors"] == 3 and out.finish_reason == "stop"


def test_turn_limit_and_length_limit(tiny_tokenizer, tools):
    tok = tiny_tokenizer
    out = run(make_loop(tok, tools, max_turns=2), make_sample(tok), ScriptedClient(tok, [CALL]))
    assert out.num_turns == 2 and out.finish_reason == "max_turns" and out.metrics["truncated"] == 1
    # room for the first turn but not for the tool message + another turn: ends at the turn boundary
    first = len(tok.encode(CALL, add_special_tokens=False)) + 1
    out = run(make_loop(tok, tools), make_sample(tok), ScriptedClient(tok, [CALL, "56088"]), max_new_tokens=first + 5)
    assert out.finish_reason == "length" and len(out.response_ids) == first and all(out.response_mask)


def test_collate_cuts_overlong_trajectories_at_a_turn_boundary(caplog):
    out = AgentLoopOutput([1], [7, 7, 7, 0, 0, 8, 8, 8], [1, 1, 1, 0, 0, 1, 1, 1], [-1.0] * 8, num_turns=2)
    ok = AgentLoopOutput([1], [9], [1], [-1.0])
    b = collate([out, ok], pad_token_id=0, max_prompt_length=2, max_response_length=6)
    assert b["responses"][0].tolist() == [7, 7, 7, 0, 0, 0]  # the second turn did not fit: cut after the tool tokens
    assert b["response_mask"][0].tolist() == [1, 1, 1, 0, 0, 0]
    assert b["truncated"].tolist() == [1.0, 0.0] and out.finish_reason == "truncated"
    assert "cut at a turn boundary" in caplog.text


def test_per_sample_tool_routing_and_unknown_tools(tiny_tokenizer, polyrl_plugin_manager):
    tok = tiny_tokenizer
    tools = build_tools(["calculator", {"name": "python", "timeout_s": 5}], polyrl_plugin_manager)
    loop = make_loop(tok, tools)
    assert loop.allowed_tools(make_sample(tok)) == ["calculator", "python"]
    only_calc = make_sample(tok, extra_info={"tools": ["calculator"]})
    assert loop.allowed_tools(only_calc) == ["calculator"]
    assert loop.allowed_tools(make_sample(tok, tools=["python"])) == ["python"]
    call_python = '<tool_call>{"name": "python", "arguments": {"code": "print(1)"}}</tool_call>'
    out = run(loop, only_calc, ScriptedClient(tok, [call_python, "1"]))
    env = tok.decode([t for t, m in zip(out.response_ids, out.response_mask) if not m])
    assert "unknown tool 'python'; available: calculator" in env
    with pytest.raises(DataError, match=r"asks for tool\(s\) \['search'\].*configured: \['calculator', 'python'\]"):
        run(loop, make_sample(tok, extra_info={"tools": ["search"]}), ScriptedClient(tok, ["x"]))


def test_rows_pick_their_loop(tiny_tokenizer, tools, tiny_model_dir):
    from polyrl.agent_loops import SingleTurnAgentLoop

    tok = tiny_tokenizer
    loops = {"single_turn": SingleTurnAgentLoop(tokenizer=tok), "tool_agent": make_loop(tok, tools)}
    samples = [make_sample(tok, agent_name="tool_agent"), make_sample(tok)]
    outs = run_agent_loops(samples, SamplingParams(max_new_tokens=256), ScriptedClient(tok, [CALL, "56088"]), loops)
    assert outs[0].metrics["tool_calls"] == 1 and outs[1].num_turns == 1 and not outs[1].metrics


def test_chat_template_without_tool_role(tiny_tokenizer, tools):
    import copy

    tok = copy.deepcopy(tiny_tokenizer)
    tok.chat_template = ("{% for m in messages %}{% if m['role'] in ['user', 'assistant'] %}<|{{ m['role'] }}|>"
                         "{{ m['content'] }}\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
    with pytest.raises(ChatTemplateError, match="no tool role"):
        run(make_loop(tok, tools), make_sample(tok), ScriptedClient(tok, [CALL]))
    tok.chat_template = ("{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('roles must be "
                         "user/assistant') }}{% endif %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}")
    with pytest.raises(ChatTemplateError, match="cannot render a 'tool' message"):
        run(make_loop(tok, tools), make_sample(tok), ScriptedClient(tok, [CALL]))


def test_tool_rewards_are_folded_into_the_score(tiny_tokenizer):
    import torch

    tok = tiny_tokenizer

    @tool
    def graded(x: int, sample: dict) -> ToolResult:
        """Reward a call whose argument is the row's answer.

        Args:
            x: the proposed answer.
        """
        right = str(x) == sample["reward_model"]["ground_truth"]
        return ToolResult(text="right" if right else "wrong", reward=0.5 if right else 0.0)

    assert "sample" not in graded.schema["function"]["parameters"]["properties"]
    loop = make_loop(tok, {"graded": graded})
    call = '<tool_call>{"name": "graded", "arguments": {"x": 42}}</tool_call>'
    outs = [run(loop, make_sample(tok, reward_model={"ground_truth": gt}), ScriptedClient(tok, [call, "a"]))
            for gt in ("42", "7")]
    assert [o.metrics["tool_reward"] for o in outs] == [0.5, 0.0]
    batch = collate(outs, pad_token_id=0, max_prompt_length=32, max_response_length=128)
    batch["token_level_scores"] = torch.zeros(2, 128)
    fold_tool_rewards(batch, AgentConfig(tool_reward_coef=2.0))
    last = int(batch["attention_mask"][0, 32:].sum()) - 1
    assert batch["token_level_scores"][0, last] == 1.0 and batch["token_level_scores"].sum() == 1.0
    fold_tool_rewards(batch, AgentConfig(tool_reward="none"))
    assert batch["token_level_scores"].sum() == 1.0


def test_a_plugin_tool_is_used_by_name(tiny_tokenizer, tmp_path, monkeypatch):
    from polyrl.manifest import Manifest
    from polyrl.plugins import PluginManager

    (tmp_path / "weather_plugin.py").write_text(textwrap.dedent('''
        from polyrl import hookimpl
        from polyrl.tools import tool

        @tool
        def weather(city: str) -> str:
            """Today's weather.

            Args:
                city: where.
            """
            return f"sunny in {city}"

        @hookimpl
        def register_tools(register):
            register("weather", weather, description="a third-party tool")
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    pm = PluginManager(Manifest(modules=("weather_plugin",)), entry_points=False)
    tools = build_tools(["weather"], pm)
    call = '<tool_call>{"name": "weather", "arguments": {"city": "Oslo"}}</tool_call>'
    tok = tiny_tokenizer
    out = run(make_loop(tok, tools), make_sample(tok), ScriptedClient(tok, [call, "ok"]))
    assert "sunny in Oslo" in tok.decode(out.response_ids)


def test_extras_reach_the_batch():
    import torch

    outs = [AgentLoopOutput([1], [2], [1], [0.0], extra={"score_hint": 0.5, "trace": "a", "emb": torch.ones(3)}),
            AgentLoopOutput([1], [2], [1], [0.0], extra={"score_hint": 1, "trace": {"x": 1}, "emb": torch.zeros(3)})]
    b = collate(outs, pad_token_id=0, max_prompt_length=2, max_response_length=2)
    from polyrl.batch import non_tensor

    assert b["score_hint"].tolist() == [0.5, 1.0] and b["emb"].shape == (2, 3)
    assert non_tensor(b, "trace") == ["a", {"x": 1}]
    with pytest.raises(ValueError, match="'responses' would overwrite"):
        collate([AgentLoopOutput([1], [2], [1], extra={"responses": 1})], pad_token_id=0, max_prompt_length=2,
                max_response_length=2)


def test_a_prompt_with_tool_schemas_longer_than_max_prompt_length_is_a_data_error(tiny_tokenizer, tools):
    """collate would cut the prompt's start, so training would see another context than sampling did."""
    import copy

    tok = copy.deepcopy(tiny_tokenizer)
    tok.chat_template = "{% if tools %}<|system|>{{ tools | tojson }}\n{% endif %}" + tok.chat_template
    sample = make_sample(tok)
    with_tools = tok.apply_chat_template(sample["prompt"], tools=[t.schema for t in tools.values()],
                                         add_generation_prompt=True, tokenize=True)
    with_tools = list(with_tools["input_ids"]) if hasattr(with_tools, "keys") else list(with_tools)
    assert len(with_tools) > len(sample["prompt_ids"]) + 20  # the schemas are in the prompt

    def loop(max_prompt_length):
        return ToolAgentLoop(tokenizer=tok, config=AgentConfig(tools=list(tools), tools_in_prompt=True), tools=tools,
                             parser=HermesParser(), max_prompt_length=max_prompt_length)

    with pytest.raises(DataError) as err:
        run(loop(len(with_tools) - 1), sample, ScriptedClient(tok, ["56088"]))
    message = str(err.value)
    assert "uid u0" in message and f"is {len(with_tools)} tokens" in message
    assert "data.max_prompt_length" in message and "agent.tools_in_prompt" in message
    assert run(loop(len(with_tools)), sample, ScriptedClient(tok, ["56088"])).prompt_ids == with_tools


def test_the_worker_passes_max_prompt_length_to_loops_that_take_it():
    from polyrl.agent_loops import SingleTurnAgentLoop
    from polyrl.trainer.role_worker import _takes_keyword

    assert _takes_keyword(ToolAgentLoop, "max_prompt_length")
    assert not _takes_keyword(SingleTurnAgentLoop, "max_prompt_length")  # the protocol's three arguments only
    assert _takes_keyword(lambda **kwargs: None, "max_prompt_length")


def test_a_rollout_worker_gives_tool_agent_data_max_prompt_length(tiny_model_dir):
    from polyrl.config.schema import PolyrlConfig
    from polyrl.trainer.role_worker import Worker

    config = PolyrlConfig()
    config.actor.model.path = str(tiny_model_dir)
    config.trainer.device = "cpu"
    config.data.max_prompt_length = 77
    worker = Worker(rank=0, world_size=1, config=config, roles=["rollout"], manifest=None)
    try:
        assert worker.agent_loops["tool_agent"].max_prompt_length == 77
        assert "single_turn" in worker.agent_loops  # built with the protocol's three arguments
    finally:
        worker.close()


# ---------------------------------------------------------------------- nothing a model writes ends a run

def env_text(tok, out):
    return tok.decode([t for t, m in zip(out.response_ids, out.response_mask) if not m])


def test_deeply_nested_brackets_are_a_malformed_call(tiny_tokenizer, tools):
    tok = tiny_tokenizer
    nested = "<tool_call>" + "[" * 5000 + "</tool_call>"
    out = run(make_loop(tok, tools), make_sample(tok), ScriptedClient(tok, [nested, "1"]), max_new_tokens=8192)
    assert out.metrics["parse_errors"] == 1 and out.metrics["tool_errors"] == 1 and out.finish_reason == "stop"
    assert "nested too deeply" in env_text(tok, out)


def test_a_parser_that_raises_gives_a_malformed_turn(tiny_tokenizer, tools):
    class Fragile:
        def parse(self, text):
            if "((((" in text:
                raise RecursionError("maximum recursion depth exceeded")
            return HermesParser().parse(text)

    tok = tiny_tokenizer
    out = run(make_loop(tok, tools, parser=Fragile()), make_sample(tok), ScriptedClient(tok, ["((((", "1"]))
    assert out.metrics["parse_errors"] == 1 and out.num_turns == 2 and out.finish_reason == "stop"
    assert "could not be parsed: RecursionError" in env_text(tok, out)


def test_malformed_and_valid_calls_are_answered_in_call_order(tiny_tokenizer, tools):
    tok = tiny_tokenizer
    turn = tool_call_text("1+1") + "<tool_call>{broken</tool_call>" + tool_call_text("2*3")
    out = run(make_loop(tok, tools), make_sample(tok), ScriptedClient(tok, [turn, "ok"]), max_new_tokens=1024)
    env = env_text(tok, out)
    first, error, third = env.index("2\n"), env.index("Error: tool call is not valid JSON"), env.index("6\n")
    assert first < error < third and out.metrics["tool_calls"] == 3 and out.metrics["tool_errors"] == 1


@pytest.mark.parametrize("reward, shown", [(float("nan"), "nan"), ("0.5", "'0.5'"), (float("inf"), "inf")])
def test_a_tool_reward_that_is_not_a_finite_number_names_the_tool(tiny_tokenizer, reward, shown):
    from polyrl.tools import ToolError

    @tool
    def grader(x: int) -> ToolResult:
        """Grade.

        Args:
            x: anything.
        """
        return ToolResult("graded", reward=reward)

    tok = tiny_tokenizer
    call = '<tool_call>{"name": "grader", "arguments": {"x": 1}}</tool_call>'
    with pytest.raises(ToolError, match=rf"tool 'grader' returned ToolResult\(reward={shown}\)") as err:
        run(make_loop(tok, {"grader": grader}), make_sample(tok), ScriptedClient(tok, [call, "a"]))
    assert "reward function" not in str(err.value) and "\n" not in str(err.value)


# ---------------------------------------------------------------------- hung synchronous tools

def test_hung_sync_tools_do_not_starve_later_calls(tiny_tokenizer, caplog):
    """More hung calls than the pool has workers: later calls still run at once; the hung threads are counted
    and a warning names the tool."""
    from polyrl.tools.function import TOOL_EXECUTOR

    release = threading.Event()

    @tool
    def stuck(x: int) -> str:
        """Hangs until released.

        Args:
            x: anything.
        """
        release.wait()
        return "late"

    @tool
    def quick(x: int) -> str:
        """Answers at once.

        Args:
            x: anything.
        """
        return f"quick {x}"

    tok = tiny_tokenizer
    n = TOOL_EXECUTOR.max_workers + 8
    hung_calls = "".join(f'<tool_call>{{"name": "stuck", "arguments": {{"x": {i}}}}}</tool_call>' for i in range(n))
    quick_call = '<tool_call>{"name": "quick", "arguments": {"x": 7}}</tool_call>'
    loop = make_loop(tok, {"stuck": stuck, "quick": quick}, tool_timeout_s=0.5, max_parallel_calls=n, max_turns=3)
    before = TOOL_EXECUTOR.hung
    try:
        start = time.perf_counter()
        out = run(loop, make_sample(tok), ScriptedClient(tok, [hung_calls, quick_call, "done"]), max_new_tokens=8192)
        took = time.perf_counter() - start
        env = env_text(tok, out)
        assert "quick 7" in env, "a call after the hung ones did not run: the pool is exhausted"
        assert env.count("'stuck' timed out after 0.5s") == n and out.metrics["tool_timeouts"] == n
        # every worker is stuck (the calls still queued when they timed out were cancelled, not started)
        assert out.metrics["tools_hung"] >= before + TOOL_EXECUTOR.max_workers and took < 10
        assert "tool 'stuck' did not return" in caplog.text
    finally:
        release.set()
    deadline = time.monotonic() + 10
    while TOOL_EXECUTOR.hung > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert TOOL_EXECUTOR.hung == before  # released threads are no longer counted


def test_a_process_with_a_hung_sync_tool_exits_after_its_last_step(tmp_path):
    """Run an agent loop in-process (as the local executor does) with a sync tool that never returns: the
    process must still exit (the e2e version, through ``polyrl train``, is in integration_tests)."""
    import subprocess
    import sys

    script = tmp_path / "hang.py"
    script.write_text(textwrap.dedent('''
        import asyncio
        import threading
        from polyrl.agent_loops.tool_agent import ToolAgentLoop
        from polyrl.config.schema import AgentConfig
        from polyrl.models.tiny import build_char_tokenizer
        from polyrl.protocols import GenerationResult, SamplingParams
        from polyrl.tools import tool
        from polyrl.tools.parsers import HermesParser

        @tool
        def forever(x: int) -> str:
            """Never returns.

            Args:
                x: anything.
            """
            threading.Event().wait()

        tok = build_char_tokenizer()

        class Client:
            async def agenerate(self, req):
                text = '<tool_call>{"name": "forever", "arguments": {"x": 1}}</tool_call>'
                ids = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
                return [GenerationResult(req.prompt_ids, ids, [0.0] * len(ids))]

        loop = ToolAgentLoop(tokenizer=tok, config=AgentConfig(tool_timeout_s=0.2, max_turns=2),
                             tools={"forever": forever}, parser=HermesParser())
        out = asyncio.run(loop.run({"prompt_ids": [2, 70], "uid": "a"}, SamplingParams(max_new_tokens=512), Client()))
        print("hung", out.metrics["tools_hung"], flush=True)
    '''))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "hung 1.0"
