"""The buffer's state: dispatch, liveness, ingest, filters, staleness and batches, with no I/O.

::

    requeue ──┐ handed out first           filters ──▶ filtered
    dispatch() ──▶ in_flight ──ingest()──▶ ready groups ──take_batch()──▶ learner
      ▲ admission,     │                     │  ▲ evict if stale    │
      │ back-pressure  │ expire_silent()     │  └── re-served while ┘
      │                ▼                     ▼      times < max_reuse
      └──────────── requeue ◀── retries ── dropped_stale ──▶ skipped (by id)

Time is always an argument (``now``, seconds on one monotonic clock, supplied
by the service or a test), never read here: the store stays pure and tests
drive the clock.

Invariants, and the method that enforces each:

1. Freshness: no sample handed to the learner at version V has staleness
   ``V - version > max_staleness``, where a sample's version is the oldest
   weight version among its tokens. :meth:`BufferStore.take_batch` enforces it
   (evicting through :meth:`~BufferStore.evict_stale` first) and is the only
   way samples leave for the learner.
2. Reuse: each (group, sample) is served at most ``max_reuse`` times.
   :meth:`~BufferStore.take_batch` counts servings per group and only puts a
   served group back while it has servings left; it never holds one group
   twice in a batch.
3. Admission: after every :meth:`~BufferStore.dispatch`, ``started_samples <=
   admission_limit()``. New prompts are admitted only within the limit;
   requeued groups were counted when first dispatched and are not counted again
   (a group evicted as stale and requeued keeps its budget too).
4. Whole groups from one generator: :meth:`~BufferStore.ingest` accepts a
   sample only for a group in flight, from the generator it is dispatched to,
   once per index. A sample for a group that was requeued or already completed
   (a slow generator presumed dead) is dropped as ``dropped_duplicate``.
   :meth:`~BufferStore.expire_silent` discards a silent generator's partial
   samples when it requeues its groups, so a group is regenerated whole.
   Ownership is by generator id: a generator presumed dead that asks again and
   is handed back its own requeued group may deliver old and new samples of
   it; both are samples of the same prompt from the same generator. The
   service lets only one process (incarnation) speak for a live id, and a new
   one takes an id over only after :meth:`~BufferStore.replace`,
   :meth:`~BufferStore.leave` or expiry requeued every group of the old one, so
   a group booked to an id is always booked to its current process.
5. Accounting: every accepted sample is in exactly one place, so (with
   ``served_first = served - served_again``; with ``max_reuse = 1`` that is
   just ``served``)::

       accepted == served_first + dropped_stale + filtered + discarded_requeue
                   + held_unserved + partial

   where ``held_unserved`` are samples in ready groups never served and
   ``partial`` those of groups still in flight (:meth:`~BufferStore.accounted`).
   Each method that moves samples counts the move. ``dropped_stale`` counts every
   stale eviction's samples, also of groups whose prompt then goes out again (8.), so
   one prompt's samples may be accepted more than once.
6. Groups: ``dispatched_groups == completed_groups + requeued_groups +
   len(in_flight)``: every dispatched group is completed (then ready, served,
   filtered or evicted), requeued, or still in flight.
7. Back-pressure: :meth:`~BufferStore.dispatch` hands out nothing while held
   samples or bytes are at their bound (:meth:`~BufferStore.backpressured`).
   Nothing is dropped to make room and :meth:`~BufferStore.take_batch` is never
   blocked; the bound applies only once a batch can be formed, so it cannot
   starve the learner.
8. Prompts: every prompt below the cursor is, at any time, exactly one of trained
   (served, or before a restore), unfinished (in flight, requeued, or ready and
   never served: what :meth:`~BufferStore.durable_state` lists), or skipped,
   recorded by id with its reason in :attr:`BufferStore.skipped`. Nothing is given
   up on without a name. A group evicted as stale before it was ever served is
   requeued whole (its prompt, same group id) up to ``stale_retries`` times
   (``stale_requeued_groups``); after that its prompt is skipped (``stale``). A
   filtered group's prompt is skipped at once (``filtered_<reason>``): by design it
   has no training signal, and a prompt whose group is all equal or truncated would
   most likely be again.

Filters (:mod:`asyncrl.buffer.groups`) run when a group completes, on the whole
group; filtered samples free admission budget like skipped stale ones. Every
sample that leaves other than by ``take_batch`` is counted in
:attr:`BufferStore.counters` by reason (:class:`~asyncrl.buffer.counters.Count`),
and every prompt given up on is in :attr:`BufferStore.skipped` (invariant 8).
Partial samples discarded when a group is requeued (``discarded_requeue``) lose
no prompt: the group goes out again.

Work comes from an ordered list of sources (:mod:`asyncrl.buffer.sources`):
requeued groups, the running eval round, new prompts. Held-out eval rounds
(:mod:`asyncrl.buffer.evaluation`) share dispatch and liveness with training but
none of its accounting: their groups are tracked by their source, never ready,
evicted or served. The invariants above count training samples and groups only.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from asyncrl.buffer import durable
from asyncrl.buffer.batches import ReadyGroups
from asyncrl.buffer.counters import Count
from asyncrl.buffer.durable import PromptRecord, Skip
from asyncrl.buffer.evaluation import EvalRounds
from asyncrl.buffer.groups import SKIP_REASONS as SKIP_REASONS  # tests import it here
from asyncrl.buffer.groups import Group, InFlight, filter_reason
from asyncrl.buffer.metrics import IngestRate, store_metrics
from asyncrl.buffer.sources import Ask, EvalRoundSource, NewPrompts, RequeuedGroups, WorkSource
from asyncrl.core.messages import TrajectoryMeta, WorkItem
from asyncrl.core.trajectory import Sample

if TYPE_CHECKING:
    from asyncrl.config import BufferConfig


class BufferStore:
    """The buffer's state machine over training groups; work comes from :attr:`sources`."""

    def __init__(
        self,
        config: BufferConfig,
        make_item: Callable[[int], WorkItem],
        samples_per_step: int,
        eval_items: Sequence[WorkItem] = (),
    ):
        self.config = config
        """The run's ``buffer`` section: staleness, admission, reuse, filters, bounds."""
        self.make_item = make_item
        self.samples_per_step = samples_per_step
        self.max_held_samples = config.max_held_samples or 4 * samples_per_step
        """Back-pressure bound on held ready samples (0 in the config: 4 batches)."""
        self.policy_version = 0
        self.in_flight = InFlight()
        """Dispatched training groups not yet complete, by group id."""
        self.started_samples = 0
        """Samples dispatched and not since evicted or dropped: what admission bounds."""
        self.last_seen: dict[str, float] = {}
        """Generator id -> time of its last message, for generators not yet expired."""
        self.counters: Counter[str] = Counter()
        """Keyed by :class:`~asyncrl.buffer.counters.Count`, whose metric names derive."""
        self.reward_error_kinds: Counter[str] = Counter()  # ``error:timeout`` as error_timeout
        self.batches = ReadyGroups(config, samples_per_step, self.counters)
        """Complete groups waiting for the learner, and the last batch served."""
        self.ingest_rate = IngestRate()
        """Accepted samples per second between the last two ``stats(now)`` calls."""
        self.evaluation = EvalRounds(eval_items)
        """Held-out eval rounds on ``eval_items`` (none: evaluation is off)."""
        self.requeued = RequeuedGroups(self)
        self.new_prompts = NewPrompts(make_item, self)
        self.sources: tuple[WorkSource, ...] = (
            self.requeued,
            EvalRoundSource(self.evaluation),
            self.new_prompts,
        )
        """Asked for work in this order (:mod:`asyncrl.buffer.sources`)."""
        self.batch_extras: list[tuple[WorkSource, dict[str, float]]] = []
        """What the sources handed over with the last batch served, by source."""
        self.prompts = PromptRecord()  # stale retries used, prompts given up on (invariant 8)

    @property
    def ready(self) -> list[Group]:
        """Complete groups waiting for the learner, oldest version first."""
        return self.batches.groups

    @property
    def skipped(self) -> list[Skip]:
        """Every prompt handed out and given up on, in order (invariant 8)."""
        return self.prompts.skipped

    @property
    def cursor(self) -> int:
        """Index of the next prompt to hand out."""
        return self.new_prompts.cursor

    @property
    def requeue(self) -> deque[WorkItem]:
        """Training groups taken back, handed out before new prompts."""
        return self.requeued.items

    @property
    def batch_eval_results(self) -> dict[str, float]:
        """The eval results handed over with the last batch served (empty: none)."""
        return {key: value for _, stats in self.batch_extras for key, value in stats.items()}

    # ---------------------------------------------------------------- liveness

    def heartbeat(self, generator_id: str, now: float) -> None:
        """Record that ``generator_id`` is alive at ``now``; any message from it counts."""
        self.last_seen[generator_id] = max(now, self.last_seen.get(generator_id, now))
        self.ingest_rate.start(now, self.counters[Count.ACCEPTED])

    def expire_silent(self, now: float) -> list[str]:
        """Requeue the unfinished groups of generators silent for over the timeout.

        Their partial samples are discarded (counted as ``discarded_requeue``) so
        each group is regenerated whole by one generator, never stitched from
        two. The requeued groups keep their admission budget: they were counted
        when first dispatched. Returns the expired generators' ids.
        """
        expired = sorted(
            generator_id
            for generator_id, seen in self.last_seen.items()
            if now - seen > self.config.heartbeat_timeout_s
        )
        for generator_id in expired:
            self._forget(generator_id)
        return expired

    def leave(self, generator_id: str) -> int:
        """``generator_id`` stopped on purpose: requeue its unfinished groups now.

        Returns how many were requeued (counted like expiry's, as ``requeued_groups``)."""
        self.counters[Count.GENERATORS_LEFT] += 1
        return self._forget(generator_id)

    def replace(self, generator_id: str, now: float) -> int:
        """A new process took over ``generator_id`` (a restart that kept the id): the old
        one's unfinished groups are requeued now, counted as ``generators_replaced``, and
        the id is alive at ``now``. Returns how many groups were requeued."""
        self.counters[Count.GENERATORS_REPLACED] += 1
        requeued = self._forget(generator_id)
        self.heartbeat(generator_id, now)
        return requeued

    def in_flight_samples(self, generator_id: str) -> int:
        """Samples handed to ``generator_id`` (training and eval) and not delivered yet."""
        owed = self.in_flight.owed(generator_id)
        return owed + sum(source.in_flight_samples(generator_id) for source in self.sources)

    def handed_out(self, meta: TrajectoryMeta) -> WorkItem | None:
        """The WorkItem of ``meta``'s group if that group is in flight to ``meta``'s
        generator (the one a sample of it may come from), else None."""
        owner = self._claimant(meta)
        return self.in_flight.item_for(meta) if owner is None else owner.handed_out(meta)

    def _forget(self, generator_id: str) -> int:
        """Stop tracking ``generator_id`` and requeue its unfinished groups (the sources'
        own too); how many."""
        self.last_seen.pop(generator_id, None)
        groups = self.in_flight.of(generator_id)
        for group in groups:
            del self.in_flight[group.item.group_id]
            self.counters[Count.DISCARDED_REQUEUE] += len(group.samples)
            self.counters[Count.REQUEUED_GROUPS] += 1
            self.requeued.put(group.item)
        return len(groups) + sum(source.forget(generator_id) for source in self.sources)

    def refuse(self, samples: list[Sample], reason: Count) -> int:
        """Samples that must not be trained on: each counted under ``reason``, its group
        regenerated whole (requeued, its partial samples discarded, as for a silent
        generator). Returns the groups requeued."""
        requeued = 0
        for sample in samples:
            self.counters[reason] += 1
            meta = sample.meta
            owner = self._claimant(meta)
            if owner is not None:  # an eval round's: the source hands it out again
                requeued += owner.forget(meta.generator_id)
                continue
            group = self.in_flight.get(meta.group_id)
            if group is None or group.generator_id != meta.generator_id:
                continue  # not in flight to its sender: nothing to requeue
            del self.in_flight[meta.group_id]
            self.counters[Count.DISCARDED_REQUEUE] += len(group.samples)
            self.counters[Count.REQUEUED_GROUPS] += 1
            self.requeued.put(group.item)
            requeued += 1
        return requeued

    def _claimant(self, meta: TrajectoryMeta) -> WorkSource | None:
        """The source whose own group ``meta``'s sample is of (an eval round's), if any."""
        return next((source for source in self.sources if source.claims(meta)), None)

    # ---------------------------------------------------------------- dispatch

    def admission_limit(self) -> int:
        return (self.policy_version + self.config.max_staleness + 1) * self.samples_per_step

    def dispatch(
        self, generator_id: str, max_samples: int, now: float | None = None, retry: bool = False
    ) -> list[WorkItem]:
        """Hand out whole groups that fit in ``max_samples``, from each of :attr:`sources`
        in turn: requeued ones, then the running eval round's, then new prompts (only
        once neither kind waits).

        Under back-pressure only eval groups are handed out. Asking counts as a
        heartbeat when ``now`` is given. A ``retry`` of a request refused before (a held
        one) counts its refusals again only if it gets work.
        """
        if now is not None:
            self.heartbeat(generator_id, now)
        ask = Ask(generator_id, max_samples, self.backpressured(), retry)
        if ask.backpressured:
            ask.refusals[Count.DISPATCH_REFUSED_BACKPRESSURE] += 1
        items: list[WorkItem] = []
        for source in self.sources:
            items += source.take(ask)
            ask.behind = ask.behind or source.waiting()
        if items or not retry:
            self.counters.update(ask.refusals)
        return items

    def admit(self, num_samples: int) -> bool:
        """Count a new prompt's samples as started, if admission allows (invariant 3)."""
        limit = self.admission_limit()
        if self.config.admission_control and self.started_samples + num_samples > limit:
            return False
        self.started_samples += num_samples
        return True

    def book(self, item: WorkItem, generator_id: str) -> None:
        """A training group handed out to ``generator_id``: in flight until complete."""
        self.in_flight[item.group_id] = Group(item, generator_id)
        self.counters[Count.DISPATCHED_GROUPS] += 1

    def backpressured(self) -> bool:
        """Held ready samples or held bytes at their bound, and a batch can be formed.

        While the ready samples cannot fill a batch, refusing work would stall
        the learner and the generators alike, so the bound does not apply.
        """
        held = self.held_samples()
        if held < self.samples_per_step:
            return False
        return held >= self.max_held_samples or self.held_bytes() >= self.config.max_held_bytes

    def dispatch_state(self) -> tuple:
        """What a refused dispatch depends on (a held request is tried again when it
        changes): admission, back-pressure, each source's own (:meth:`WorkSource.state`)."""
        sources = tuple(source.state() for source in self.sources)
        return (self.policy_version, self.started_samples, self.backpressured(), sources)

    # ------------------------------------------------------------------ ingest

    def ingest(self, samples: list[Sample], now: float | None = None) -> int:
        """Accept samples of groups in flight; drop (and count) anything else. Returns accepted
        (eval samples included; ``counters["accepted"]`` counts training samples only).

        With ``now``, each sender counts as alive (before its samples are
        judged, so a generator on the brink of expiry keeps its groups).
        """
        if now is not None:
            for generator_id in sorted({s.meta.generator_id for s in samples}):
                self.heartbeat(generator_id, now)
        accepted = claimed = 0
        for sample in samples:
            owner = self._claimant(sample.meta)
            if owner is not None:
                claimed += owner.ingest(sample, now)
                continue
            reason = self.in_flight.rejection(sample, self.cursor)
            if reason is not None:
                self.counters[reason] += 1
                continue
            group = self.in_flight[sample.meta.group_id]
            group.add(sample)
            accepted += 1
            if sample.meta.reward_error:  # scored 0 because the reward function failed
                self.counters[Count.REWARD_ERRORS] += 1
                self.reward_error_kinds[sample.meta.reward_error.replace(":", "_")] += 1
            if group.complete:
                self._complete(group)
        self.counters[Count.ACCEPTED] += accepted
        return accepted + claimed

    def _complete(self, group: Group) -> None:
        """A group has all its samples: filter it, or make it ready for the learner."""
        del self.in_flight[group.item.group_id]
        self.counters[Count.COMPLETED_GROUPS] += 1
        reason = filter_reason(group, self.config)
        if reason is None:
            self.batches.add(group)
            return
        self.counters[Count.FILTERED] += len(group.samples)
        self._discard(group, Count(f"filtered_{reason}"))
        self.prompts.skip(group.item.group_id, f"filtered_{reason}", self.policy_version)

    # ----------------------------------------------------------------- batches

    def set_policy_version(self, version: int) -> None:
        self.policy_version = max(self.policy_version, version)

    def start_eval(self, number: int, policy_version: int, now: float | None = None) -> bool:
        """Start eval round ``number`` of the learner's ``policy_version``; False when it is
        not (a round is still running: counted as skipped; or it started already)."""
        self.set_policy_version(policy_version)
        return self.evaluation.start(number, policy_version, now)

    def evict_stale(self) -> None:
        """Drop ready groups that are already too stale for the current version.

        A group kept for reuse was served already and simply retires. A group never
        served is counted ``dropped_stale``; its prompt goes out again while it has
        retries left (keeping its admission budget, like any requeued group), else it
        is skipped by id. A slow or descheduled generator's work is lost, not its
        prompt: it is generated again by the current policy, and given up on only if
        that keeps failing.
        """
        for group in self.batches.evict(self.policy_version):
            if self.prompts.retry_stale(group.item.group_id, self.config.stale_retries):
                self.counters[Count.DROPPED_STALE] += len(group.samples)
                self.counters[Count.STALE_REQUEUED_GROUPS] += 1
                self.requeued.put(group.item)
            else:
                self._discard(group, Count.DROPPED_STALE)
                self.prompts.skip(group.item.group_id, "stale", self.policy_version)

    def _discard(self, group: Group, reason: Count) -> None:
        """Drop a group that will not be served: count it, free its admission budget."""
        self.counters[reason] += len(group.samples)
        self.started_samples -= group.item.num_samples

    def take_batch(self) -> list[Sample] | None:
        """``samples_per_step`` samples from complete groups, oldest first, or None yet
        (:meth:`ReadyGroups.take <asyncrl.buffer.batches.ReadyGroups.take>`); each source's
        :meth:`~asyncrl.buffer.sources.WorkSource.batch_stats` ride along, once."""
        self.evict_stale()
        for group in self.batches.last_batch:  # trained now: it can no longer be handed back
            self.prompts.trained(group.item.group_id)
        batch = self.batches.take(self.policy_version)
        if batch is not None:
            self.batch_extras = [(source, source.batch_stats()) for source in self.sources]
        return batch

    def return_last_batch(self) -> int:
        """Take back the last batch served: the learner stopped before it could train it.

        Its groups are ready again as if never served (so the durable state lists
        the ones served for the first time as unfinished), and what rode along with it
        goes back to its source (eval results: they were not logged); returns its samples.
        """
        returned = self.batches.return_last()
        for source, stats in self.batch_extras:
            source.give_back(stats)
        self.batch_extras = []
        return returned

    # -------------------------------------------------------------- durability

    def durable_state(self) -> dict:
        """What a learner checkpoint keeps (:func:`~asyncrl.buffer.durable.state_of`)."""
        return durable.state_of(self)

    def restore(self, state: dict) -> None:
        """Continue from :meth:`durable_state` (:func:`~asyncrl.buffer.durable.restore`)."""
        durable.restore(self, state)

    # ----------------------------------------------------------------- metrics

    def held_samples(self) -> int:
        """Samples in ready groups (including groups kept for reuse)."""
        return self.batches.held_samples()

    def held_bytes(self) -> int:
        """Bytes of every sample held: ready groups and partial groups in flight."""
        return sum(g.nbytes for g in self.ready) + sum(g.nbytes for g in self.in_flight.values())

    def accounted(self) -> int:
        """Where accepted samples are now; equals ``counters["accepted"]`` (invariant 5)."""
        c = self.counters
        return (
            c[Count.SERVED]
            - c[Count.SERVED_AGAIN]
            + c[Count.DROPPED_STALE]
            + c[Count.FILTERED]
            + c[Count.DISCARDED_REQUEUE]
            + sum(len(g.samples) for g in self.ready if not g.times_served)
            + sum(len(g.samples) for g in self.in_flight.values())
        )

    def stats(self, now: float | None = None) -> dict[str, float]:
        """Flat ``buffer_*`` metrics (:func:`~asyncrl.buffer.metrics.store_metrics`); with
        ``now``, also closes the ingest-rate interval."""
        if now is not None:
            self.ingest_rate.read(now, self.counters[Count.ACCEPTED])
        return store_metrics(self)
