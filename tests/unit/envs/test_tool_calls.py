"""Parsing Hermes/Qwen <tool_call> JSON out of a model turn: never raises on model output."""

from __future__ import annotations

import json

import pytest

from asyncrl.generation.envs import tool_calls
from asyncrl.generation.envs.loading import PluginError
from asyncrl.generation.envs.tool_calls import (
    MAX_JSON_DEPTH,
    HermesToolCallParser,
    ParsedTurn,
    ToolCall,
    ToolCallError,
    json_depth,
    make_parser,
)

parse = HermesToolCallParser().parse


def test_one_call_with_text_around_it():
    text = (
        "Let me compute that.\n<tool_call>\n"
        '{"name": "calculator", "arguments": {"expression": "2 + 2"}}\n</tool_call>'
    )
    turn = parse(text)
    assert turn.content == "Let me compute that."
    assert turn.calls == [
        ToolCall(
            "calculator",
            {"expression": "2 + 2"},
            '{"name": "calculator", "arguments": {"expression": "2 + 2"}}',
        )
    ]
    assert turn.errors == []


def test_several_calls_keep_their_order():
    text = (
        '<tool_call>{"name": "a", "arguments": {}}</tool_call> and '
        '<tool_call>{"name": "b", "arguments": {"x": 1}}</tool_call>'
    )
    turn = parse(text)
    assert [c.name for c in turn.calls] == ["a", "b"]
    assert turn.calls[1].arguments == {"x": 1}
    assert turn.content == "and"


def test_no_call_is_plain_content():
    assert parse("The answer is 4.") == ParsedTurn("The answer is 4.", [])


def test_arguments_given_as_a_json_string_or_missing_are_accepted():
    turn = parse('<tool_call>{"name": "f", "arguments": "{\\"x\\": 2}"}</tool_call>')
    assert turn.calls == [ToolCall("f", {"x": 2}, turn.calls[0].raw)]
    assert parse('<tool_call>{"name": "f"}</tool_call>').calls[0].arguments == {}


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ('{"name": "calculator", "arguments": {"expression": "1+1"}', "not valid JSON"),
        ("calculator(1+1)", "not valid JSON"),
        ('["calculator"]', "must be a JSON object"),
        ('{"arguments": {}}', 'no "name"'),
        ('{"name": "", "arguments": {}}', 'no "name"'),
        ('{"name": "f", "arguments": [1, 2]}', "\"arguments\" of 'f' must be a JSON object"),
        ('{"name": "f", "arguments": "not json"}', "\"arguments\" of 'f' must be a JSON object"),
    ],
)
def test_malformed_calls_become_errors_not_exceptions(body, message):
    turn = parse(f"<tool_call>{body}</tool_call>")
    (error,) = turn.calls
    assert isinstance(error, ToolCallError)
    assert message in error.message
    assert error.raw == body
    assert turn.errors == [error]


def test_unclosed_and_stray_tags_are_errors():
    (error,) = parse('thinking <tool_call>{"name": "f", "arguments": {}}').calls
    assert isinstance(error, ToolCallError) and "not closed" in error.message
    turn = parse('<tool_call>{"name": "a"}<tool_call>{"name": "b"}</tool_call>')
    assert isinstance(turn.calls[0], ToolCallError)
    assert turn.calls[1] == ToolCall("b", {}, '{"name": "b"}')
    (stray,) = parse("oops </tool_call>").calls
    assert isinstance(stray, ToolCallError) and "without a matching" in stray.message


def test_garbage_never_raises():
    for text in ["", "<tool_call>", "</tool_call><tool_call>", "<tool_call></tool_call>", "\x00{"]:
        assert isinstance(parse(text), ParsedTurn)


class UpperCaseParser:
    """A custom format: CALL name arg."""

    def parse(self, text):
        if text.startswith("CALL "):
            _, name, arg = text.split(" ", 2)
            return ParsedTurn("", [ToolCall(name, {"expression": arg})])
        return ParsedTurn(text, [])


def test_parsers_plug_in_by_name_or_module_path():
    assert isinstance(make_parser("hermes"), HermesToolCallParser)
    assert isinstance(make_parser("qwen"), HermesToolCallParser)
    custom = make_parser(f"{__name__}:UpperCaseParser")
    assert custom.parse("CALL calculator 1+2").calls == [
        ToolCall("calculator", {"expression": "1+2"})
    ]
    instance = UpperCaseParser()
    assert make_parser(instance) is instance
    with pytest.raises(PluginError, match="unknown tool-call parser 'nope'"):
        make_parser("nope")
    with pytest.raises(PluginError, match="no parse"):
        make_parser("json:dumps")


def test_json_nested_past_the_limit_is_an_error_message_not_a_recursion_error():
    deep = "[" * 1000 + "]" * 1000  # 2 KB: json.loads alone raises RecursionError
    (error,) = parse(f"<tool_call>{deep}</tool_call>").calls
    assert isinstance(error, ToolCallError)
    assert f"more than {MAX_JSON_DEPTH} deep" in error.message
    arguments = json.dumps({"name": "f", "arguments": deep})  # deep JSON inside a string
    (error,) = parse(f"<tool_call>{arguments}</tool_call>").calls
    assert f"more than {MAX_JSON_DEPTH} deep" in error.message


def _nested_call(depth: int) -> str:
    """A call whose JSON nests ``depth`` deep, with brackets in a string that do not count."""
    value: object = 1
    for _ in range(depth - 2):  # the call's object and its arguments object are two levels
        value = [value]
    return json.dumps({"name": "f", "arguments": {"text": "[[[{{{" * 100, "deep": value}})


def test_json_up_to_the_limit_is_accepted_and_one_more_level_is_not():
    (call,) = parse(f"<tool_call>{_nested_call(MAX_JSON_DEPTH)}</tool_call>").calls
    assert isinstance(call, ToolCall), call
    assert call.arguments["text"] == "[[[{{{" * 100
    (error,) = parse(f"<tool_call>{_nested_call(MAX_JSON_DEPTH + 1)}</tool_call>").calls
    assert isinstance(error, ToolCallError) and "deep" in error.message


@pytest.mark.parametrize(
    ("text", "depth"),
    [
        ("", 0),
        ("42", 0),
        ('{"a": [1, {"b": []}]}', 4),
        ('{"a": "[[[\\"[["}', 1),  # brackets and an escaped quote inside a string
        ('[[["]]]', 3),  # an unclosed string hides the rest
        ("]]]][", 0),
        ('"\\', 0),
    ],
)
def test_json_depth_counts_only_structural_brackets(text, depth):
    assert json_depth(text) == depth


def test_a_recursion_error_from_the_decoder_is_reported_too(monkeypatch):
    monkeypatch.setattr(tool_calls, "MAX_JSON_DEPTH", 10**9)  # only the decoder's own limit
    deep = "[" * 100_000 + "]" * 100_000
    (error,) = parse(f"<tool_call>{deep}</tool_call>").calls
    assert isinstance(error, ToolCallError) and "deep" in error.message


@pytest.mark.timeout(10)
def test_unclosed_tags_parse_in_linear_time():
    # Each tag used to search the rest of the text for its closing tag: 64k of these
    # took over half a minute. One pass over the tags takes a fraction of a second.
    text = '<tool_call>{"name": "f", "arguments": {}}' * 64_000
    turn = parse(text)
    assert len(turn.calls) == 64_000
    assert all("not closed" in call.message for call in turn.errors)
    assert turn.calls[-1].raw == '{"name": "f", "arguments": {}}'
