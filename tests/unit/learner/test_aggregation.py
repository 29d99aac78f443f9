"""Aggregation of token losses (``algorithms/aggregation.py``) against hand-worked
examples: each mode, the global normalizers, and micro-batches that add up exactly.

Expected numbers are worked out by hand in the comments, not by re-running the
formula under test.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl.learner.algorithms import AGGREGATIONS, aggregate

torch.set_num_threads(1)


# ------------------------------------------------- modes and normalizers

AGG_VALUES = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])


AGG_MASK = torch.tensor([[1, 1, 0], [1, 0, 0]])


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", 7 / 3),  # (1 + 2 + 4) / 3 tokens
        ("seq-mean-token-mean", 2.75),  # (mean(1, 2) + mean(4)) / 2 = (1.5 + 4) / 2
        ("seq-mean-token-sum", 3.5),  # ((1 + 2) + 4) / 2
        ("seq-mean-token-sum-norm", 7 / 6),  # (1 + 2 + 4) / (2 sequences * T = 3)
    ],
)
def test_aggregate_modes_on_a_hand_worked_batch(mode, expected):
    assert aggregate(AGG_VALUES, AGG_MASK, mode).item() == pytest.approx(expected, abs=1e-6)


def test_aggregate_uses_the_global_normalizers_it_is_given():
    # sum of valid values 7, per-sequence means sum 5.5
    assert aggregate(AGG_VALUES, AGG_MASK, "token-mean", num_tokens=14).item() == 0.5
    got = aggregate(AGG_VALUES, AGG_MASK, "seq-mean-token-mean", num_sequences=11)
    assert got.item() == pytest.approx(0.5)
    got = aggregate(AGG_VALUES, AGG_MASK, "seq-mean-token-sum", num_sequences=7)
    assert got.item() == pytest.approx(1.0)
    got = aggregate(AGG_VALUES, AGG_MASK, "seq-mean-token-sum-norm", num_sequences=2, norm_length=7)
    assert got.item() == pytest.approx(0.5)  # 7 / (2 * 7)
    # a tensor count (e.g. all-reduced over ranks) works as well
    assert aggregate(AGG_VALUES, AGG_MASK, "token-mean", num_tokens=torch.tensor(14)).item() == 0.5


def test_seq_mean_token_mean_counts_a_row_without_tokens_as_zero_and_one_token_as_itself():
    values = torch.tensor([[1.0, 2.0], [9.0, 9.0], [0.0, 6.0]])
    mask = torch.tensor([[1, 1], [0, 0], [0, 1]])
    # (mean(1, 2) + 0 + 6) / 2 rows with a valid token (as verl) = 7.5 / 2
    assert aggregate(values, mask, "seq-mean-token-mean").item() == pytest.approx(3.75)


@pytest.mark.parametrize("mode", AGGREGATIONS)
def test_aggregate_ignores_nan_and_inf_at_masked_positions_and_of_all_masked_is_zero(mode):
    values = torch.tensor([[1.0, float("nan")], [float("inf"), -float("inf")]], requires_grad=True)
    mask = torch.tensor([[1, 0], [0, 0]])
    assert math.isfinite(aggregate(values, mask, mode).item())
    empty = aggregate(values, torch.zeros(2, 2), mode)
    empty.backward()
    assert empty.item() == 0.0
    assert torch.equal(values.grad, torch.zeros(2, 2))


def test_an_unknown_aggregation_raises_value_error():
    with pytest.raises(ValueError, match="unknown aggregation"):
        aggregate(AGG_VALUES, AGG_MASK, "sum")


# ------------------------------------------ micro-batches add up exactly


@settings(max_examples=30, deadline=None)
@given(
    st.sampled_from(list(AGGREGATIONS)),
    st.integers(0, 10_000),
    st.lists(st.integers(1, 7), min_size=1, max_size=4),
)
def test_any_split_into_micro_batches_sums_to_the_full_batch_aggregate(mode, seed, cuts):
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(8, 4, generator=g)
    mask = torch.rand(8, 4, generator=g) > 0.5
    normalizers = {"num_tokens": mask.sum().item(), "num_sequences": 8, "norm_length": 4}
    full = aggregate(values, mask, mode, **normalizers)
    bounds = [0, *sorted(set(cuts)), 8]
    parts = sum(
        aggregate(values[a:b], mask[a:b], mode, **normalizers).item()
        for a, b in itertools.pairwise(bounds)
    )
    assert parts == pytest.approx(full.item(), abs=1e-5)
