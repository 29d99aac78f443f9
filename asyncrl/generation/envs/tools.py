"""Tools: a name, an OpenAI-style JSON schema, and a function from arguments to text.

``Tool.schema()`` is what goes in the system prompt (and what
``tokenizer.apply_chat_template(tools=...)`` takes)::

    {"type": "function", "function": {"name": ..., "description": ...,
                                      "parameters": {JSON schema of the arguments}}}

``Tool.call(arguments)`` checks the arguments against ``parameters`` (the
subset of JSON Schema that tool schemas use: ``type``, ``properties``,
``required``, ``additionalProperties``, ``enum``, ``items``, ``minimum``,
``maximum``) and raises :class:`ToolError` with a message meant for the model
when they do not fit, or when the tool itself reports a problem.

Built in: ``calculator`` (safe arithmetic, no ``eval``) and ``python`` (code run
in :class:`~asyncrl.generation.envs.sandbox.Sandbox`, bubblewrap-isolated unless
``isolation="none"``). :func:`build_tools` makes tools from
names: a built-in name, or ``module:attr`` naming a :class:`Tool` or a
function returning one.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from asyncrl.generation.envs.calculator import CalculatorError, calculate
from asyncrl.generation.envs.sandbox import Sandbox, SandboxResult


class ToolError(Exception):
    """A tool call that cannot be carried out; the message goes back to the model."""


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: Mapping[str, Any]
    """JSON schema of the arguments object."""
    function: Callable[..., str]
    """Called with the arguments as keyword arguments; returns the tool's output."""

    def schema(self) -> dict[str, Any]:
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": dict(self.parameters),
            },
        }

    def call(self, arguments: Mapping[str, Any]) -> str:
        problems = validate(self.parameters, arguments)
        if problems:
            raise ToolError(f"bad arguments for {self.name!r}: " + "; ".join(problems))
        return str(self.function(**arguments))


_TYPES: dict[str, tuple[type, ...]] = {
    "object": (dict,),
    "array": (list, tuple),
    "string": (str,),
    "number": (int, float),
    "integer": (int,),
    "boolean": (bool,),
    "null": (type(None),),
}


def validate(schema: Mapping[str, Any], value: Any, path: str = "arguments") -> list[str]:
    """Problems with ``value`` under ``schema`` (empty when it fits)."""
    expected = schema.get("type")
    if expected is not None:
        names = [expected] if isinstance(expected, str) else list(expected)
        fits = any(
            isinstance(value, _TYPES.get(name, object))
            and not (isinstance(value, bool) and name in ("number", "integer"))
            for name in names
        )
        if not fits:
            return [f"{path} should be {' or '.join(names)}, got {type(value).__name__}"]
    problems: list[str] = []
    if "enum" in schema and value not in schema["enum"]:
        problems.append(f"{path} should be one of {list(schema['enum'])}")
    if isinstance(value, int | float) and not isinstance(value, bool):
        if "minimum" in schema and value < schema["minimum"]:
            problems.append(f"{path} should be >= {schema['minimum']}")
        if "maximum" in schema and value > schema["maximum"]:
            problems.append(f"{path} should be <= {schema['maximum']}")
    if isinstance(value, dict):
        properties = schema.get("properties", {})
        for key in schema.get("required", []):
            if key not in value:
                problems.append(f"missing required argument {key!r}")
        for key, item in value.items():
            if key in properties:
                problems += validate(properties[key], item, f"{path}.{key}")
            elif schema.get("additionalProperties", True) is False:
                problems.append(f"unexpected argument {key!r}")
    if isinstance(value, list | tuple) and "items" in schema:
        for index, item in enumerate(value):
            problems += validate(schema["items"], item, f"{path}[{index}]")
    return problems


def calculator_tool() -> Tool:
    def run(expression: str) -> str:
        try:
            return calculate(expression)
        except CalculatorError as exc:
            raise ToolError(str(exc)) from None

    return Tool(
        name="calculator",
        description=(
            "Evaluate an arithmetic expression: numbers, + - * / // % **, parentheses, "
            "pi, e, and sqrt, log, exp, sin, cos, tan, floor, ceil, abs, round, min, max."
        ),
        parameters={
            "type": "object",
            "properties": {
                "expression": {"type": "string", "description": "e.g. (2 + 3) * sqrt(16)"}
            },
            "required": ["expression"],
            "additionalProperties": False,
        },
        function=run,
    )


def format_sandbox_output(result: SandboxResult, timeout_s: float | None = None) -> str:
    """The text a model sees for a :class:`~asyncrl.generation.envs.sandbox.SandboxResult`."""
    parts = [result.stdout.rstrip("\n")] if result.stdout else []
    if result.stderr:
        parts.append("[stderr]\n" + result.stderr.rstrip("\n"))
    if result.timed_out:
        limit = f" of {timeout_s:g}s" if timeout_s is not None else ""
        parts.append(f"[killed: time limit{limit} reached]")
    elif result.returncode is None:
        parts.append("[not run]")
    elif result.returncode < 0:
        parts.append(f"[killed by signal {-result.returncode}]")
    elif result.returncode != 0:
        parts.append(f"[exit code {result.returncode}]")
    if result.truncated:
        parts.append("[output truncated]")
    return "\n".join(parts) if parts else "(no output; use print() to show values)"


def python_sandbox_for(
    timeout_s: float = 5.0, memory_mb: int = 512, max_output_bytes: int = 4096, **options: Any
) -> Sandbox:
    """The :class:`~asyncrl.generation.envs.sandbox.Sandbox` of a ``python`` tool with these
    limits; ``options`` are the other ``Sandbox`` fields (``isolation``, ...)."""
    return Sandbox(
        timeout_s=timeout_s, memory_mb=memory_mb, max_output_bytes=max_output_bytes, **options
    )


def python_tool(
    timeout_s: float = 5.0,
    memory_mb: int = 512,
    max_output_bytes: int = 4096,
    *,
    sandbox: Sandbox | None = None,
    **options: Any,
) -> Tool:
    """The ``python`` tool: code run in ``sandbox``, or in a new
    ``Sandbox(timeout_s, memory_mb, max_output_bytes, **options)``."""
    box = sandbox or python_sandbox_for(timeout_s, memory_mb, max_output_bytes, **options)

    def run(code: str) -> str:
        return format_sandbox_output(box.run(code), box.timeout_s)

    walls = "no network, " if box.isolation != "none" else ""
    return Tool(
        name="python",
        description=(
            f"Run a Python 3 program and return what it prints (stdout and stderr). "
            f"Standard library only, {walls}{box.timeout_s:g}s and {box.memory_mb} MB "
            f"limits; each call starts fresh in an empty directory."
        ),
        parameters={
            "type": "object",
            "properties": {"code": {"type": "string", "description": "the program"}},
            "required": ["code"],
            "additionalProperties": False,
        },
        function=run,
    )


BUILTIN_TOOLS: dict[str, Callable[..., Tool]] = {
    "calculator": calculator_tool,
    "python": python_tool,
}


def build_tools(
    names: Sequence[str | Tool],
    *,
    python_timeout_s: float = 5.0,
    python_memory_mb: int = 512,
    python_isolation: str = "bubblewrap",
) -> dict[str, Tool]:
    """Tools by name, in order. A name is a built-in, ``module:attr`` or a :class:`Tool`.
    ``python_isolation``: the ``python`` tool's sandbox, ``bubblewrap`` or ``none``
    (trusted code only)."""
    from asyncrl.generation.envs.loading import PluginError, load_object

    tools: dict[str, Tool] = {}
    for entry in names:
        if isinstance(entry, Tool):
            tool = entry
        elif entry == "python":
            tool = python_tool(
                timeout_s=python_timeout_s, memory_mb=python_memory_mb, isolation=python_isolation
            )
        elif entry in BUILTIN_TOOLS:
            tool = BUILTIN_TOOLS[entry]()
        elif isinstance(entry, str) and ":" in entry:
            obj = load_object(entry, what="tool")
            tool = obj if isinstance(obj, Tool) else obj() if callable(obj) else obj
            if not isinstance(tool, Tool):
                raise PluginError(f"tool {entry!r} is not a Tool or a function returning one")
        else:
            raise PluginError(
                f"unknown tool {entry!r}; built-in tools: {', '.join(BUILTIN_TOOLS)}, "
                f"or give module:attr"
            )
        if tool.name in tools:
            raise PluginError(f"two tools are named {tool.name!r}")
        tools[tool.name] = tool
    return tools
