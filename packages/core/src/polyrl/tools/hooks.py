"""Registers the built-in tools and tool-call parsers."""

from polyrl.hookspecs import hookimpl


@hookimpl
def register_tools(register):
    register("calculator", "polyrl.tools.builtin:calculator", description="safe arithmetic (AST walk, no eval)")
    register("python", "polyrl.tools.builtin:python_tool", description="Python in a namespaced, rlimited sandbox")


@hookimpl
def register_tool_parsers(register):
    register("hermes", "polyrl.tools.parsers:HermesParser", description="<tool_call>{json}</tool_call> (Qwen2.5, Hermes)")
    register("qwen3_coder", "polyrl.tools.parsers:Qwen3CoderParser", aliases=["xml"],
             description="<tool_call><function=f><parameter=k>v</parameter></function></tool_call>")
    register("llama3_json", "polyrl.tools.parsers:Llama3JsonParser", aliases=["json"],
             description='{"name": ..., "parameters": {...}} (Llama 3.x)')
