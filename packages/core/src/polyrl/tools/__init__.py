"""Tools agent loops can call: the ``@tool`` decorator, built-ins, tool-call parsers and the sandbox.

See docs/agents.md. Nothing here imports torch.
"""

from polyrl.tools.function import (
    FunctionTool,
    ToolError,
    ToolSchemaError,
    ToolThreads,
    check_arguments,
    tool,
    validate_tool_schema,
)
from polyrl.tools.loading import build_tools, check_tool
from polyrl.tools.parsers import ParsedTurn, ToolCall, ToolCallParser

__all__ = [
    "FunctionTool",
    "ParsedTurn",
    "ToolCall",
    "ToolCallParser",
    "ToolError",
    "ToolSchemaError",
    "ToolThreads",
    "build_tools",
    "check_arguments",
    "check_tool",
    "tool",
    "validate_tool_schema",
]
