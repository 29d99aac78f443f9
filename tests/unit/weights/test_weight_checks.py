"""The checks a replica runs on a version before its engine serves it (asyncrl.weights.checks)."""

from __future__ import annotations

import logging
import math
from collections import Counter

import pytest
import torch

from asyncrl.core.messages import TensorEntry
from asyncrl.weights.checks import (
    Layout,
    Refusals,
    WeightsRefused,
    check_finite,
    check_layout,
    nonfinite,
)
from asyncrl.weights.collective.buckets import Spec

LAYOUT = Layout(
    {"w": Spec((2, 3), "float32"), "h": Spec((4,), "bfloat16"), "head": Spec((2, 3), "float32")},
    frozenset({"head"}),
)


def entry(name: str, dtype: str, shape: tuple[int, ...]) -> TensorEntry:
    return TensorEntry(name, dtype, shape, 0, 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_one_nonfinite_value_anywhere_is_found(dtype, value):
    tensors = {"a": torch.randn(100).to(dtype), "b": torch.randn(1000, 7).to(dtype)}
    tensors["b"][777, 3] = value
    problem = nonfinite(tensors.items())
    assert problem == f"tensor 'b' holds {'NaN' if math.isnan(value) else 'an infinity'}"


def test_finite_values_pass_however_large_and_integers_are_not_looked_at():
    huge = torch.full((1000,), 3e38)  # their sum overflows: a check by sum would refuse them
    counts = torch.tensor([2**62, -(2**62)])
    assert nonfinite([("huge", huge), ("counts", counts), ("empty", torch.empty(0))]) is None


def test_the_first_tensor_holding_nan_is_named_with_how_many_others_do():
    tensors = [(name, torch.zeros(4)) for name in "abcd"]
    for _, tensor in tensors[1:]:
        tensor[0] = math.nan
    with pytest.raises(WeightsRefused, match=r"shm v7: refused: tensor 'b' holds NaN \(and 2 more"):
        check_finite(tensors, 7, "shm")


@pytest.mark.parametrize(
    ("entries", "problem"),
    [
        ([entry("w", "float32", (2, 3))], r"missing \['h'\]"),
        (
            [entry("w", "float32", (3, 2)), entry("h", "bfloat16", (4,))],
            r"tensor 'w' has shape \(3, 2\), the engine's is \(2, 3\)",
        ),
        (
            [entry("w", "float32", (2, 3)), entry("h", "float32", (4,))],
            "tensor 'h' is float32, the engine's is bfloat16",
        ),
        ([entry("x", "float32", (1,))], "tensor 'x' is not one of the engine's"),
    ],
)
def test_a_layout_not_the_engines_is_refused_naming_what_differs(entries, problem):
    with pytest.raises(WeightsRefused, match=problem) as caught:
        check_layout(LAYOUT, entries, 3, "zmq")
    assert caught.value.reason == "layout" and not caught.value.partial


def test_the_engines_layout_passes_without_its_optional_tied_head():
    check_layout(LAYOUT, [entry("w", "float32", (2, 3)), entry("h", "bfloat16", (4,))], 3, "shm")


def test_refusals_are_counted_each_time_and_logged_once_a_minute(caplog):
    counters: Counter[str] = Counter()
    refusals = Refusals(counters)
    caplog.set_level(logging.WARNING, logger="asyncrl.weights")
    for version in (4, 5, 6):
        error = WeightsRefused(f"shm v{version}: refused: tensor 'w' holds NaN", reason="nonfinite")
        refusals.note(("slot", version), error)
    assert counters == {"refused_nonfinite": 3}
    assert ("slot", 5) in refusals and ("slot", 7) not in refusals
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["shm v4: refused: tensor 'w' holds NaN; the weights held stay"]
