"""Built-in tools: ``calculator`` (safe arithmetic) and ``python`` (code in the sandbox)."""

from __future__ import annotations

import ast
import operator
from collections.abc import Mapping
from typing import Any

from polyrl.protocols import ToolResult
from polyrl.tools.function import check_arguments, tool, validate_tool_schema
from polyrl.tools.sandbox import Sandbox, SandboxLimits

__all__ = ["PythonTool", "calculator", "evaluate_arithmetic", "python_tool"]

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_MAX_EXPONENT = 64
_MAX_DIGITS = 200

def evaluate_arithmetic(expression: str) -> int | float:
    """Evaluate ``+ - * / // % **`` and parentheses over numbers by walking the AST (never ``eval``).

    Raises ``ValueError`` for anything else (names, calls, attributes...), division by zero,
    exponents above 64 and results over 200 digits.
    """
    if len(expression) > 500:
        raise ValueError("expression is longer than 500 characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"not an arithmetic expression: {exc.msg}") from exc

    def walk(node: ast.AST) -> int | float:
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](walk(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = walk(node.left), walk(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > _MAX_EXPONENT:
                raise ValueError(f"exponent {right} is too large (at most {_MAX_EXPONENT})")
            try:
                value = _BINARY[type(node.op)](left, right)
            except ZeroDivisionError as exc:
                raise ValueError("division by zero") from exc
            if isinstance(value, complex):
                raise ValueError("the result is not a real number")
            if isinstance(value, int) and value.bit_length() > _MAX_DIGITS * 3.33:
                raise ValueError(f"the result has more than {_MAX_DIGITS} digits")
            return value
        raise ValueError(f"'{ast.unparse(node)}' is not allowed: only numbers, + - * / // % ** and parentheses")

    return walk(tree)

@tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly, e.g. 123*456 or (2+3)/4.

    Args:
        expression: Numbers combined with + - * / // % ** and parentheses.
    """
    value = evaluate_arithmetic(expression)
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        value = int(value)
    return str(value)

class PythonTool:
    """``python``: runs the model's code in :class:`polyrl.tools.sandbox.Sandbox`, one process per call.

    The tool message is the code's stdout and stderr (what ``print`` shows); a failed
    run (an exception, a limit hit, a timeout) is a tool error. Options (the tool's
    entry in ``agent.tools``): ``timeout_s``, ``cpu_s``, ``memory_mb``, ``max_processes``,
    ``max_file_mb``, ``max_open_files``, ``max_output_bytes``, ``isolation`` (``namespaces`` | ``none``).
    """

    name = "python"

    def __init__(self, config: Mapping[str, Any] | None = None) -> None:
        options = dict(config or {})
        isolation = options.pop("isolation", "namespaces")
        options.pop("name", None)
        fields = set(SandboxLimits.__dataclass_fields__)
        unknown = sorted(set(options) - fields)
        if unknown:
            raise ValueError(f"python tool: unknown option(s) {unknown}; known: {sorted(fields | {'isolation'})}")
        self.sandbox = Sandbox(SandboxLimits(**options), isolation=isolation)
        self.schema = validate_tool_schema({"type": "function", "function": {
            "name": "python",
            "description": "Run Python 3 code (standard library only, no network, no files outside the "
                           "working directory) and return what it prints.",
            "parameters": {"type": "object", "properties": {
                "code": {"type": "string", "description": "The program; print() the values you need."}},
                "required": ["code"]}}}, "tool 'python'")

    async def execute(self, arguments: dict[str, Any], sample: Mapping[str, Any]) -> ToolResult:
        """Run ``arguments['code']``; raises ``RuntimeError`` (a tool error for the model) when the run failed.

        The message is the program's output, intact, followed by one bracketed line saying how the run
        ended (``[exited with status 1]``, ``[CPU time limit of 10 s exceeded (killed by SIGXCPU)]``,
        ``[timed out after 10s wall time (killed)]``...) and how much of a long output was dropped.
        """
        check_arguments(self.schema, arguments)
        result = await self.sandbox.arun(arguments["code"])
        metrics = {"sandbox_s": result.duration_s}
        if not result.ok:
            raise RuntimeError(f"{result.stdout.rstrip()}\n[{result.describe()}]".lstrip("\n"))
        text = result.stdout
        if result.truncated:
            text = f"{text.rstrip()}\n[output truncated: {result.dropped_bytes} bytes dropped from its middle]"
        return ToolResult(text=text, metrics=metrics)

def python_tool(config: Mapping[str, Any] | None = None) -> PythonTool:
    """Factory of the ``python`` tool (registered in the ``tool`` registry)."""
    return PythonTool(config)
