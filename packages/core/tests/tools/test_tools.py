"""Tools: the @tool decorator's schemas, schema validation, the calculator, the parsers, loading by config."""

from __future__ import annotations

import asyncio
from typing import Literal

import pytest

from polyrl.errors import ConfigError
from polyrl.protocols import ToolResult
from polyrl.tools import FunctionTool, ToolSchemaError, build_tools, tool, validate_tool_schema
from polyrl.tools.builtin import calculator, evaluate_arithmetic
from polyrl.tools.parsers import HermesParser, Llama3JsonParser, Qwen3CoderParser, ToolCall


def test_schema_from_signature_and_docstring():
    @tool
    def lookup(city: str, days: int = 1, unit: Literal["c", "f"] = "c", tags: list[str] | None = None) -> str:
        """Weather forecast for a city.

        More text that is not the description.

        Args:
            city: The city's name,
                in English.
            days: How many days.
            unit: Celsius or Fahrenheit.
            tags: Extra labels.

        Returns:
            A sentence.
        """
        return city

    fn = lookup.schema["function"]
    assert lookup.name == "lookup" and fn["description"] == "Weather forecast for a city."
    params = fn["parameters"]
    assert params["required"] == ["city"]
    assert params["properties"]["city"] == {"type": "string", "description": "The city's name, in English."}
    assert params["properties"]["days"] == {"type": "integer", "description": "How many days.", "default": 1}
    assert params["properties"]["unit"]["enum"] == ["c", "f"]
    assert params["properties"]["tags"]["type"] == ["array", "null"]  # Optional: null is a valid value
    assert params["properties"]["tags"]["items"] == {"type": "string"}


def test_decorator_errors_name_the_function():
    def undocumented(x: int) -> str:
        return ""

    with pytest.raises(ToolSchemaError, match="undocumented.*needs a docstring"):
        tool(undocumented)

    def weird(x: complex) -> str:
        """Doc."""

    with pytest.raises(ToolSchemaError, match="parameter 'x': cannot express type"):
        tool(weird)


@pytest.mark.parametrize("schema, message", [
    ({"type": "function", "function": {"name": "bad name!", "parameters": {"type": "object"}}}, "must match"),
    ({"name": "f", "parameters": {"type": "array"}}, "type 'object'"),
    ({"name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "integr"}}}}, "not valid JSON Schema"),
    ({"name": "f", "parameters": {"type": "object", "properties": {"x": {"minimum": "zero"}}}}, "not valid JSON Schema"),
    ({"name": "f", "parameters": {"type": "object", "properties": {}, "required": ["x"]}}, "not in its properties"),
    ("not a schema", "must be a mapping"),
])
def test_invalid_schemas_are_rejected(schema, message):
    with pytest.raises(ToolSchemaError, match=message):
        validate_tool_schema(schema, "my_tool")


def test_explicit_schema_and_argument_checking():
    schema = {"name": "add", "description": "Add.", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}
    add = FunctionTool(lambda a, b: a + b, name="add", schema=schema)
    assert asyncio.run(add.execute({"a": 2, "b": 3}, {})) == ToolResult("5")
    with pytest.raises(ValueError, match="'a' is a required property"):
        asyncio.run(add.execute({"b": 3}, {}))
    with pytest.raises(ValueError, match="at a: 'x' is not of type 'integer'"):
        asyncio.run(add.execute({"a": "x", "b": 3}, {}))


@pytest.mark.parametrize("expr, value", [("123*456", 56088), ("(2+3)/4", 1.25), ("-7//2", -4), ("2**10", 1024),
                                         ("10 % 3", 1), ("1.5*2", 3.0)])
def test_calculator(expr, value):
    assert evaluate_arithmetic(expr) == value
    assert asyncio.run(calculator.execute({"expression": expr}, {})).text == str(value).removesuffix(".0")


@pytest.mark.parametrize("expr, message", [
    ("__import__('os').system('true')", "not allowed"), ("abs(-1)", "not allowed"), ("x + 1", "not allowed"),
    ("(1).__class__", "not allowed"), ("9**9**9", "too large"), ("1/0", "division by zero"), ("1 +", "not an arithmetic"),
    ("'a' * 3", "not allowed"), ("(-8) ** 0.5", "not a real number"), ("1" * 600, "longer than 500"),
])
def test_calculator_rejects_everything_but_arithmetic(expr, message):
    with pytest.raises(ValueError, match=message):
        evaluate_arithmetic(expr)


# ---------------------------------------------------------------------- parsers

def test_hermes():
    turn = HermesParser().parse('Let me compute. <tool_call>{"name": "calc", "arguments": {"e": "1+1"}}</tool_call>\n'
                                '<tool_call>{"name": "py", "arguments": "{\\"code\\": \\"x\\"}"}</tool_call>')
    assert turn.calls == [ToolCall("calc", {"e": "1+1"}), ToolCall("py", {"code": "x"})]
    assert turn.content == "Let me compute." and not turn.errors
    assert not HermesParser().parse("42").has_calls


def test_qwen3_coder_xml():
    text = ("<tool_call>\n<function=python>\n<parameter=code>\nprint(1 < 2)\n</parameter>\n<parameter=n>\n3\n"
            "</parameter>\n</function>\n</tool_call>")
    turn = Qwen3CoderParser().parse(text)
    assert turn.calls == [ToolCall("python", {"code": "print(1 < 2)", "n": 3})] and not turn.errors
    # a </parameter> the model left out ends at </function> (as vLLM's parser reads it)
    assert Qwen3CoderParser().parse("<tool_call><function=f><parameter=x>1</function></tool_call>").calls == [
        ToolCall("f", {"x": 1})]
    bad = Qwen3CoderParser().parse("<tool_call><function=f><parameter=x>1</parameter></tool_call>")
    assert bad.errors and "not closed with </function>" in bad.errors[0]
    assert "must hold <function=NAME>" in Qwen3CoderParser().parse("<tool_call>f(1)</tool_call>").errors[0]


def test_llama3_json():
    p = Llama3JsonParser()
    assert p.parse('{"name": "calc", "parameters": {"e": "2*3"}}').calls == [ToolCall("calc", {"e": "2*3"})]
    assert p.parse('<|python_tag|>{"name": "a", "arguments": {}}; {"name": "b", "parameters": {"x": 1}}').calls == [
        ToolCall("a", {}), ToolCall("b", {"x": 1})]
    assert p.parse("The answer is 6.").content == "The answer is 6." and not p.parse("6").has_calls
    assert "not valid JSON" in p.parse('{"name": "calc", "parameters": {').errors[0]
    assert "string 'name'" in p.parse('{"parameters": {}}').errors[0]


def test_parsers_are_registered(polyrl_plugin_manager):
    for name, cls in [("hermes", HermesParser), ("qwen3_coder", Qwen3CoderParser), ("xml", Qwen3CoderParser),
                      ("llama3_json", Llama3JsonParser), ("json", Llama3JsonParser)]:
        assert isinstance(polyrl_plugin_manager.get("tool_parser", name)(), cls)
    with pytest.raises(LookupError, match="unknown tool_parser 'hermez'. Did you mean 'hermes'"):
        polyrl_plugin_manager.get("tool_parser", "hermez")


# ---------------------------------------------------------------------- loading from config

def test_build_tools_from_names_import_strings_and_options(polyrl_plugin_manager):
    tools = build_tools(["calculator", "tests_tool_module:double",
                         {"name": "python", "timeout_s": 3}], _WithModule(polyrl_plugin_manager))
    assert sorted(tools) == ["calculator", "double", "python"]
    assert tools["python"].sandbox.limits.timeout_s == 3


class _WithModule:
    """A plugin manager view that also resolves the test's import string."""

    def __init__(self, pm):
        import sys
        import types

        mod = types.ModuleType("tests_tool_module")

        @tool
        def double(x: int) -> int:
            """Twice x.

            Args:
                x: a number.
            """
            return 2 * x

        mod.double = double
        sys.modules["tests_tool_module"] = mod
        self.pm = pm

    def get(self, kind, name):
        return self.pm.get(kind, name)


@pytest.mark.parametrize("spec, message", [
    (["calculater"], "unknown tool 'calculater'. Did you mean 'calculator'"),
    ([{"name": "python", "timeout": 3}], "unknown option"),
    (["calculator", "calculator"], "two tools are named 'calculator'"),
    ([42], "expected a tool name"),
])
def test_build_tools_errors(polyrl_plugin_manager, spec, message):
    with pytest.raises((ConfigError, LookupError, ValueError), match=message):
        build_tools(spec, polyrl_plugin_manager)


def test_a_tool_with_an_invalid_schema_is_refused(polyrl_plugins):
    class BadTool:
        name = "bad"
        schema = {"name": "bad", "parameters": {"type": "object", "properties": {"x": {"type": 3}}}}

        async def execute(self, arguments, sample):
            return ToolResult("")

    polyrl_plugins.register(type("P", (), {"register_tools": staticmethod(
        __import__("polyrl").hookimpl(lambda register: register("bad", BadTool())))})(), name="bad-plugin")
    with pytest.raises(ToolSchemaError, match="agent.tools\\[0\\] \\('bad'\\): tool 'bad'.*not valid JSON Schema"):
        build_tools(["bad"], polyrl_plugins.pm)


def test_tool_threads_serve_calls_after_cancelled_ones_and_idle_exits():
    """Calls queued behind hung ones are cancelled when abandoned; once the hung calls return and the idle
    threads end, a new call still gets a thread (it used to wait forever: skipped cancelled calls inflated
    the idle count, so no thread was started for it)."""
    import threading
    import time

    from polyrl.tools import ToolThreads

    pool = ToolThreads(max_workers=2)
    pool._idle_s = 0.1
    release = threading.Event()
    calls = [pool.submit(release.wait) for _ in range(4)]  # two run (and hang), two wait in the queue
    time.sleep(0.2)
    for call in calls[2:] + calls[:2]:  # the queued calls first: they are cancelled, not started
        pool.abandon(call, "stuck")
    assert pool.hung == 2 and sum(call.cancelled() for call in calls) == 2
    later = pool.submit(lambda: "ran")  # hung threads do not count against max_workers
    assert later.result(timeout=5) == "ran"
    release.set()
    deadline = time.monotonic() + 5
    while pool._threads and time.monotonic() < deadline:  # every thread idles out
        time.sleep(0.05)
    assert pool._threads == 0 and pool.hung == 0
    assert pool.submit(lambda: "again").result(timeout=5) == "again"
