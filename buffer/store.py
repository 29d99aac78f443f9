"""The buffer's state: dispatch, ingest, staleness and batches, with no I/O.

::

    dispatch() ──▶ in_flight ──ingest()──▶ partial groups ──▶ ready groups ──take_batch()──▶ learner
        ▲ admission control                                     │ evict if stale
        └── started samples fit in (V + k + 1) * samples_per_step

Invariant: no sample handed to the learner at version V has staleness
``V - version > max_staleness``, where a sample's version is the oldest weight
version among its tokens. :meth:`BufferStore.take_batch` enforces it, and is
the only way samples leave for the learner. Every sample that leaves any other
way is counted in :attr:`counters` by reason.

Prompts are a pure function of an integer index (the dataset cursor), and the
group id of a prompt is its index, so a group is identified across restarts.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from asyncrl.messages import TrajectoryMeta, WorkItem


@dataclass
class Sample:
    """One finished trajectory as the buffer holds it."""

    meta: TrajectoryMeta
    prompt_ids: np.ndarray
    response_ids: np.ndarray
    logprobs: np.ndarray
    token_versions: np.ndarray
    loss_mask: np.ndarray

    @property
    def version(self) -> int:
        """The oldest weight version among its generated tokens."""
        return int(self.token_versions.min()) if self.token_versions.size else 0


@dataclass
class Group:
    item: WorkItem
    generator_id: str
    samples: dict[int, Sample] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return len(self.samples) == self.item.num_samples

    @property
    def version(self) -> int:
        return min(sample.version for sample in self.samples.values())


class BufferStore:
    def __init__(
        self,
        make_item: Callable[[int], WorkItem],
        samples_per_step: int,
        max_staleness: int,
        admission_control: bool = True,
    ):
        self.make_item = make_item
        self.samples_per_step = samples_per_step
        self.max_staleness = max_staleness
        self.admission_control = admission_control
        self.policy_version = 0
        self.cursor = 0
        """Index of the next prompt to hand out."""
        self.in_flight: dict[int, Group] = {}
        """Dispatched groups not yet complete, by group id."""
        self.ready: list[Group] = []
        """Complete groups waiting for the learner, oldest version first."""
        self.started_samples = 0
        """Samples dispatched and not since evicted or dropped: what admission bounds."""
        self.counters: Counter[str] = Counter()
        self.served_staleness: list[int] = []

    # ---------------------------------------------------------------- dispatch

    def admission_limit(self) -> int:
        return (self.policy_version + self.max_staleness + 1) * self.samples_per_step

    def dispatch(self, generator_id: str, max_samples: int) -> list[WorkItem]:
        """Hand out whole groups while they fit in ``max_samples`` and admission allows."""
        items: list[WorkItem] = []
        budget = max_samples
        while True:
            item = self.make_item(self.cursor)
            if item.num_samples > budget:
                break
            if (
                self.admission_control
                and self.started_samples + item.num_samples > self.admission_limit()
            ):
                self.counters["dispatch_refused_admission"] += 1
                break
            self.cursor += 1
            budget -= item.num_samples
            self.started_samples += item.num_samples
            self.in_flight[item.group_id] = Group(item, generator_id)
            items.append(item)
        self.counters["dispatched_groups"] += len(items)
        return items

    # ------------------------------------------------------------------ ingest

    def ingest(self, samples: list[Sample]) -> int:
        """Accept samples of groups in flight; drop (and count) anything else. Returns accepted."""
        accepted = 0
        for sample in samples:
            group = self.in_flight.get(sample.meta.group_id)
            index = sample.meta.sample_index
            if group is None:
                self.counters["dropped_unknown_group"] += 1
            elif index in group.samples:
                self.counters["dropped_duplicate"] += 1
            elif not 0 <= index < group.item.num_samples:
                self.counters["dropped_bad_index"] += 1
            else:
                group.samples[index] = sample
                accepted += 1
                if group.complete:
                    del self.in_flight[group.item.group_id]
                    self.ready.append(group)
        self.counters["accepted"] += accepted
        self.ready.sort(key=lambda g: g.version)
        return accepted

    # ----------------------------------------------------------------- batches

    def set_policy_version(self, version: int) -> None:
        self.policy_version = max(self.policy_version, version)

    def evict_stale(self) -> None:
        """Drop ready groups that are already too stale for the current version."""
        keep = []
        for group in self.ready:
            if self.policy_version - group.version > self.max_staleness:
                self._discard(group, "dropped_stale")
            else:
                keep.append(group)
        self.ready = keep

    def take_batch(self) -> list[Sample] | None:
        """``samples_per_step`` samples from complete groups, oldest first, or None yet."""
        self.evict_stale()
        if self.held_samples() < self.samples_per_step:
            return None
        batch: list[Sample] = []
        while self.ready and len(batch) + self.ready[0].item.num_samples <= self.samples_per_step:
            group = self.ready.pop(0)
            batch.extend(group.samples[i] for i in sorted(group.samples))
        staleness = [self.policy_version - s.version for s in batch]
        assert max(staleness) <= self.max_staleness, "take_batch served a stale sample"
        self.served_staleness = staleness
        self.counters["served"] += len(batch)
        return batch

    # ----------------------------------------------------------------- metrics

    def held_samples(self) -> int:
        return sum(len(g.samples) for g in self.ready)

    def stats(self) -> dict[str, float]:
        generated = self.counters["accepted"]
        return {
            "buffer_held": float(self.held_samples()),
            "buffer_in_flight_groups": float(len(self.in_flight)),
            "buffer_dropped_stale": float(self.counters["dropped_stale"]),
            "buffer_dropped_duplicate": float(self.counters["dropped_duplicate"]),
            "buffer_dropped_unknown": float(self.counters["dropped_unknown_group"]),
            "buffer_evicted_frac": self.counters["dropped_stale"] / generated if generated else 0.0,
            "buffer_cursor": float(self.cursor),
            "buffer_admission_refusals": float(self.counters["dispatch_refused_admission"]),
        }

    def _discard(self, group: Group, reason: str) -> None:
        self.counters[reason] += len(group.samples)
        self.started_samples -= group.item.num_samples
