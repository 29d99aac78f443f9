"""Find tool calls in a model's turn.

A parser turns the text of one model turn into a :class:`ParsedTurn`: the
text outside any tool call, and the calls in order, each either a
:class:`ToolCall` or a :class:`ToolCallError` (a call the model tried to make
but got wrong: bad JSON, no name, arguments not an object, an unclosed tag).
A parser never raises on model output; the environment turns each error into
a message back to the model.

Built in: :class:`HermesToolCallParser`, the format Hermes and Qwen models are
trained on::

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "2 + 2"}}
    </tool_call>

Other formats plug in as any object with ``parse(text) -> ParsedTurn``,
named in the environment's ``parser`` option as ``module:Class``.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: Mapping[str, Any]
    raw: str = ""
    """The text of the call as the model wrote it."""


@dataclass(frozen=True)
class ToolCallError:
    message: str
    """What is wrong, written for the model to read and fix."""
    raw: str = ""


@dataclass(frozen=True)
class ParsedTurn:
    content: str
    """The turn's text with the tool calls taken out, stripped."""
    calls: list[ToolCall | ToolCallError] = field(default_factory=list)

    @property
    def errors(self) -> list[ToolCallError]:
        return [call for call in self.calls if isinstance(call, ToolCallError)]


@runtime_checkable
class ToolCallParser(Protocol):
    def parse(self, text: str) -> ParsedTurn: ...


def call_from_json(body: str) -> ToolCall | ToolCallError:
    """``{"name": str, "arguments": object}`` (arguments may also be a JSON string)."""
    try:
        data = json.loads(body)
    except ValueError as exc:
        return ToolCallError(f"the tool call is not valid JSON ({exc})", body)
    if not isinstance(data, dict):
        return ToolCallError(
            'a tool call must be a JSON object {"name": ..., "arguments": {...}}', body
        )
    name = data.get("name")
    if not isinstance(name, str) or not name:
        return ToolCallError('the tool call has no "name" string', body)
    arguments = data.get("arguments", {})
    if isinstance(arguments, str):  # some models encode the arguments object as a string
        with contextlib.suppress(ValueError):
            arguments = json.loads(arguments) if arguments.strip() else {}
    if not isinstance(arguments, dict):
        return ToolCallError(f'"arguments" of {name!r} must be a JSON object', body)
    return ToolCall(name, arguments, body)


class HermesToolCallParser:
    """``<tool_call>{json}</tool_call>`` blocks, any number per turn."""

    open_tag = "<tool_call>"
    close_tag = "</tool_call>"

    def parse(self, text: str) -> ParsedTurn:
        calls: list[ToolCall | ToolCallError] = []
        outside: list[str] = []
        position = 0
        pattern = re.compile(re.escape(self.open_tag) + "|" + re.escape(self.close_tag))
        while True:
            match = pattern.search(text, position)
            if match is None:
                outside.append(text[position:])
                break
            outside.append(text[position : match.start()])
            if match.group() == self.close_tag:
                calls.append(
                    ToolCallError(f"{self.close_tag} without a matching {self.open_tag}", "")
                )
                position = match.end()
                continue
            end = text.find(self.close_tag, match.end())
            next_open = text.find(self.open_tag, match.end())
            if end < 0 or (0 <= next_open < end):
                stop = len(text) if next_open < 0 else next_open
                raw = text[match.end() : stop]
                calls.append(
                    ToolCallError(f"{self.open_tag} is not closed by {self.close_tag}", raw)
                )
                position = stop
                continue
            calls.append(call_from_json(text[match.end() : end].strip()))
            position = end + len(self.close_tag)
        return ParsedTurn("".join(outside).strip(), calls)


PARSERS: dict[str, type] = {"hermes": HermesToolCallParser, "qwen": HermesToolCallParser}


def make_parser(spec: str | ToolCallParser = "hermes") -> ToolCallParser:
    """A parser from a built-in name (``hermes``, ``qwen``), ``module:Class`` or an instance."""
    if not isinstance(spec, str):
        return spec
    if spec in PARSERS:
        return PARSERS[spec]()
    from asyncrl.envs.loading import PluginError, load_object

    if ":" not in spec:
        raise PluginError(f"unknown tool-call parser {spec!r}; built in: {', '.join(PARSERS)}")
    obj = load_object(spec, what="tool-call parser")
    parser = obj() if isinstance(obj, type) else obj
    if not isinstance(parser, ToolCallParser):
        raise PluginError(f"tool-call parser {spec!r} has no parse(text) method")
    return parser
