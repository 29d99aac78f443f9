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

Filters run when a group completes, on the whole group: ``filter_truncated``
drops a group if any of its samples hit the length limit (keeping the rest
would serve a group short of samples, its baseline computed without the
truncated ones), and
``filter_equal_rewards`` drops a group whose rewards are all equal (DAPO's
dynamic sampling: it has no learning signal under GRPO; a group of one sample
always qualifies). Filtered samples free admission budget like skipped stale ones.
Every sample that leaves other than by ``take_batch`` is counted in
:attr:`BufferStore.counters` by reason, and every prompt given up on is in
:attr:`BufferStore.skipped` (invariant 8). Partial samples discarded when a group
is requeued (``discarded_requeue``) lose no prompt: the group goes out again.

Prompts are a pure function of an integer index (the dataset cursor), and the
group id of a prompt is its index, so a group is identified across restarts,
and a group id below the cursor that is not in flight was dispatched before.
A requeued group (a silent generator's, or a stale one retried) keeps its id, so
``trained_groups.jsonl`` names each prompt by the same id however often it went out.

Held-out evaluation rounds (:mod:`asyncrl.buffer.evaluation`) share dispatch
and liveness with training but none of its accounting: their groups (negative
ids, samples tagged with ``eval_round``) go out after requeued training groups
and before new prompts, even under admission control or back-pressure (they
add nothing the learner must take), are requeued when their generator is
forgotten, and are never ready, evicted or served. The invariants above count
training samples and groups only.
"""

from __future__ import annotations

import bisect
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from asyncrl.buffer.durable import Skip, check_state
from asyncrl.buffer.evaluation import EvalRounds
from asyncrl.messages import NOT_EVAL, TrajectoryMeta, WorkItem

MIB = 1 << 20
UNVERSIONED = 1 << 62
"""The version of a sample with no model token: later than any, so never stale."""
FILTERS = ("truncated", "equal_rewards")
"""Filter reasons; each is counted as ``filtered_<reason>``."""
SKIP_REASONS = ("stale", *(f"filtered_{reason}" for reason in FILTERS))
"""Why a prompt handed out was given up on (:attr:`BufferStore.skipped`)."""


@dataclass
class Sample:
    """One finished trajectory as the buffer holds it."""

    meta: TrajectoryMeta
    prompt_ids: np.ndarray
    response_ids: np.ndarray
    logprobs: np.ndarray
    token_versions: np.ndarray
    loss_mask: np.ndarray

    @cached_property
    def version(self) -> int:
        """The oldest weight version among its model-generated tokens (computed once, then kept).

        Tool and environment tokens of a multi-turn sample carry version -1: no
        policy made them, so they do not make a sample stale. A sample without
        model tokens (an episode whose prompt filled its token budget) is never
        stale: :data:`UNVERSIONED`.
        """
        made_by_model = self.token_versions[self.token_versions >= 0]
        return int(made_by_model.min()) if made_by_model.size else UNVERSIONED

    @property
    def nbytes(self) -> int:
        """Bytes of its token arrays: what back-pressure on memory counts."""
        arrays = (self.prompt_ids, self.response_ids, self.logprobs)
        return sum(a.nbytes for a in (*arrays, self.token_versions, self.loss_mask))


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


class BufferStore:
    def __init__(
        self,
        make_item: Callable[[int], WorkItem],
        samples_per_step: int,
        max_staleness: int,
        admission_control: bool = True,
        *,
        heartbeat_timeout_s: float = 10.0,
        max_reuse: int = 1,
        filter_equal_rewards: bool = False,
        filter_truncated: bool = False,
        max_held_samples: int = 0,
        max_held_bytes: int = 256 * MIB,
        eval_items: Sequence[WorkItem] = (),
        stale_retries: int = 0,
    ):
        self.make_item = make_item
        self.samples_per_step = samples_per_step
        self.max_staleness = max_staleness
        self.admission_control = admission_control
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.max_reuse = max_reuse
        self.filter_equal_rewards = filter_equal_rewards
        self.filter_truncated = filter_truncated
        self.max_held_samples = max_held_samples or 4 * samples_per_step
        """Back-pressure bound on held ready samples (0 in the config: 4 batches)."""
        self.max_held_bytes = max_held_bytes
        self.policy_version = 0
        self.cursor = 0
        """Index of the next prompt to hand out."""
        self.in_flight: dict[int, Group] = {}
        """Dispatched groups not yet complete, by group id."""
        self.requeue: deque[WorkItem] = deque()
        """Groups taken back from silent generators, handed out before new prompts."""
        self.ready: list[Group] = []
        """Complete groups waiting for the learner, oldest version first."""
        self.started_samples = 0
        """Samples dispatched and not since evicted or dropped: what admission bounds."""
        self.last_seen: dict[str, float] = {}
        """Generator id -> time of its last message, for generators not yet expired."""
        self.counters: Counter[str] = Counter()
        self.served_staleness: list[int] = []
        """Staleness of each sample of the last batch served."""
        self.last_batch: list[Group] = []
        """The groups of the last batch served, until :meth:`return_last_batch` or the next."""
        self.ingest_rate = 0.0
        """Accepted samples per second between the last two ``stats(now)`` calls."""
        self._rate_mark: tuple[float, int] | None = None
        """(time, accepted) where the current ingest-rate interval started."""
        self.evaluation = EvalRounds(eval_items)
        """Held-out eval rounds on ``eval_items`` (none: evaluation is off)."""
        self.batch_eval_results: dict[str, float] = {}
        """The eval results handed over with the last batch served (empty: none)."""
        self.stale_retries = stale_retries
        """Times a prompt whose unserved group went stale is handed out again (0: skip it)."""
        self.stale_evictions: dict[int, int] = {}
        """Group id -> times its group was evicted as stale and requeued, until it is
        served (and can no longer be handed back) or skipped."""
        self.skipped: list[Skip] = []
        """Every prompt handed out and given up on, in order: by id, reason and step."""
        self.skipped_by_reason: Counter[str] = Counter()
        self.trained_ahead: set[int] = set()
        """Prompts at or past the cursor that a restored state says were trained: the
        cursor passes over them, they are never handed out."""

    # ---------------------------------------------------------------- liveness

    def heartbeat(self, generator_id: str, now: float) -> None:
        """Record that ``generator_id`` is alive at ``now``; any message from it counts."""
        self.last_seen[generator_id] = max(now, self.last_seen.get(generator_id, now))
        if self._rate_mark is None:
            self._rate_mark = (now, self.counters["accepted"])

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
            if now - seen > self.heartbeat_timeout_s
        )
        for generator_id in expired:
            self._forget(generator_id)
        return expired

    def leave(self, generator_id: str) -> int:
        """``generator_id`` stopped on purpose: requeue its unfinished groups now.

        Returns how many were requeued (counted like expiry's, as ``requeued_groups``)."""
        self.counters["generators_left"] += 1
        return self._forget(generator_id)

    def replace(self, generator_id: str, now: float) -> int:
        """A new process took over ``generator_id`` (a restart that kept the id): the old
        one's unfinished groups are requeued now, counted as ``generators_replaced``, and
        the id is alive at ``now``. Returns how many groups were requeued."""
        self.counters["generators_replaced"] += 1
        requeued = self._forget(generator_id)
        self.heartbeat(generator_id, now)
        return requeued

    def in_flight_samples(self, generator_id: str) -> int:
        """Samples handed to ``generator_id`` (training and eval) and not delivered yet."""
        training = sum(
            g.item.num_samples - len(g.samples)
            for g in self.in_flight.values()
            if g.generator_id == generator_id
        )
        return training + self.evaluation.in_flight_samples(generator_id)

    def handed_out(self, meta: TrajectoryMeta) -> WorkItem | None:
        """The WorkItem of ``meta``'s group if that group is in flight to ``meta``'s
        generator (the one a sample of it may come from), else None."""
        if meta.eval_round != NOT_EVAL:
            return self.evaluation.handed_out(meta)
        group = self.in_flight.get(meta.group_id)
        if group is None or group.generator_id != meta.generator_id:
            return None
        return group.item

    def _forget(self, generator_id: str) -> int:
        """Stop tracking ``generator_id`` and requeue its unfinished groups (eval groups
        too); how many."""
        self.last_seen.pop(generator_id, None)
        groups = [g for g in self.in_flight.values() if g.generator_id == generator_id]
        for group in groups:
            self._requeue(group)
        return len(groups) + self.evaluation.forget(generator_id)

    def _requeue(self, group: Group) -> None:
        del self.in_flight[group.item.group_id]
        self.counters["discarded_requeue"] += len(group.samples)
        self.counters["requeued_groups"] += 1
        self.requeue.append(group.item)

    # ---------------------------------------------------------------- dispatch

    def admission_limit(self) -> int:
        return (self.policy_version + self.max_staleness + 1) * self.samples_per_step

    def dispatch(
        self, generator_id: str, max_samples: int, now: float | None = None
    ) -> list[WorkItem]:
        """Hand out whole groups that fit in ``max_samples``: requeued ones, then the
        running eval round's, then new prompts (only once neither kind waits).

        Under back-pressure only eval groups are handed out. Asking counts as a
        heartbeat when ``now`` is given.
        """
        if now is not None:
            self.heartbeat(generator_id, now)
        backpressured = self.backpressured()
        if backpressured:
            self.counters["dispatch_refused_backpressure"] += 1
        requeued = [] if backpressured else self._dispatch_requeued(generator_id, max_samples)
        budget = max_samples - sum(item.num_samples for item in requeued)
        evaluation = self.evaluation.dispatch(generator_id, budget)
        budget -= sum(item.num_samples for item in evaluation)
        blocked = backpressured or self.requeue or self.evaluation.waiting()
        new = [] if blocked else self._dispatch_new(generator_id, budget)
        self.counters["dispatched_groups"] += len(requeued) + len(new)
        return requeued + evaluation + new

    def _dispatch_requeued(self, generator_id: str, budget: int) -> list[WorkItem]:
        """Requeued groups in order; no admission check, their samples are already started."""
        items: list[WorkItem] = []
        while self.requeue and self.requeue[0].num_samples <= budget:
            item = self.requeue.popleft()
            budget -= item.num_samples
            self.in_flight[item.group_id] = Group(item, generator_id)
            items.append(item)
        self.counters["redispatched_groups"] += len(items)
        return items

    def _dispatch_new(self, generator_id: str, budget: int) -> list[WorkItem]:
        """New prompts from the cursor while they fit in ``budget`` and admission allows.

        A prompt trained before a restore (:attr:`trained_ahead`) is passed over, its
        samples counted as started, as they were when the learner trained them.
        """
        items: list[WorkItem] = []
        while True:
            item = self.make_item(self.cursor)
            trained = self.cursor in self.trained_ahead
            if not trained and item.num_samples > budget:
                break
            if (
                self.admission_control
                and self.started_samples + item.num_samples > self.admission_limit()
            ):
                self.counters["dispatch_refused_admission"] += 1
                break
            self.cursor += 1
            self.started_samples += item.num_samples
            if trained:
                self.trained_ahead.discard(item.group_id)
                self.counters["restored_skipped_trained"] += 1
                continue
            budget -= item.num_samples
            self.in_flight[item.group_id] = Group(item, generator_id)
            items.append(item)
        return items

    def backpressured(self) -> bool:
        """Held ready samples or held bytes at their bound, and a batch can be formed.

        While the ready samples cannot fill a batch, refusing work would stall
        the learner and the generators alike, so the bound does not apply.
        """
        held = self.held_samples()
        if held < self.samples_per_step:
            return False
        return held >= self.max_held_samples or self.held_bytes() >= self.max_held_bytes

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
        accepted = evaluated = 0
        for sample in samples:
            if sample.meta.eval_round != NOT_EVAL:
                evaluated += self.evaluation.ingest(sample.meta, sample.token_versions, now)
                continue
            reason = self._rejection(sample)
            if reason is not None:
                self.counters[reason] += 1
                continue
            group = self.in_flight[sample.meta.group_id]
            group.add(sample)
            accepted += 1
            if sample.meta.reward_error:  # scored 0 because the reward function failed
                self.counters["reward_errors"] += 1
                self.counters[f"reward_{sample.meta.reward_error.replace(':', '_')}"] += 1
            if group.complete:
                self._complete(group)
        self.counters["accepted"] += accepted
        return accepted + evaluated

    def _rejection(self, sample: Sample) -> str | None:
        """Why ``sample`` cannot be accepted, as a counter name, or None."""
        group = self.in_flight.get(sample.meta.group_id)
        index = sample.meta.sample_index
        if group is None:
            dispatched_before = 0 <= sample.meta.group_id < self.cursor
            return "dropped_duplicate" if dispatched_before else "dropped_unknown_group"
        if sample.meta.generator_id != group.generator_id or index in group.samples:
            return "dropped_duplicate"
        if not 0 <= index < group.item.num_samples:
            return "dropped_bad_index"
        return None

    def _complete(self, group: Group) -> None:
        """A group has all its samples: filter it, or make it ready for the learner."""
        del self.in_flight[group.item.group_id]
        self.counters["completed_groups"] += 1
        reason = self._filter_reason(group)
        if reason is None:
            # keeps ``ready`` oldest version first, after groups of the same version (as a
            # stable sort would) without re-sorting every held group on each ingest
            bisect.insort(self.ready, group, key=_group_version)
            return
        self.counters["filtered"] += len(group.samples)
        self._discard(group, f"filtered_{reason}")
        self._skip(group.item.group_id, f"filtered_{reason}")

    def _filter_reason(self, group: Group) -> str | None:
        samples = group.samples.values()
        if self.filter_truncated and any(s.meta.finish_reason == "length" for s in samples):
            return "truncated"
        if self.filter_equal_rewards and len({s.meta.reward for s in samples}) == 1:
            return "equal_rewards"
        return None

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

        A group never served is counted ``dropped_stale`` and its prompt goes out
        again or is skipped (:meth:`_evict_unserved`); a group kept for reuse was
        served already and simply retires.
        """
        keep = []
        for group in self.ready:
            if self.policy_version - group.version <= self.max_staleness:
                keep.append(group)
            elif group.times_served:
                self.counters["retired_stale_after_serving"] += len(group.samples)
            else:
                self.counters["dropped_stale_response_tokens"] += group.response_tokens
                self._evict_unserved(group)
        self.ready = keep

    def _evict_unserved(self, group: Group) -> None:
        """A group never trained went stale: requeue its prompt while it has retries left
        (keeping its admission budget, like any requeued group), else skip it by id.

        A slow or descheduled generator's work is lost, not its prompt: the prompt is
        generated again by the current policy, and given up on only if that keeps failing.
        """
        group_id = group.item.group_id
        evictions = self.stale_evictions.get(group_id, 0)
        if evictions < self.stale_retries:
            self.counters["dropped_stale"] += len(group.samples)
            self.counters["stale_requeued_groups"] += 1
            self.stale_evictions[group_id] = evictions + 1
            self.requeue.append(group.item)
            return
        self._discard(group, "dropped_stale")
        self._skip(group_id, "stale")

    def _skip(self, group_id: int, reason: str) -> None:
        """Give up on a prompt handed out: record its id and why; it never goes out again."""
        self.stale_evictions.pop(group_id, None)
        self.skipped.append(Skip(group_id, reason, self.policy_version))
        self.skipped_by_reason[reason] += 1

    def take_batch(self) -> list[Sample] | None:
        """``samples_per_step`` samples from complete groups, oldest first, or None yet."""
        self.evict_stale()
        for group in self.last_batch:  # trained now: it can no longer be handed back
            self.stale_evictions.pop(group.item.group_id, None)
        if self.held_samples() < self.samples_per_step:
            return None
        batch: list[Sample] = []
        taken: list[Group] = []
        while self.ready and len(batch) + self.ready[0].item.num_samples <= self.samples_per_step:
            group = self.ready.pop(0)
            batch.extend(group.samples[i] for i in sorted(group.samples))
            taken.append(group)
        staleness = [self.policy_version - s.version for s in batch if s.version != UNVERSIONED]
        assert max(staleness, default=0) <= self.max_staleness, "take_batch served a stale sample"
        for group in taken:
            self._after_serving(group)
        self.last_batch = taken
        self.batch_eval_results = self.evaluation.next_results()
        self.ready.sort(key=lambda g: g.version)
        self.served_staleness = staleness
        self.counters["served"] += len(batch)
        self.counters["served_response_tokens"] += sum(s.meta.response_len for s in batch)
        return batch

    def _after_serving(self, group: Group) -> None:
        """Count a serving; keep the group for another while it has servings left."""
        group.times_served += 1
        if group.times_served > 1:
            self.counters["served_again"] += len(group.samples)
        if group.times_served < self.max_reuse:
            self.ready.append(group)

    def return_last_batch(self) -> int:
        """Take back the last batch served: the learner stopped before it could train it.

        Its groups are ready again as if never served (so the durable state lists
        the ones served for the first time as unfinished); returns their samples.
        """
        returned = 0
        for group in self.last_batch:
            if group.times_served > 1:
                self.counters["served_again"] -= len(group.samples)
            group.times_served -= 1
            if all(kept is not group for kept in self.ready):
                self.ready.append(group)
            returned += len(group.samples)
            self.counters["served_response_tokens"] -= group.response_tokens
        self.ready.sort(key=lambda g: g.version)
        self.counters["served"] -= returned
        self.counters["returned_unconsumed"] += returned
        self.last_batch = []
        self.evaluation.give_back(self.batch_eval_results)  # its eval results were not logged
        self.batch_eval_results = {}
        return returned

    # -------------------------------------------------------------- durability

    def durable_state(self) -> dict:
        """What a learner checkpoint keeps: the cursor, the groups not yet trained on, and
        the prompts given up on (fields: :mod:`asyncrl.buffer.durable`).

        Groups in flight, waiting to be requeued, or complete but never served are
        "unfinished": a run resumed from this checkpoint hands them out again
        before any new prompt, with the stale retries they used, and since prompts
        come from the cursor, none below it is handed out twice. Skipped prompts are
        kept by id (invariant 8), never handed out again. Eval rounds are not kept:
        one unfinished at the checkpoint is dropped, and the resumed learner starts the
        next one when it is due.
        """
        unfinished = sorted(self.unfinished_groups())
        return {
            "cursor": self.cursor,
            "policy_version": self.policy_version,
            "started_samples": self.started_samples,
            "unfinished_groups": unfinished,
            "stale_evictions": [
                [group_id, self.stale_evictions[group_id]]
                for group_id in unfinished
                if group_id in self.stale_evictions
            ],
            "skipped_groups": [skip.as_dict() for skip in self.skipped],
            "trained_ahead": sorted(self.trained_ahead),
        }

    def unfinished_groups(self) -> list[int]:
        """Group ids handed out and neither trained nor skipped (in flight, requeued, ready)."""
        unfinished = [*self.in_flight, *(item.group_id for item in self.requeue)]
        return unfinished + [g.item.group_id for g in self.ready if not g.times_served]

    def restore(self, state: dict) -> None:
        """Continue from :meth:`durable_state` in a fresh store: unfinished groups go first.

        The state is checked whole first (:func:`~asyncrl.buffer.durable.check_state`;
        ValueError naming ``buffer.json`` and the field). Groups it says were trained
        since it was written (``trained_since``, from a learner that wrote the state
        itself) are never handed out again, whether unfinished or past the cursor;
        each one passed over is counted in ``restored_skipped_trained``.
        """
        if self.cursor or self.in_flight or self.ready or self.requeue:
            raise RuntimeError("restore() needs a fresh store")
        checked = check_state(state, SKIP_REASONS)
        self.cursor = checked.cursor
        self.policy_version = checked.policy_version
        self.started_samples = checked.started_samples  # admission resumes where it was
        for group_id in checked.unfinished_groups:
            if group_id in checked.trained:  # its samples stay started: they were trained
                self.counters["restored_skipped_trained"] += 1
            else:
                self.requeue.append(self.make_item(group_id))
                self.counters["restored_groups"] += 1
        trained = checked.trained
        self.trained_ahead = {group_id for group_id in trained if group_id >= self.cursor}
        retries = checked.stale_evictions.items()
        self.stale_evictions = {g: times for g, times in retries if g not in trained}
        self.skipped = list(checked.skipped)
        self.skipped_by_reason = Counter(skip.reason for skip in self.skipped)

    # ----------------------------------------------------------------- metrics

    def held_samples(self) -> int:
        """Samples in ready groups (including groups kept for reuse)."""
        return sum(len(g.samples) for g in self.ready)

    def held_bytes(self) -> int:
        """Bytes of every sample held: ready groups and partial groups in flight."""
        return sum(g.nbytes for g in self.ready) + sum(g.nbytes for g in self.in_flight.values())

    def accounted(self) -> int:
        """Where accepted samples are now; equals ``counters["accepted"]`` (invariant 5)."""
        c = self.counters
        return (
            c["served"]
            - c["served_again"]
            + c["dropped_stale"]
            + c["filtered"]
            + c["discarded_requeue"]
            + sum(len(g.samples) for g in self.ready if not g.times_served)
            + sum(len(g.samples) for g in self.in_flight.values())
        )

    def stats(self, now: float | None = None) -> dict[str, float]:
        """Flat ``buffer_*`` metrics; with ``now``, also closes the ingest-rate interval."""
        if now is not None:
            self._update_ingest_rate(now)
        c = self.counters
        accepted = c["accepted"]
        stats = {
            "buffer_held": float(self.held_samples()),
            "buffer_held_bytes": float(self.held_bytes()),
            "buffer_in_flight_groups": float(len(self.in_flight)),
            "buffer_requeue_waiting": float(len(self.requeue)),
            "buffer_generators_alive": float(len(self.last_seen)),
            "buffer_generators_replaced": float(c["generators_replaced"]),
            "buffer_accepted": float(accepted),
            "buffer_served": float(c["served"]),
            "buffer_served_again": float(c["served_again"]),
            "buffer_returned_unconsumed": float(c["returned_unconsumed"]),
            "buffer_dropped_stale": float(c["dropped_stale"]),
            "buffer_dropped_duplicate": float(c["dropped_duplicate"]),
            "buffer_dropped_unknown": float(c["dropped_unknown_group"]),
            "buffer_filtered": float(c["filtered"]),
            **{f"buffer_filtered_{r}": float(c[f"filtered_{r}"]) for r in FILTERS},
            "buffer_discarded_requeue": float(c["discarded_requeue"]),
            "buffer_evicted_frac": c["dropped_stale"] / accepted if accepted else 0.0,
            "buffer_requeued_groups": float(c["requeued_groups"]),
            "buffer_stale_requeued_groups": float(c["stale_requeued_groups"]),
            "buffer_stale_retries_pending": float(len(self.stale_evictions)),
            "buffer_prompts_skipped": float(len(self.skipped)),
            **{
                f"buffer_prompts_skipped_{reason}": float(self.skipped_by_reason[reason])
                for reason in SKIP_REASONS
            },
            "buffer_restored_groups": float(c["restored_groups"]),
            "buffer_restored_skipped_trained": float(c["restored_skipped_trained"]),
            "buffer_reward_errors": float(c["reward_errors"]),
            **{
                f"buffer_{key}": float(value)
                for key, value in c.items()
                if key.startswith("reward_error_")
            },
            "buffer_ingest_rate": self.ingest_rate,
            "buffer_cursor": float(self.cursor),
            "buffer_admission_refusals": float(c["dispatch_refused_admission"]),
            "buffer_backpressure_refusals": float(c["dispatch_refused_backpressure"]),
            "buffer_response_len_served_mean": _mean(c["served_response_tokens"], c["served"]),
            "buffer_response_len_evicted_mean": _mean(
                c["dropped_stale_response_tokens"], c["dropped_stale"]
            ),
        }
        return stats | self._staleness_histogram() | self.evaluation.stats()

    def _staleness_histogram(self) -> dict[str, float]:
        """``buffer_staleness_j``: samples of staleness j in the last batch, j = 0..k."""
        counts = Counter(self.served_staleness)
        return {f"buffer_staleness_{j}": float(counts[j]) for j in range(self.max_staleness + 1)}

    def _update_ingest_rate(self, now: float) -> None:
        accepted = self.counters["accepted"]
        if self._rate_mark is None:
            self._rate_mark = (now, accepted)
            return
        start, before = self._rate_mark
        if now > start:
            self.ingest_rate = (accepted - before) / (now - start)
            self._rate_mark = (now, accepted)

    def _discard(self, group: Group, reason: str) -> None:
        """Drop a group that will not be served: count it, free its admission budget."""
        self.counters[reason] += len(group.samples)
        self.started_samples -= group.item.num_samples


def _group_version(group: Group) -> int:
    return group.version


def _mean(total: int, count: int) -> float:
    return total / count if count else 0.0
