"""Complete training groups waiting for the learner, and the batches made of them.

::

    complete group ──add()──▶ groups (oldest version first) ──take()──▶ batch
                                 ▲  │ evict(): too stale                 │
                                 │  ▼ served ones retire; never-served   │
                                 │    ones go back to the store          │
                                 └──── kept while times_served < max_reuse
                                       return_last(): the last batch, as if never served

:meth:`ReadyGroups.take` enforces freshness and reuse (the store's invariants 1
and 2): it serves only groups within ``max_staleness`` of the current version,
each at most once per batch and ``max_reuse`` times in all.
"""

from __future__ import annotations

import bisect
from collections import Counter
from typing import TYPE_CHECKING

from asyncrl.buffer.counters import Count
from asyncrl.buffer.groups import Group, group_version
from asyncrl.core.trajectory import UNVERSIONED

if TYPE_CHECKING:
    from asyncrl.config import BufferConfig
    from asyncrl.core.trajectory import Sample


class ReadyGroups:
    """Ready groups, oldest version first, and the last batch served."""

    def __init__(self, config: BufferConfig, samples_per_step: int, counters: Counter[str]):
        self.config = config
        self.samples_per_step = samples_per_step
        self.counters = counters
        """The store's counters: servings and hand-backs are counted there."""
        self.groups: list[Group] = []
        self.last_batch: list[Group] = []
        """The groups of the last batch served, until :meth:`return_last` or the next."""
        self.served_staleness: list[int] = []
        """Staleness of each sample of the last batch served."""

    def add(self, group: Group) -> None:
        # keeps ``groups`` oldest version first, after groups of the same version (as a
        # stable sort would) without re-sorting every held group on each ingest
        bisect.insort(self.groups, group, key=group_version)

    def held_samples(self) -> int:
        """Samples in ready groups (including groups kept for reuse)."""
        return sum(len(g.samples) for g in self.groups)

    def evict(self, policy_version: int) -> list[Group]:
        """Drop groups already too stale for ``policy_version``: one kept for reuse was
        served already and simply retires; the never-served ones are returned, counted
        in ``dropped_stale_response_tokens``, for the store to requeue or skip."""
        keep: list[Group] = []
        unserved: list[Group] = []
        for group in self.groups:
            if policy_version - group.version <= self.config.max_staleness:
                keep.append(group)
            elif group.times_served:
                self.counters[Count.RETIRED_STALE_AFTER_SERVING] += len(group.samples)
            else:
                self.counters[Count.DROPPED_STALE_RESPONSE_TOKENS] += group.response_tokens
                unserved.append(group)
        self.groups = keep
        return unserved

    def take(self, policy_version: int) -> list[Sample] | None:
        """``samples_per_step`` samples of whole groups, oldest first, or None yet; call
        :meth:`evict` first."""
        if self.held_samples() < self.samples_per_step:
            return None
        batch: list[Sample] = []
        taken: list[Group] = []
        while self.groups and len(batch) + self.groups[0].item.num_samples <= self.samples_per_step:
            group = self.groups.pop(0)
            batch.extend(group.samples[i] for i in sorted(group.samples))
            taken.append(group)
        staleness = [policy_version - s.version for s in batch if s.version != UNVERSIONED]
        stalest = max(staleness, default=0)
        assert stalest <= self.config.max_staleness, "take_batch served a stale sample"
        for group in taken:
            self._after_serving(group)
        self.last_batch = taken
        self.groups.sort(key=group_version)
        self.served_staleness = staleness
        self.counters[Count.SERVED] += len(batch)
        self.counters[Count.SERVED_RESPONSE_TOKENS] += sum(s.meta.response_len for s in batch)
        return batch

    def _after_serving(self, group: Group) -> None:
        """Count a serving; keep the group for another while it has servings left."""
        group.times_served += 1
        if group.times_served > 1:
            self.counters[Count.SERVED_AGAIN] += len(group.samples)
        if group.times_served < self.config.max_reuse:
            self.groups.append(group)

    def return_last(self) -> int:
        """Take back the last batch served: its groups are ready again as if never served
        (so the durable state lists the ones served for the first time as unfinished);
        returns their samples."""
        returned = 0
        for group in self.last_batch:
            if group.times_served > 1:
                self.counters[Count.SERVED_AGAIN] -= len(group.samples)
            group.times_served -= 1
            if all(kept is not group for kept in self.groups):
                self.groups.append(group)
            returned += len(group.samples)
            self.counters[Count.SERVED_RESPONSE_TOKENS] -= group.response_tokens
        self.groups.sort(key=group_version)
        self.counters[Count.SERVED] -= returned
        self.counters[Count.RETURNED_UNCONSUMED] += returned
        self.last_batch = []
        return returned
