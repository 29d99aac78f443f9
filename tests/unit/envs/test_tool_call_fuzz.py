"""Seeded random model output through the Hermes parser: no exception escapes, and
every result is either a well-formed call or an error message for the model."""

from __future__ import annotations

import random

import pytest

from asyncrl.generation.envs.tool_calls import (
    HermesToolCallParser,
    ParsedTurn,
    ToolCall,
    ToolCallError,
)

OPEN, CLOSE = "<tool_call>", "</tool_call>"
VALID = '{"name": "calculator", "arguments": {"expression": "1 + 2"}}'


def _piece(rng: random.Random) -> str:
    """One fragment of model output: tags, brackets, JSON bits, deep nests or garbage."""
    kind = rng.randrange(9)
    if kind == 0:
        return rng.choice([OPEN, CLOSE, "<tool_", "call>", "</tool_call"])
    if kind == 1:
        depth = rng.choice([10, 70, 1_000, 3_000, 20_000])
        opener = rng.choice(["[", "{", '{"a":', '{"name": "f", "arguments": '])
        closer = {"[": "]"}.get(opener[0], "}") * rng.choice([0, depth])
        return opener * depth + "1" + closer
    if kind == 2:
        return rng.choice([VALID, '{"name": "f"}', '{"name": 3}', "[]", "null", '"x"'])
    if kind == 3:
        return '{"name": "f", "arguments": "' + rng.choice(["[" * 2000, "{}", '\\"', "\\"]) + '"}'
    if kind == 4:
        return "".join(rng.choice('[]{}",:\\ntrue0') for _ in range(rng.randrange(200)))
    if kind == 5:
        return "".join(chr(rng.randrange(0x110000 - 0x800)) for _ in range(rng.randrange(50)))
    if kind == 6:
        return OPEN + VALID + CLOSE
    if kind == 7:
        return OPEN * rng.randrange(1, 300)
    return rng.choice(["\n", " ", "Let me think.", "\x00", "\ud800"])


def _output(rng: random.Random) -> str:
    return "".join(_piece(rng) for _ in range(rng.randrange(1, 12)))


def _check(turn: ParsedTurn, text: str) -> None:
    assert isinstance(turn, ParsedTurn)
    assert isinstance(turn.content, str)
    assert len(turn.calls) >= text.count(OPEN)  # every opening tag gives a call or an error
    for call in turn.calls:
        if isinstance(call, ToolCall):
            assert isinstance(call.name, str) and call.name
            assert isinstance(call.arguments, dict)
        else:
            assert isinstance(call, ToolCallError)
            assert isinstance(call.message, str) and call.message


@pytest.mark.parametrize("seed", range(4))
def test_random_model_output_never_raises(seed):
    rng = random.Random(seed)
    parse = HermesToolCallParser().parse
    for _ in range(250):
        text = _output(rng)
        _check(parse(text), text)
        wrapped = OPEN + text + CLOSE
        _check(parse(wrapped), wrapped)
