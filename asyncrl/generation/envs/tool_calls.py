"""Find tool calls in a model's turn.

A parser turns the text of one model turn into a :class:`ParsedTurn`: the
text outside any tool call, and the calls in order, each either a
:class:`ToolCall` or a :class:`ToolCallError` (a call the model tried to make
but got wrong: bad JSON, JSON nested too deep, no name, arguments not an object,
an unclosed tag).
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
import itertools
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


MAX_JSON_DEPTH = 64
"""Deepest nesting of arrays and objects a call may use. Deeper JSON is refused
before ``json.loads`` sees it: the decoder recurses once per level, and a 2 KB
call nested 1,000 deep would raise ``RecursionError`` instead of a message."""

# A JSON string (its closing quote optional, so that an unclosed one cannot make
# the scan start again at every later quote), or a run of characters that are
# neither quotes nor brackets. Removing these leaves the structural brackets.
_NOT_A_BRACKET = re.compile(r'"(?:[^"\\]++|\\.)*+(?:"|\\?\Z)|[^"\[\]{}]++', re.DOTALL)
_DEPTH_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}


def json_depth(text: str) -> int:
    """How deep arrays and objects nest in ``text``, brackets in strings not counted.

    One pass in C (a regex, then a running sum), so a megabyte of brackets is cheap;
    the text need not be valid JSON.
    """
    brackets = _NOT_A_BRACKET.sub("", text)
    return max(itertools.accumulate(map(_DEPTH_STEP.__getitem__, brackets), initial=0))


class _TooDeep(ValueError):
    """JSON nested deeper than :data:`MAX_JSON_DEPTH`."""


def _load_json(text: str) -> Any:
    """``json.loads``, refusing nesting deeper than :data:`MAX_JSON_DEPTH` (:class:`_TooDeep`)."""
    too_deep = f"nests arrays or objects more than {MAX_JSON_DEPTH} deep"
    if json_depth(text) > MAX_JSON_DEPTH:
        raise _TooDeep(too_deep)
    try:
        return json.loads(text)
    except RecursionError:  # the caller's stack was already deep: still the model's error
        raise _TooDeep(too_deep) from None


def call_from_json(body: str) -> ToolCall | ToolCallError:
    """``{"name": str, "arguments": object}`` (arguments may also be a JSON string)."""
    try:
        data = _load_json(body)
        name, arguments = _name_and_arguments(data)
    except _TooDeep as exc:
        return ToolCallError(f"the tool call {exc}", body)
    except ValueError as exc:
        return ToolCallError(f"the tool call is not valid JSON ({exc})", body)
    if not isinstance(data, dict):
        return ToolCallError(
            'a tool call must be a JSON object {"name": ..., "arguments": {...}}', body
        )
    if not isinstance(name, str) or not name:
        return ToolCallError('the tool call has no "name" string', body)
    if not isinstance(arguments, dict):
        return ToolCallError(f'"arguments" of {name!r} must be a JSON object', body)
    return ToolCall(name, arguments, body)


def _name_and_arguments(data: Any) -> tuple[Any, Any]:
    """The call's ``name`` and ``arguments``, an arguments string decoded when it is JSON."""
    if not isinstance(data, dict):
        return None, None
    arguments = data.get("arguments", {})
    if isinstance(arguments, str):  # some models encode the arguments object as a string
        with contextlib.suppress(json.JSONDecodeError):  # not JSON: reported as not an object
            arguments = _load_json(arguments) if arguments.strip() else {}
    return data.get("name"), arguments


class HermesToolCallParser:
    """``<tool_call>{json}</tool_call>`` blocks, any number per turn."""

    open_tag = "<tool_call>"
    close_tag = "</tool_call>"

    def parse(self, text: str) -> ParsedTurn:
        """One pass over the tags: each tag is found once, so the time is linear in
        the text however many tags are left unclosed."""
        pattern = re.compile(re.escape(self.open_tag) + "|" + re.escape(self.close_tag))
        tags = list(pattern.finditer(text))
        calls: list[ToolCall | ToolCallError] = []
        outside: list[str] = []
        position = index = 0
        while index < len(tags):
            tag = tags[index]
            after = tags[index + 1] if index + 1 < len(tags) else None
            outside.append(text[position : tag.start()])
            if tag.group() == self.close_tag:
                calls.append(
                    ToolCallError(f"{self.close_tag} without a matching {self.open_tag}", "")
                )
                position, index = tag.end(), index + 1
            elif after is None or after.group() == self.open_tag:
                stop = len(text) if after is None else after.start()
                raw = text[tag.end() : stop]
                calls.append(
                    ToolCallError(f"{self.open_tag} is not closed by {self.close_tag}", raw)
                )
                position, index = stop, index + 1
            else:
                calls.append(call_from_json(text[tag.end() : after.start()].strip()))
                position, index = after.end(), index + 2
        outside.append(text[position:])
        return ParsedTurn("".join(outside).strip(), calls)


PARSERS: dict[str, type] = {"hermes": HermesToolCallParser, "qwen": HermesToolCallParser}


def make_parser(spec: str | ToolCallParser = "hermes") -> ToolCallParser:
    """A parser from a built-in name (``hermes``, ``qwen``), ``module:Class`` or an instance."""
    if not isinstance(spec, str):
        return spec
    if spec in PARSERS:
        return PARSERS[spec]()
    from asyncrl.generation.envs.loading import PluginError, load_object

    if ":" not in spec:
        raise PluginError(f"unknown tool-call parser {spec!r}; built in: {', '.join(PARSERS)}")
    obj = load_object(spec, what="tool-call parser")
    parser = obj() if isinstance(obj, type) else obj
    if not isinstance(parser, ToolCallParser):
        raise PluginError(f"tool-call parser {spec!r} has no parse(text) method")
    return parser
