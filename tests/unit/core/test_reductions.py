"""A statistic combines as it declares: a weighted mean, a sum, or a peak, wherever values
meet (micro-batches, ranks, replicas)."""

from __future__ import annotations

import math

import pytest

from asyncrl.core.reductions import Reduce, Reduction, Stat


def test_each_kind_combines_as_declared():
    reduction = Reduction()
    for value, weight in [(1.0, 3.0), (4.0, 1.0)]:
        reduction.add("entropy", Stat.mean(value, weight))
    for value in (2.0, 5.0):
        reduction.add("loss", Stat.total(value))
        reduction.add("ratio_max", Stat.peak(value))
    assert reduction.results() == {"entropy": (3.0 + 4.0) / 4.0, "loss": 7.0, "ratio_max": 5.0}


def test_a_mean_with_no_weight_is_nan_not_zero():
    reduction = Reduction()
    reduction.add("mismatch", Stat.mean(0.0, 0.0))
    assert math.isnan(reduction.results()["mismatch"])


def test_a_key_keeps_its_kind():
    reduction = Reduction()
    reduction.add("importance_weight_max", Stat.peak(1.2))
    with pytest.raises(ValueError, match="importance_weight_max is reduced by max, not mean"):
        reduction.add("importance_weight_max", Stat.mean(1.0, 1.0))


def test_tables_reduced_elsewhere_give_the_combined_results():
    # two ranks: each one's tables, summed and maxed as all_reduce would, equal one
    # Reduction of every value
    ranks, whole = [Reduction(), Reduction()], Reduction()
    values = [(0.5, 2.0, 1.0), (1.5, 1.0, 3.0)]
    for rank, (mean, weight, peak) in zip(ranks, values, strict=True):
        for reduction in (rank, whole):
            reduction.add("m", Stat.mean(mean, weight))
            reduction.add("p", Stat.peak(peak))
            reduction.add("s", Stat.total(mean))
    tables = [rank.tables() for rank in ranks]
    summed = [[a + b for a, b in zip(*rows, strict=True)] for rows in zip(
        tables[0][1], tables[1][1], strict=True)]  # fmt: skip
    peaks = [max(pair) for pair in zip(tables[0][3], tables[1][3], strict=True)]
    assert ranks[0].from_tables(summed, peaks) == pytest.approx(whole.results())
    assert whole.kinds == {"m": Reduce.MEAN, "p": Reduce.MAX, "s": Reduce.SUM}
