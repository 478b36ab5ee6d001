"""The ``openai_agent`` loop: unchanged ``openai``-client programs, through the local endpoint, become samples
whose trained tokens are exactly the tokens sampled.

The model here is a scripted generation client (a test double for the rollout: it returns chosen text as token
ids with made-up log-probs, so a program can be driven through tool calls, which a random tiny model would
never write); everything else is real: the HTTP endpoint, the ``openai`` client, the published Qwen2.5 chat
template with a tokenizer holding Qwen's control tokens, the Hermes parser, ``run_agent_loops`` and ``collate``.
The whole run through the trainer with a real model is ``integration_tests/test_openai_agent_e2e.py``.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from pathlib import Path

import pytest

from polyrl.agent_loops import collate, run_agent_loops
from polyrl.agent_loops.openai_agent import OpenAIAgentLoop, episode_samples, load_program
from polyrl.agent_loops.openai_proxy import get_proxy
from polyrl.agent_loops.runner import agent_metrics
from polyrl.config.schema import AgentConfig, OpenAIAgentConfig
from polyrl.errors import ConfigError
from polyrl.protocols import GenerationResult, SamplingParams
from polyrl.tools.parsers import HermesParser

openai = pytest.importorskip("openai")

TEMPLATE = Path(__file__).parent / "chat_templates" / "qwen25.jinja"
ADD_TOOL = {"type": "function", "function": {"name": "add", "description": "a + b", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}


@pytest.fixture(scope="module")
def tok():
    """A tiny byte-level tokenizer with Qwen2.5's control tokens (special and added) and its chat template."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {t: i for i, t in enumerate(special)}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab.setdefault(ch, len(vocab))
    t = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    t.decoder = decoders.ByteLevel()
    t.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in special])
    t.add_tokens([AddedToken(s, special=False, normalized=False)
                  for s in ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]])
    fast = PreTrainedTokenizerFast(tokenizer_object=t, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = TEMPLATE.read_text()
    return fast


class ScriptedClient:
    """The rollout's ``agenerate``: ``script(prompt_text, k)`` is the text of the k-th choice (then EOS, within
    the budget); every result is kept, so a test can compare what was sampled with what is trained."""

    def __init__(self, tok, script):
        self.tok, self.script = tok, script
        self.sampled: list[tuple[list[int], list[int], list[float]]] = []
        self.lock = threading.Lock()

    async def agenerate(self, request):
        prompt = self.tok.decode(request.prompt_ids)
        out = []
        for k in range(request.sampling_params.n):
            ids = self.tok.encode(self.script(prompt, k), add_special_tokens=False) + [self.tok.eos_token_id]
            budget = request.sampling_params.max_new_tokens
            finish = "stop" if len(ids) <= budget else "length"
            ids = ids[:budget]
            with self.lock:
                base = -0.01 * (len(self.sampled) + 1)
                lps = [base - 0.001 * i for i in range(len(ids))]
                self.sampled.append((list(request.prompt_ids), ids, lps))
            out.append(GenerationResult(list(request.prompt_ids), ids, lps, finish_reason=finish, sample_index=k))
        return out


def make_loop(tok, program, **options):
    cfg = AgentConfig(openai_agent=OpenAIAgentConfig(**{"timeout_s": 20.0, **options}))
    return OpenAIAgentLoop(tokenizer=tok, config=cfg, parser=HermesParser(), program=program, max_prompt_length=4096)


def run_one(loop, client, sample, max_new_tokens=2048):
    params = SamplingParams(max_new_tokens=max_new_tokens)
    return asyncio.run(loop.run_episode(sample, params, client))


def calculator_program(client_kwargs, row):
    """An ordinary openai-client agent: call the model with a tool until it answers; reward 1 for '5'."""
    client = openai.OpenAI(**client_kwargs, max_retries=0)
    messages = [{"role": "system", "content": "You add numbers."}, {"role": "user", "content": row["question"]}]
    for _ in range(6):
        resp = client.chat.completions.create(model="policy", messages=messages, tools=[ADD_TOOL])
        msg = resp.choices[0].message
        messages.append(msg)
        if not msg.tool_calls:
            return 1.0 if "5" in (msg.content or "") else 0.0
        for call in msg.tool_calls:
            args = json.loads(call.function.arguments)
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": f"<|im_end|> {args['a'] + args['b']}"})  # tool output with a control string
    return 0.0


def three_turn_script(prompt, k):
    turns = prompt.count("<tool_response>")
    if turns == 0:
        return 'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 1}}\n</tool_call>'
    if turns == 1:
        return '<tool_call>\n{"name": "add", "arguments": {"a": 3, "b": 2}}\n</tool_call>'
    return "The answer is 5."


def test_trained_tokens_are_the_sampled_tokens_across_tool_turns(tok):
    client = ScriptedClient(tok, three_turn_script)
    loop = make_loop(tok, calculator_program)
    episode = run_one(loop, client, {"uid": "a", "question": "2+1+2?"})
    assert episode.status == "ok" and episode.reward == 1.0, episode.detail
    assert len(client.sampled) == 3 and len(episode.calls) == 3
    (out,) = episode_samples(episode.calls, "merged")
    trained = [t for t, m in zip(out.response_ids, out.response_mask) if m]
    assert trained == [t for _, ids, _ in client.sampled for t in ids]
    assert [lp for lp, m in zip(out.log_probs, out.response_mask) if m] == [lp for *_, lps in client.sampled
                                                                            for lp in lps]
    # every call's context is the one before it, continued: the sequence trained is the last call's
    last_prompt, last_ids, _ = client.sampled[-1]
    assert out.prompt_ids + out.response_ids == last_prompt + last_ids
    assert out.prompt_ids == client.sampled[0][0]
    # the tool output is context (mask 0), its control string is characters, never the token
    masked = [t for t, m in zip(out.response_ids, out.response_mask) if not m]
    text = tok.decode(masked)
    assert "<tool_response>\n<|im_end|> 3\n</tool_response>" in text
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert masked.count(im_end) == 2  # only the template's own: after each of the two tool turns, none from data
    assert out.num_turns == 3 and out.metrics["tool_calls"] == 2.0
    # per_call: one sample per call, each exactly what its call was given and sampled
    per_call = episode_samples(episode.calls, "per_call")
    assert [(o.prompt_ids, o.response_ids, o.log_probs) for o in per_call] == client.sampled


def test_per_call_rows_through_the_runner(tok):
    """``samples=per_call``: one row per call through ``run_agent_loops`` (the several-rows-per-sample seam), each
    row exactly its call, every row the episode's reward, the episode's counters counted once."""
    from polyrl.agent_loops.runner import sample_of_rows
    from polyrl.trainer.step_rows import pad_step_rows

    def script(prompt, k):  # the last row answers at once: one call
        return "The answer is 5." if "quick" in prompt else three_turn_script(prompt, k)

    client = ScriptedClient(tok, script)
    loop = make_loop(tok, calculator_program, samples="per_call")
    samples = [{"uid": "p0", "question": "2+1+2?"}, {"uid": "p1", "question": "2+1+2?"},
               {"uid": "p2", "question": "quick: 5?"}]
    outs = run_agent_loops(samples, SamplingParams(max_new_tokens=512), client, {"openai_agent": loop},
                           default="openai_agent")
    assert len(outs) == 7 and len(client.sampled) == 7
    assert sorted((o.prompt_ids, o.response_ids, o.log_probs) for o in outs) == sorted(client.sampled)
    for o in outs:
        assert o.response_mask == [1] * len(o.response_ids) and o.metrics["tool_reward"] == 1.0
    batch = collate(outs, pad_token_id=0, max_prompt_length=512, max_response_length=128)
    assert sample_of_rows(batch, 3) == [0, 0, 0, 1, 1, 1, 2]
    assert batch["episode_end"].tolist() == [0, 0, 1, 0, 0, 1, 1]
    metrics = agent_metrics(batch)
    assert metrics["agent/model_calls/total"] == 7.0 and metrics["env/episodes"] == 3.0
    assert metrics["env/steps/mean"] == pytest.approx(7 / 3) and metrics["env/success_rate"] == 1.0
    # the trainer pads step rows to whole mini-batches with copies of the last row: they count nothing
    padded = pad_step_rows(batch, 12)
    assert padded.batch_size[0] == 12
    assert agent_metrics(padded)["agent/model_calls/total"] == 7.0
    # a call whose prompt outgrows data.max_prompt_length is refused (it would be cut in the batch)
    short = make_loop(tok, calculator_program, samples="per_call")
    short.max_prompt_length = len(client.sampled[0][0]) + 10
    episode = run_one(short, ScriptedClient(tok, three_turn_script), {"uid": "q", "question": "2+1+2?"})
    assert episode.status == "raised" and "data.max_prompt_length is" in episode.detail
    assert "samples=per_call" in episode.detail


def test_the_program_sees_tool_calls_and_the_first_prompt_is_the_template(tok):
    seen = {}

    def program(client_kwargs, row):
        client = openai.OpenAI(**client_kwargs, max_retries=0)
        resp = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                              tools=[ADD_TOOL])
        seen["resp"] = resp
        return 0.5

    client = ScriptedClient(tok, three_turn_script)
    episode = run_one(make_loop(tok, program), client, {"uid": "b"})
    resp = seen["resp"]
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me add."
    (call,) = choice.message.tool_calls
    assert call.function.name == "add" and json.loads(call.function.arguments) == {"a": 2, "b": 1}
    assert re.fullmatch(r"[A-Za-z0-9]{9}", call.id)
    expected = tok.apply_chat_template([{"role": "user", "content": "hi"}], tools=[ADD_TOOL],
                                       add_generation_prompt=True, tokenize=True)
    expected = list(expected["input_ids"]) if hasattr(expected, "keys") else list(expected)
    assert client.sampled[0][0] == expected
    assert resp.usage.prompt_tokens == len(expected) and resp.usage.completion_tokens == len(client.sampled[0][1])
    assert episode.reward == 0.5


def test_a_program_that_edits_the_history_starts_a_new_sample(tok):
    def program(client_kwargs, row):
        client = openai.OpenAI(**client_kwargs, max_retries=0)
        messages = [{"role": "user", "content": "q"}]
        first = client.chat.completions.create(model="m", messages=messages).choices[0].message
        # continues honestly once ...
        messages += [{"role": "assistant", "content": first.content}, {"role": "user", "content": "more"}]
        second = client.chat.completions.create(model="m", messages=messages).choices[0].message
        # ... then puts words in the model's mouth
        messages += [{"role": "assistant", "content": second.content + " (edited)"}, {"role": "user", "content": "x"}]
        client.chat.completions.create(model="m", messages=messages)
        return 1.0

    client = ScriptedClient(tok, lambda prompt, k: f"reply {prompt.count('<|im_start|>user')}")
    loop = make_loop(tok, program)
    episode = run_one(loop, client, {"uid": "c"})
    assert episode.counters["history_edits"] == 1.0
    assert [c.parent for c in episode.calls] == [None, 0, None]  # the edited call starts a chain of its own
    out = loop.to_output(episode, {"uid": "c"})
    assert out.extra["agent_history_edits"] == 1.0 and out.extra["agent_calls_not_trained"] == 1.0
    # the longest chain is trained; the edited call's prompt is a fresh rendering holding the edit
    assert "(edited)" in tok.decode(episode.calls[2].prompt_ids)
    assert "(edited)" not in tok.decode(out.prompt_ids + out.response_ids)
    trained = [t for t, m in zip(out.response_ids, out.response_mask) if m]
    assert trained == client.sampled[0][1] + client.sampled[1][1]


def test_fifty_concurrent_trajectories_never_cross(tok):
    def program(client_kwargs, row):
        client = openai.OpenAI(**client_kwargs, max_retries=0)
        messages = [{"role": "user", "content": f"id={row['uid']}"}]
        for _ in range(2):
            msg = client.chat.completions.create(model="m", messages=messages).choices[0].message
            assert msg.content == f"echo {row['uid']}", (msg.content, row["uid"])
            messages += [msg, {"role": "user", "content": f"again id={row['uid']}"}]
        return float(row["uid"][1:])

    def echo(prompt, k):
        return "echo " + re.findall(r"id=(u\d+)", prompt)[-1]

    client = ScriptedClient(tok, echo)
    loop = make_loop(tok, program)
    samples = [{"uid": f"u{i}"} for i in range(50)]
    t0 = time.perf_counter()
    outs = run_agent_loops(samples, SamplingParams(max_new_tokens=256), client, {"openai_agent": loop},
                           default="openai_agent")
    assert time.perf_counter() - t0 < 60
    assert len(client.sampled) == 100
    for i, out in enumerate(outs):
        assert out.metrics["tool_reward"] == float(i)  # each program's own reward, in row order
        text = tok.decode(out.prompt_ids + out.response_ids)
        assert set(re.findall(r"u\d+", text)) == {f"u{i}"}
        assert out.num_turns == 2 and out.extra["agent_history_edits"] == 0.0
    batch = collate(outs, pad_token_id=0, max_prompt_length=64, max_response_length=128)
    metrics = agent_metrics(batch)
    assert metrics["agent/model_calls/total"] == 100.0 and metrics["agent/program_raised/total"] == 0.0


def test_keys_are_per_trajectory_and_expire(tok):
    proxy = get_proxy()
    assert proxy.base_url.startswith("http://127.0.0.1:")
    seen = {}

    def program(client_kwargs, row):
        seen["kwargs"] = client_kwargs
        client = openai.OpenAI(**client_kwargs, max_retries=0)
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
        bad = openai.OpenAI(base_url=client_kwargs["base_url"], api_key="polyrl-guess", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
        return 1.0

    episode = run_one(make_loop(tok, program), ScriptedClient(tok, lambda p, k: "ok"), {"uid": "k"})
    assert episode.status == "ok", episode.detail
    late = openai.OpenAI(**seen["kwargs"], max_retries=0)  # the episode is over: its key is revoked
    with pytest.raises(openai.AuthenticationError):
        late.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    assert get_proxy() is proxy  # one endpoint per process, reused


def test_streaming_n_stop_and_max_tokens(tok):
    seen = {}

    def program(client_kwargs, row):
        client = openai.OpenAI(**client_kwargs, max_retries=0)
        msgs = [{"role": "user", "content": "count"}]
        seen["n"] = client.chat.completions.create(model="m", messages=msgs, n=3)
        seen["stop"] = client.chat.completions.create(model="m", messages=msgs, stop=["three"])
        seen["max"] = client.chat.completions.create(model="m", messages=msgs, max_tokens=4)
        stream = client.chat.completions.create(model="m", messages=msgs, tools=[ADD_TOOL], stream=True,
                                                stream_options={"include_usage": True})
        seen["chunks"] = list(stream)
        return 0.0

    def script(prompt, k):
        return '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 1}}\n</tool_call>' if "add" in prompt \
            else f"one two three four {k}"

    client = ScriptedClient(tok, script)
    episode = run_one(make_loop(tok, program), client, {"uid": "s"})
    assert episode.status == "ok", episode.detail
    assert [c.message.content for c in seen["n"].choices] == [f"one two three four {k}" for k in range(3)]
    stop = seen["stop"].choices[0]
    assert stop.message.content == "one two " and stop.finish_reason == "stop"
    # the recorded call keeps the sampled tokens up to the end of the stop string, no further
    stop_call = episode.calls[3]
    assert tok.decode(stop_call.response_ids) == "one two three"
    mx = seen["max"].choices[0]
    assert mx.finish_reason == "length" and mx.message.content == "one " and len(episode.calls[4].response_ids) == 4
    chunks = seen["chunks"]
    calls = [tc for ch in chunks for c in ch.choices for tc in (c.delta.tool_calls or [])]
    assert len(calls) == 1 and calls[0].function.name == "add"
    assert [c.finish_reason for ch in chunks for c in ch.choices if c.finish_reason] == ["tool_calls"]
    assert chunks[-1].usage.completion_tokens == len(episode.calls[5].response_ids)


@pytest.mark.timeout(60)
def test_bad_programs_are_counted_named_and_the_run_goes_on(tok, caplog):
    def raises(client_kwargs, row):
        openai.OpenAI(**client_kwargs, max_retries=0).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "x"}])
        raise ValueError("the agent broke")

    def hangs(client_kwargs, row):
        openai.OpenAI(**client_kwargs, max_retries=0).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "x"}])
        time.sleep(5)
        return 1.0

    def silent(client_kwargs, row):
        return 1.0

    def not_a_number(client_kwargs, row):
        openai.OpenAI(**client_kwargs, max_retries=0).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "x"}])
        return "great"

    def malformed(client_kwargs, row):
        client = openai.OpenAI(**client_kwargs, max_retries=0)
        errors = []
        for kwargs in ({"n": 99}, {"response_format": {"type": "json_object"}}, {"tool_choice": "required",
                                                                               "tools": [ADD_TOOL]}):
            try:
                client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}], **kwargs)
            except openai.BadRequestError as exc:
                errors.append(str(exc))
        try:
            client.chat.completions.create(model="m", messages=[{"role": "robot", "content": "x"}])
        except openai.BadRequestError as exc:
            errors.append(str(exc))
        assert len(errors) == 4, errors
        assert "'n'" in errors[0] and "'response_format' is not supported" in errors[1]
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
        return {"reward": 0.25}

    async def async_program(client_kwargs, row):
        client = openai.AsyncOpenAI(**client_kwargs, max_retries=0)
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
        return 0.75

    programs = {"raised": raises, "timeouts": hangs, "no_calls": silent, "bad_reward": not_a_number,
                "ok": malformed, "async": async_program}
    client = ScriptedClient(tok, lambda p, k: "fine")
    results = {}
    for name, program in programs.items():
        loop = make_loop(tok, program, timeout_s=1.5, on_error="drop", error_score=-1.0)
        with caplog.at_level("WARNING", logger="polyrl"):
            episode = run_one(loop, client, {"uid": name, "prompt_ids": [5, 6]})
        results[name] = (episode, loop.to_output(episode, {"uid": name, "prompt_ids": [5, 6]}))
    for status in ("raised", "timeouts", "no_calls", "bad_reward"):
        episode, out = results[status]
        assert episode.status == status
        assert out.extra[f"agent_program_{status}"] == 1.0
        assert out.metrics["tool_reward"] == -1.0 and not any(out.response_mask)  # dropped: trains nothing
    assert "the agent broke" in results["raised"][0].detail
    assert "ValueError: the agent broke" in caplog.text and "returned a non-number" in caplog.text
    episode, out = results["ok"]
    assert episode.status == "ok" and episode.reward == 0.25, episode.detail
    assert out.extra["agent_bad_requests"] == 4.0 and any(out.response_mask)
    assert results["async"][0].reward == 0.75
    # on_error=score keeps the tokens and gives error_score
    loop = make_loop(tok, not_a_number, on_error="score", error_score=0.0)
    out = loop.to_output(run_one(loop, client, {"uid": "z"}), {"uid": "z"})
    assert out.metrics["tool_reward"] == 0.0 and any(out.response_mask)


def test_budget_and_config_errors(tok):
    def long_chat(client_kwargs, row):
        client = openai.OpenAI(**client_kwargs, max_retries=0)
        messages = [{"role": "user", "content": "go"}]
        for _ in range(10):
            try:
                msg = client.chat.completions.create(model="m", messages=messages).choices[0].message
            except openai.BadRequestError as exc:
                return 1.0 if "max_response_length" in str(exc) else 0.0
            messages += [msg, {"role": "user", "content": "and"}]
        return 0.0

    client = ScriptedClient(tok, lambda p, k: "x" * 10)
    loop = make_loop(tok, long_chat)
    episode = run_one(loop, client, {"uid": "b"}, max_new_tokens=60)
    assert episode.reward == 1.0
    out = loop.to_output(episode, {})
    assert len(out.response_ids) <= 60 + 40  # the budget bounds the sampled part; no turn beyond it was sampled
    assert sum(out.response_mask) <= 60
    with pytest.raises(ConfigError, match="agent.openai_agent.run"):
        load_program("no_colon_here")
    with pytest.raises(ConfigError, match="has no function 'nope'"):
        load_program("json:nope")
    with pytest.raises(ConfigError, match="samples"):
        run_one(make_loop(tok, long_chat, samples="best"), client, {"uid": "x"})
    assert load_program("json:dumps") is json.dumps


def test_an_openai_agents_sdk_program_unchanged(tok):
    """The example agent written with the OpenAI Agents SDK (a real framework: Agent, @function_tool, Runner)
    goes through the endpoint: its tool call is parsed, run by the SDK, and its answer trained token for token."""
    pytest.importorskip("agents")
    example = Path(__file__).resolve().parents[4] / "examples" / "openai_agent" / "agents_sdk_agent.py"
    program = load_program(f"{example}:run")

    def script(prompt, k):
        if "<tool_response>" not in prompt:
            return '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3*4"}}\n</tool_call>'
        return "14"

    client = ScriptedClient(tok, script)
    row = {"uid": "sdk", "prompt": [{"role": "system", "content": "Use the calculator."},
                                    {"role": "user", "content": "2+3*4=?"}], "extra_info": {"answer": 14}}
    episode = run_one(make_loop(tok, program), client, row)
    assert episode.status == "ok" and episode.reward == 1.0, episode.detail
    assert len(episode.calls) == 2 and episode.calls[1].parent == 0  # the SDK sent the history back unchanged
    assert "<tool_response>\n14\n</tool_response>" in tok.decode(episode.calls[1].delta_ids)
    (out,) = episode_samples(episode.calls, "merged")
    assert [t for t, m in zip(out.response_ids, out.response_mask) if m] == [t for _, ids, _ in client.sampled
                                                                            for t in ids]
