"""Tool-call parsers on the situations vLLM's and verl's parser tests cover (our own cases), typing by schema,
call order, and fuzzing: nothing a model writes makes a parser raise."""

from __future__ import annotations

import asyncio
import json
from typing import Literal, Optional

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from polyrl.tools import tool
from polyrl.tools.parsers import HermesParser, Llama3JsonParser, ParsedTurn, Qwen3CoderParser, ToolCall

PARSERS = [HermesParser(), Qwen3CoderParser(), Llama3JsonParser()]


def fn_schema(name: str, **props: dict) -> dict:
    return {"type": "function", "function": {"name": name, "description": "d",
                                             "parameters": {"type": "object", "properties": props}}}


# ---------------------------------------------------------------------- qwen3_coder

WEATHER = fn_schema("get_weather", city={"type": "string"}, zip={"type": "string"}, days={"type": "integer"},
                    unit={"type": "string", "enum": ["c", "f"]})
AREA = fn_schema("area", shape={"type": "string"}, dims={"type": "object"}, precision={"type": "integer"},
                 scale={"type": "number"}, exact={"type": "boolean"}, tags={"type": "array"})
TOOLS = {"get_weather": WEATHER, "area": AREA}


def xml_call(name: str, **params: str) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def test_qwen3_coder_types_values_by_the_schema():
    turn = Qwen3CoderParser().parse(
        xml_call("get_weather", city="Dallas", zip="07030", days="3", unit="c")
        + xml_call("area", shape="circle", dims='{"width": 10,\n "height": 20}', precision="2", scale="1.5",
                   exact="True", tags='["a", "b"]'), tools=TOOLS)
    assert not turn.errors
    weather, area = turn.calls
    # a string parameter keeps its text even when it looks like a number
    assert weather.arguments == {"city": "Dallas", "zip": "07030", "days": 3, "unit": "c"}
    assert area.arguments == {"shape": "circle", "dims": {"width": 10, "height": 20}, "precision": 2,
                              "scale": 1.5, "exact": True, "tags": ["a", "b"]}
    assert isinstance(area.arguments["precision"], int) and isinstance(area.arguments["scale"], float)


@pytest.mark.parametrize("schema, raw, value", [
    ({"anyOf": [{"type": "integer"}, {"type": "null"}]}, "5", 5),
    ({"anyOf": [{"type": "integer"}, {"type": "null"}]}, "null", None),
    ({"type": ["integer", "null"]}, "42", 42),
    ({"anyOf": [{"type": "string"}, {"type": "integer"}, {"type": "null"}]}, "12", "12"),  # first non-null: string
    ({"anyOf": [{"type": "object"}, {"type": "null"}]}, '{"key": "value", "count": 42}', {"key": "value", "count": 42}),
    ({"type": "object"}, "{'a': 1, 'b': True}", {"a": 1, "b": True}),  # a Python literal
    ({"type": "number"}, "2", 2),
    ({"type": "number"}, "1e3", 1000.0),
    ({"type": "integer"}, "three", "three"),  # does not convert: stays text, the schema check reports it
    ({"type": "number"}, "nan", "nan"),
    ({"type": "boolean"}, "yes", "yes"),
    ({"enum": ["x", "y"]}, "1", "1"),
    ({"type": "string"}, "null", "null"),
])
def test_qwen3_coder_typing_cases(schema, raw, value):
    tools = {"f": fn_schema("f", p=schema)}
    (call,) = Qwen3CoderParser().parse(xml_call("f", p=raw), tools=tools).calls
    assert call.arguments["p"] == value and type(call.arguments["p"]) is type(value)


def test_qwen3_coder_keeps_a_values_newlines():
    code = "def f():\n\n    return 1\n\nprint(f())\n"
    (call,) = Qwen3CoderParser().parse(f"<tool_call><function=python><parameter=code>\n{code}\n</parameter>"
                                       "</function></tool_call>", tools={"python": fn_schema(
                                           "python", code={"type": "string"})}).calls
    assert call.arguments["code"] == code
    (call,) = Qwen3CoderParser().parse("<tool_call><function=g><parameter=s>no newlines</parameter></function>"
                                       "</tool_call>").calls
    assert call.arguments == {"s": "no newlines"}


def test_qwen3_coder_does_not_merge_two_functions_in_one_call_block():
    text = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nDallas\n</parameter>\n</function>\n"
            "<function=area>\n<parameter=shape>\nsquare\n</parameter>\n</function>\n</tool_call>")
    turn = Qwen3CoderParser().parse(text, tools=TOOLS)
    assert turn.calls == [ToolCall("get_weather", {"city": "Dallas"}), ToolCall("area", {"shape": "square"})]


def test_qwen3_coder_situations():
    p = Qwen3CoderParser()
    plain = "This is a test response without any tool calls"
    assert p.parse(plain) == ParsedTurn(plain)
    turn = p.parse("Sure! Let me check." + xml_call("get_weather", city="Dallas") + "\n"
                   + xml_call("get_weather", city="Orlando"), tools=TOOLS)
    assert turn.content == "Sure! Let me check." and [c.arguments["city"] for c in turn.calls] == ["Dallas", "Orlando"]
    # a function without a <tool_call> around it
    assert p.parse("<function=get_weather>\n<parameter=city>\nDallas\n</parameter>\n</function>").calls == [
        ToolCall("get_weather", {"city": "Dallas"})]
    # a </parameter> left out ends at the next <parameter=
    turn = p.parse("<tool_call>\n<function=get_weather>\n<parameter=city>\nDallas\n<parameter=unit>\nc\n"
                   "</parameter>\n</function>\n</tool_call>", tools=TOOLS)
    assert turn.calls == [ToolCall("get_weather", {"city": "Dallas", "unit": "c"})]
    # '<function=name' without '>' is an error for that call only; the next call still runs
    turn = p.parse("<tool_call>\n<function=bad\n</function>\n</tool_call>\n" + xml_call("get_weather", city="X"))
    assert len(turn.errors) == 1 and turn.calls == [ToolCall("get_weather", {"city": "X"})]
    assert [type(i) for i in turn.in_order()] == [str, ToolCall]
    assert "given twice" in p.parse(xml_call("f", a="1") .replace("</function>", "<parameter=a>2</parameter>"
                                                                  "</function>")).errors[0]


# ---------------------------------------------------------------------- llama3_json

@pytest.mark.parametrize("sep", ["; ", ";", ";\n", "\n", " ; "])
def test_llama3_json_several_calls(sep):
    text = '{"name": "search", "parameters": {"query": "a;b; c"}}' + sep + '{"name": "incidents", "parameters": {}}'
    turn = Llama3JsonParser().parse(text)
    assert turn.calls == [ToolCall("search", {"query": "a;b; c"}), ToolCall("incidents", {})] and not turn.errors


def test_llama3_json_does_not_split_inside_a_value():
    text = '<|python_tag|>{"name": "sql", "parameters": {"q": "select 1; drop table t; -- {x}"}}'
    assert Llama3JsonParser().parse(text).calls == [ToolCall("sql", {"q": "select 1; drop table t; -- {x}"})]


def test_llama3_json_situations():
    p = Llama3JsonParser()
    assert p.parse('{"name": "s", "arguments": {"q": "t"}}').calls == [ToolCall("s", {"q": "t"})]
    assert p.parse("This is just text").content == "This is just text" and not p.parse("6").has_calls
    deep = '{"name": "c", "parameters": {"l1": {"l2": {"l3": {"l4": {"value": "deep"}}}}}}'
    assert p.parse(deep).calls[0].arguments["l1"]["l2"]["l3"]["l4"]["value"] == "deep"
    quoted = '{"name": "p", "parameters": {"text": "He said \\"Hello {world}\\" [ok]"}}'
    assert p.parse(quoted).calls[0].arguments == {"text": 'He said "Hello {world}" [ok]'}
    turn = p.parse('{"name": "s", "parameters": {"q": "t"}} I used {s} for this.')
    assert turn.calls == [ToolCall("s", {"q": "t"})] and turn.content == "I used {s} for this."
    assert p.parse('[{"name": "a", "parameters": {}}, {"name": "b", "parameters": {"x": 1}}]').calls == [
        ToolCall("a", {}), ToolCall("b", {"x": 1})]
    assert "string 'name'" in p.parse('{"parameters": {}}').errors[0]
    assert "not valid JSON" in p.parse('{"name": "bad", "parameters": {invalid}}').errors[0]
    assert "not valid JSON" in p.parse('{"name": "n", "parameters": {"x": NaN}}').errors[0]
    # a malformed second call: the first still runs, the error answers second
    turn = p.parse('{"name": "a", "parameters": {}}; {"name": "b", "parameters": {oops}}')
    assert turn.calls == [ToolCall("a", {})] and [type(i) for i in turn.in_order()] == [ToolCall, str]


# ---------------------------------------------------------------------- hermes and call order

def test_hermes_situations():
    p = HermesParser()
    turn = p.parse('Let me look. <tool_call>{"name": "a", "arguments": {"x": 1}, "id": "abcdefghi"}</tool_call>'
                   '<tool_call>{"name": "b", "arguments": "{\\"y\\": [1, 2]}"}</tool_call>')
    assert turn.calls == [ToolCall("a", {"x": 1}, "abcdefghi"), ToolCall("b", {"y": [1, 2]})]
    assert turn.content == "Let me look."
    assert "not valid JSON" in p.parse('<tool_call>{"name": "a", "arguments": {"x": Infinity}}</tool_call>').errors[0]
    assert "never closed" in p.parse('<tool_call>{"name": "a"').errors[0]


@pytest.mark.parametrize("parser, good, bad", [
    (HermesParser(), '<tool_call>{{"name": "{n}", "arguments": {{}}}}</tool_call>', "<tool_call>{{oops</tool_call>"),
    (Qwen3CoderParser(), "<tool_call><function={n}></function></tool_call>", "<tool_call>nothing</tool_call>"),
])
def test_malformed_and_valid_calls_keep_the_models_order(parser, good, bad):
    turn = parser.parse(good.format(n="first") + bad.format() + good.format(n="third"))
    order = turn.in_order()
    assert [getattr(i, "name", "error") for i in order] == ["first", "error", "third"]


# ---------------------------------------------------------------------- nothing a model writes makes a parser raise

@pytest.mark.parametrize("parser", PARSERS, ids=lambda p: type(p).__name__)
@pytest.mark.parametrize("text", [
    "<tool_call>" + "[" * 100_000 + "</tool_call>",
    "[" * 100_000,
    "{" + '"a":{' * 50_000,
    '<tool_call>{"name": "a", "arguments": {"n": ' + "1" * 5000 + "}}</tool_call>",  # int digits limit
    '{"name": "a", "parameters": {"n": ' + "9" * 5000 + "}}",
    "<tool_call><function=f><parameter=x>" + "[" * 100_000 + "</parameter></function></tool_call>",
    "<tool_call><function=f><parameter=x>" + "{'a': " * 5000 + "</parameter></function></tool_call>",
    "<tool_call><function=f><parameter=x>" + "7" * 5000 + "</parameter></function></tool_call>",
    "\x00\ud800<tool_call>\udfff</tool_call>",
])
def test_adversarial_turns_are_malformed_calls_not_exceptions(parser, text):
    tools = {"f": fn_schema("f", x={"type": "object"})}
    turn = parser.parse(text, tools=tools)
    _check_turn(turn)


def _check_turn(turn: ParsedTurn) -> None:
    assert isinstance(turn, ParsedTurn) and isinstance(turn.content, str)
    assert all(isinstance(c, ToolCall) and isinstance(c.name, str) and isinstance(c.arguments, dict)
               for c in turn.calls)
    assert all(isinstance(e, str) for e in turn.errors)
    assert len(turn.in_order()) == len(turn.calls) + len(turn.errors)


_FRAGMENTS = st.sampled_from([
    "<tool_call>", "</tool_call>", "<function=f>", "<function=", "</function>", "<parameter=x>", "<parameter=",
    "</parameter>", "<|python_tag|>", "{", "}", "[", "]", '"', "'", ":", ",", ";", "\\", "\n", " ", "name",
    '"name"', '"arguments"', '"parameters"', '"f"', "null", "true", "NaN", "-Infinity", "1e999", "0" * 30, "{'a': ",
    "\ud800", "\x00",
])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.one_of(_FRAGMENTS, st.text(max_size=8)), max_size=60))
def test_fuzzed_turns_never_raise(pieces):
    text = "".join(pieces)
    tools = {"f": fn_schema("f", x={"type": "object"}, y={"type": "integer"}, z={"anyOf": [{"type": "boolean"},
                                                                                         {"type": "null"}]})}
    for parser in PARSERS:
        _check_turn(parser.parse(text, tools=tools))


@settings(max_examples=100, deadline=None)
@given(st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=5),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
                    max_leaves=20), st.sampled_from(["arguments", "parameters"]))
def test_fuzzed_valid_json_calls_round_trip(arguments, key):
    """Any JSON object written as arguments comes back unchanged (hermes, llama3_json)."""
    args = {"v": arguments}
    call = json.dumps({"name": "f", key: args})
    if key == "arguments":
        assert HermesParser().parse(f"<tool_call>{call}</tool_call>").calls == [ToolCall("f", args)]
    assert Llama3JsonParser().parse(call).calls == [ToolCall("f", args)]


# ---------------------------------------------------------------------- @tool Optional parameters

def test_optional_parameters_accept_null():
    @tool
    def search(query: str, limit: Optional[int] = None, mode: Literal["a", "b"] | None = None,  # noqa: UP045
               tags: list[str] | None = None) -> str:
        """Search.

        Args:
            query: what.
            limit: how many.
            mode: how.
            tags: labels.
        """
        return f"{query}:{limit}:{mode}:{tags}"

    props = search.schema["function"]["parameters"]["properties"]
    assert props["limit"]["type"] == ["integer", "null"] and props["mode"]["enum"] == ["a", "b", None]
    out = asyncio.run(search.execute({"query": "q", "limit": None, "mode": None, "tags": None}, {}))
    assert out.text == "q:None:None:None"
    assert asyncio.run(search.execute({"query": "q", "limit": 3, "mode": "b"}, {})).text == "q:3:b:None"
    with pytest.raises(ValueError, match="is not one of"):
        asyncio.run(search.execute({"query": "q", "mode": "c"}, {}))
