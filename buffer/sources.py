"""Where the buffer's work comes from: an ordered list of sources, each asked in turn.

::

    dispatch(generator, max_samples)
      ├─▶ RequeuedGroups   groups taken back (a silent generator's, a stale group retried,
      │                    a restored checkpoint's unfinished ones); not under back-pressure
      ├─▶ EvalRoundSource  the running eval round's groups; even under admission control
      │                    or back-pressure (they add nothing the learner must take)
      └─▶ NewPrompts       prompts from the dataset cursor, within admission; only once
                           no source before it has work waiting

Each source hands out whole groups that fit the samples left of one request
(:class:`Ask`) and says whether work waits in it. Training groups are booked in
the store (:meth:`Ledger.book`), which tracks them in flight; a source that is
not training data (the eval round) keeps its own groups in flight, and the
store hands it what belongs to them: samples (:meth:`WorkSource.claims`), a
generator forgotten, the stats a batch carries.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from asyncrl.buffer.counters import Count
from asyncrl.buffer.evaluation import EvalRounds
from asyncrl.core.messages import NOT_EVAL, TrajectoryMeta, WorkItem

if TYPE_CHECKING:
    from asyncrl.core.trajectory import Sample


@dataclass
class Ask:
    """One request for work, as each source in turn sees it."""

    generator_id: str
    budget: int
    """Samples that may still be handed out."""
    backpressured: bool
    retry: bool = False
    """A held request tried again: its refusals were counted when it was first refused."""
    behind: bool = False
    """A source before this one has work waiting (new prompts wait for it)."""
    refusals: Counter[Count] = field(default_factory=Counter)
    """Refusals met on the way; the store counts them (not those of a fruitless retry)."""

    def fits(self, item: WorkItem) -> bool:
        return item.num_samples <= self.budget

    def hand(self, item: WorkItem) -> None:
        self.budget -= item.num_samples


class Ledger(Protocol):
    """What a training source needs of the store: its counters, admission, booking."""

    counters: Counter[str]

    def admit(self, num_samples: int) -> bool:
        """Count a new prompt's samples as started if admission allows (else False)."""
        ...

    def book(self, item: WorkItem, generator_id: str) -> None:
        """Track ``item``'s group as in flight to ``generator_id``."""
        ...


class WorkSource:
    """A place work comes from. The store asks each source in order (:meth:`take`);
    the methods after :meth:`state` concern a source that keeps its own groups in
    flight and are no-ops for one whose groups the store books."""

    def take(self, ask: Ask) -> list[WorkItem]:
        """Whole groups that fit ``ask.budget``, in order, each handed (``ask.hand``)."""
        raise NotImplementedError

    def waiting(self) -> bool:
        """Work waits here: the sources after this one hold back new prompts."""
        return False

    def state(self) -> tuple:
        """What a refused :meth:`take` depends on besides admission and back-pressure."""
        return ()

    def claims(self, meta: TrajectoryMeta) -> bool:
        """``meta``'s sample belongs to a group of this source's own."""
        return False

    def handed_out(self, meta: TrajectoryMeta) -> WorkItem | None:
        return None

    def ingest(self, sample: Sample, now: float | None) -> bool:
        raise NotImplementedError(f"{type(self).__name__} claims no samples")

    def in_flight_samples(self, generator_id: str) -> int:
        return 0

    def forget(self, generator_id: str) -> int:
        """Hand ``generator_id``'s unfinished groups of this source out again; how many."""
        return 0

    def batch_stats(self) -> dict[str, float]:
        """Figures that ride along with the next batch served, handed over once."""
        return {}

    def give_back(self, stats: dict[str, float]) -> None:
        """The batch that carried ``stats`` was never trained: hand them over again."""

    def stats(self) -> dict[str, float]:
        """This source's own metrics."""
        return {}


class RequeuedGroups(WorkSource):
    """Groups taken back, handed out again first, in order. No admission check: their
    samples were counted as started when first dispatched."""

    def __init__(self, ledger: Ledger):
        self.ledger = ledger
        self.items: deque[WorkItem] = deque()
        self.arrivals = 0
        """Groups ever put here (with ``len(items)``: whether the queue changed)."""

    def put(self, item: WorkItem) -> None:
        self.items.append(item)
        self.arrivals += 1

    def take(self, ask: Ask) -> list[WorkItem]:
        if ask.backpressured:
            return []
        items: list[WorkItem] = []
        while self.items and ask.fits(self.items[0]):
            item = self.items.popleft()
            ask.hand(item)
            self.ledger.book(item, ask.generator_id)
            items.append(item)
        self.ledger.counters[Count.REDISPATCHED_GROUPS] += len(items)
        return items

    def waiting(self) -> bool:
        return bool(self.items)

    def state(self) -> tuple:
        return (len(self.items), self.arrivals)


class EvalRoundSource(WorkSource):
    """The running eval round's groups (:mod:`asyncrl.buffer.evaluation`): dispatched
    like training groups, tracked apart, never admitted, held, evicted or served."""

    def __init__(self, rounds: EvalRounds):
        self.rounds = rounds

    def take(self, ask: Ask) -> list[WorkItem]:
        items = self.rounds.dispatch(ask.generator_id, ask.budget)
        for item in items:
            ask.hand(item)
        return items

    def waiting(self) -> bool:
        return self.rounds.waiting()

    def state(self) -> tuple:
        return self.rounds.dispatch_state()

    def claims(self, meta: TrajectoryMeta) -> bool:
        return meta.eval_round != NOT_EVAL

    def handed_out(self, meta: TrajectoryMeta) -> WorkItem | None:
        return self.rounds.handed_out(meta)

    def ingest(self, sample: Sample, now: float | None) -> bool:
        return self.rounds.ingest(sample.meta, sample.token_versions, now)

    def in_flight_samples(self, generator_id: str) -> int:
        return self.rounds.in_flight_samples(generator_id)

    def forget(self, generator_id: str) -> int:
        return self.rounds.forget(generator_id)

    def batch_stats(self) -> dict[str, float]:
        return self.rounds.next_results()  # a finished round's results, once

    def give_back(self, stats: dict[str, float]) -> None:
        self.rounds.give_back(stats)

    def stats(self) -> dict[str, float]:
        return self.rounds.stats()


class NewPrompts(WorkSource):
    """Prompts from the dataset cursor while they fit and admission allows.

    Prompts are a pure function of an integer index (``make_item``), and a
    prompt's group id is its index, so a group is identified across restarts, and
    a group id below the cursor that is not in flight was dispatched before. A
    requeued group (a silent generator's, or a stale one retried) keeps its id, so
    ``trained_groups.jsonl`` names each prompt by the same id however often it went
    out. A prompt trained before a restore
    (:attr:`trained_ahead`) is passed over, its samples counted as started, as
    they were when the learner trained them.
    """

    def __init__(self, make_item: Callable[[int], WorkItem], ledger: Ledger):
        self.make_item = make_item
        self.ledger = ledger
        self.cursor = 0
        """Index of the next prompt to hand out."""
        self.trained_ahead: set[int] = set()
        """Prompts at or past the cursor that a restored state says were trained: the
        cursor passes over them, they are never handed out."""

    def take(self, ask: Ask) -> list[WorkItem]:
        if ask.backpressured or ask.behind:
            return []
        items: list[WorkItem] = []
        while True:
            item = self.make_item(self.cursor)
            trained = self.cursor in self.trained_ahead
            if not trained and not ask.fits(item):
                break
            if not self.ledger.admit(item.num_samples):
                ask.refusals[Count.DISPATCH_REFUSED_ADMISSION] += 1
                break
            self.cursor += 1
            if trained:
                self.trained_ahead.discard(item.group_id)
                self.ledger.counters[Count.RESTORED_SKIPPED_TRAINED] += 1
                continue
            ask.hand(item)
            self.ledger.book(item, ask.generator_id)
            items.append(item)
        return items
