"""How a statistic combines across micro-batches, ranks and replicas, declared with it.

A loss summed over micro-batches, a token-weighted mean, the largest importance
weight, a replica's count of samples or its longest chunk: each combines in its
own way, and every place that combines values (the learner's micro-batches and
ranks, the buffer's replicas and pools) must agree. So a value travels as a
:class:`Stat` that says which, and :class:`Reduction` combines any number of them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum


class Reduce(StrEnum):
    """How values of one statistic combine."""

    SUM = "sum"
    """Counts and shares of a whole: they add up."""
    MEAN = "mean"
    """A weighted mean: ``sum(value * weight) / sum(weight)``."""
    MAX = "max"
    """A peak: the largest."""


@dataclass(frozen=True, slots=True)
class Stat:
    """One value of a statistic, with how it combines (and its weight, for a mean)."""

    value: float
    weight: float = 1.0
    reduce: Reduce = Reduce.MEAN

    @classmethod
    def mean(cls, value: float, weight: float) -> Stat:
        return cls(value, weight, Reduce.MEAN)

    @classmethod
    def total(cls, value: float) -> Stat:
        return cls(value, 1.0, Reduce.SUM)

    @classmethod
    def peak(cls, value: float) -> Stat:
        return cls(value, 1.0, Reduce.MAX)


class Reduction:
    """Combines :class:`Stat` values by key; a key keeps the kind it was first added with.

    ``sums`` and ``maxima`` are the running state (for a mean: ``(sum of value x weight,
    sum of weight)``), in the order keys were first added, so they can be reduced across
    processes as two tables (:meth:`tables`, then :meth:`from_tables`)."""

    def __init__(self) -> None:
        self.kinds: dict[str, Reduce] = {}
        self.sums: dict[str, list[float]] = {}
        self.maxima: dict[str, float] = {}

    def add(self, key: str, stat: Stat) -> None:
        kind = self.kinds.setdefault(key, stat.reduce)
        if kind is not stat.reduce:
            raise ValueError(f"{key} is reduced by {kind}, not {stat.reduce}")
        if kind is Reduce.MAX:
            self.maxima[key] = max(self.maxima.get(key, -math.inf), stat.value)
            return
        running = self.sums.setdefault(key, [0.0, 0.0])
        if kind is Reduce.MEAN:
            running[0] += stat.value * stat.weight
            running[1] += stat.weight
        else:
            running[0] += stat.value
            running[1] += 1.0

    def update(self, stats: dict[str, Stat]) -> None:
        for key, stat in stats.items():
            self.add(key, stat)

    def tables(self) -> tuple[list[str], list[list[float]], list[str], list[float]]:
        """The keys summed and their ``[sum, weight]`` rows (reduced across processes by
        a sum), then the keys of peaks and their values (reduced by a max); sorted keys."""
        summed = sorted(self.sums)
        peaks = sorted(self.maxima)
        return (summed, [self.sums[k] for k in summed], peaks, [self.maxima[k] for k in peaks])

    def from_tables(self, summed: list[list[float]], peaks: list[float]) -> dict[str, float]:
        """The results, from :meth:`tables`' rows reduced across processes (or as they are)."""
        keys, _, peak_keys, _ = self.tables()
        out = {}
        for key, (total, weight) in zip(keys, summed, strict=True):
            if self.kinds[key] is Reduce.SUM:
                out[key] = total
            else:
                out[key] = total / weight if weight else float("nan")
        return out | dict(zip(peak_keys, peaks, strict=True))

    def results(self) -> dict[str, float]:
        """The results of this process's values alone."""
        _, summed, _, peaks = self.tables()
        return self.from_tables(summed, peaks)
