"""Training groups as the store holds them: in flight, and the filters a complete one meets.

Filters run when a group completes, on the whole group: ``filter_truncated``
drops a group if any of its samples hit the length limit (keeping the rest
would serve a group short of samples, its baseline computed without the
truncated ones), and ``filter_equal_rewards`` drops a group whose rewards are
all equal (DAPO's dynamic sampling: it has no learning signal under GRPO; a
group of one sample always qualifies).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

from asyncrl.buffer.counters import Count
from asyncrl.core.messages import TrajectoryMeta, WorkItem

if TYPE_CHECKING:
    from asyncrl.config import BufferConfig
    from asyncrl.core.trajectory import Sample

FILTERS = ("truncated", "equal_rewards")
"""Filter reasons; each is counted as ``filtered_<reason>``."""
SKIP_REASONS = ("stale", *(f"filtered_{reason}" for reason in FILTERS))
"""Why a prompt handed out was given up on (:attr:`BufferStore.skipped
<asyncrl.buffer.store.BufferStore.skipped>`)."""


@dataclass
class Group:
    item: WorkItem
    generator_id: str
    """The generator it is dispatched to: the only one whose samples it accepts."""
    samples: dict[int, Sample] = field(default_factory=dict)
    nbytes: int = 0
    times_served: int = 0
    """Batches that have held this group; ``max_reuse`` bounds it."""

    def add(self, sample: Sample) -> None:
        self.samples[sample.meta.sample_index] = sample
        self.nbytes += sample.nbytes
        self.__dict__.pop("version", None)  # computed again from the samples now held

    @property
    def complete(self) -> bool:
        return len(self.samples) == self.item.num_samples

    @cached_property
    def version(self) -> int:
        return min(sample.version for sample in self.samples.values())

    @property
    def response_tokens(self) -> int:
        return sum(sample.meta.response_len for sample in self.samples.values())


def filter_reason(group: Group, config: BufferConfig) -> str | None:
    """Which of :data:`FILTERS` drops the complete ``group``, or None: it is kept."""
    samples = group.samples.values()
    if config.filter_truncated and any(s.meta.finish_reason == "length" for s in samples):
        return "truncated"
    if config.filter_equal_rewards and len({s.meta.reward for s in samples}) == 1:
        return "equal_rewards"
    return None


def group_version(group: Group) -> int:
    return group.version


class InFlight(dict[int, Group]):
    """Training groups handed out and not complete yet, by group id.

    A sample is accepted only for a group in flight, from the generator it is
    dispatched to, once per index (the store's invariant 4: :meth:`rejection`).
    """

    def of(self, generator_id: str) -> list[Group]:
        return [g for g in self.values() if g.generator_id == generator_id]

    def owed(self, generator_id: str) -> int:
        """Samples handed to ``generator_id`` and not delivered yet."""
        return sum(g.item.num_samples - len(g.samples) for g in self.of(generator_id))

    def item_for(self, meta: TrajectoryMeta) -> WorkItem | None:
        """The WorkItem of ``meta``'s group if it is in flight to ``meta``'s generator."""
        group = self.get(meta.group_id)
        if group is None or group.generator_id != meta.generator_id:
            return None
        return group.item

    def rejection(self, sample: Sample, cursor: int) -> Count | None:
        """Why ``sample`` cannot be accepted, as the counter of its kind, or None; a group
        id below ``cursor`` not in flight was dispatched before (a duplicate)."""
        group = self.get(sample.meta.group_id)
        index = sample.meta.sample_index
        if group is None:
            dispatched_before = 0 <= sample.meta.group_id < cursor
            return Count.DROPPED_DUPLICATE if dispatched_before else Count.DROPPED_UNKNOWN_GROUP
        if sample.meta.generator_id != group.generator_id or index in group.samples:
            return Count.DROPPED_DUPLICATE
        if not 0 <= index < group.item.num_samples:
            return Count.DROPPED_BAD_INDEX
        return None
