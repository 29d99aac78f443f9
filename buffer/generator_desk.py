"""The generators' side of the buffer: work handed out, samples taken in, who is alive.

A generator id belongs to one process at a time, its *incarnation*
(:class:`~asyncrl.buffer.peers.Incarnations`): a message naming a live id with another
incarnation is refused (``wrong_incarnation``), and only a ``Join`` replaces it. Every
message from a generator counts as its heartbeat; one silent for
``buffer.heartbeat_timeout_s`` is expired and its unfinished groups requeued
(:meth:`GeneratorDesk.expire_silent`). Its samples are checked whole before any is
stored (:mod:`asyncrl.buffer.validation`), and against the learner's adapter digests
when the run publishes LoRA adapters alone (:class:`~asyncrl.buffer.adapters.AdapterLedger`).

A ``WorkRequest`` with ``wait_s > 0`` that finds nothing to hand out is held
(:mod:`asyncrl.buffer.held`) and tried again whenever dispatch could answer differently
(:meth:`GeneratorDesk.serve_held`); each id has at most one held, and the newer counts.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from collections.abc import Awaitable, Callable

from asyncrl.buffer.adapters import AdapterLedger
from asyncrl.buffer.counters import Count
from asyncrl.buffer.held import HeldRequest, HeldRequests
from asyncrl.buffer.peers import Incarnations, RejectionLog
from asyncrl.buffer.returns import Returns
from asyncrl.buffer.store import BufferStore
from asyncrl.buffer.validation import (
    Limits,
    check_generator_id,
    check_pool,
    check_trajectories,
    sender_of,
)
from asyncrl.config import Config
from asyncrl.core.messages import (
    Ack,
    Heartbeat,
    Join,
    Joined,
    Leave,
    Trajectories,
    WireError,
    WorkGrant,
    WorkItem,
    WorkRequest,
)
from asyncrl.core.trajectory import Sample

log = logging.getLogger("asyncrl.buffer")

RETRY_AFTER_S = 0.05
"""How long a generator refused by admission control or back-pressure waits to ask again."""
MAX_WAIT_FRACTION = 0.5
"""A held WorkRequest waits at most this share of ``buffer.heartbeat_timeout_s`` (a
longer ``wait_s`` is cut to it), so its replica is answered, and speaks again, long
before it could be taken for silent."""
MAX_IN_FLIGHT_FACTOR = 4
"""A generator may hold at most this many times the largest pool's
``generators.max_active_samples`` in flight (samples handed to it, not yet delivered):
the ones it generates plus the finished ones still being scored (a replica asks for
``max_active_samples`` less what it generates, and a slow reward can hold as many again).
A request beyond that is granted only what fits (counted in
``buffer_work_requests_capped``), so one generator id cannot book an unbounded share of
the admission budget."""

Reply = Callable[..., Awaitable[bool]]
"""``reply(identity, body, arrays=None)``: False when the peer could not be sent it."""


class GeneratorDesk:
    """Serves the generators' messages (``WorkRequest``, ``Trajectories``, ``Heartbeat``,
    ``Join``, ``Leave``), answers their held work requests, and expires silent ones."""

    def __init__(
        self,
        config: Config,
        store: BufferStore,
        held: HeldRequests,
        reply: Reply,
        limits: Limits,
        adapters: AdapterLedger | None,
        stored: Callable[[float], Awaitable[None]],
        counters: Counter[str],
        log_rejection: RejectionLog,
    ):
        self.config = config
        self.store = store
        self.held = held
        self.reply = reply
        self.limits = limits
        """What a generator's samples must fit (:mod:`asyncrl.buffer.validation`)."""
        self.adapters = adapters
        """The learner's adapter digests, when samples must be checked against them."""
        self.stored = stored
        """``stored(now)``: samples were accepted, so what waits on them may be served."""
        self.counters = counters
        """The service's: ``work_requests_capped``, ``work_requests_held`` (ever),
        ``work_requests_held_granted`` (got items) and ``generators_returned``."""
        self.log_rejection = log_rejection
        pools = config.generators.resolved_pools()
        most_active = max(p.settings.max_active_samples for p in pools)
        self.max_in_flight = MAX_IN_FLIGHT_FACTOR * most_active
        """Samples one generator may hold in flight (``MAX_IN_FLIGHT_FACTOR``)."""
        self.incarnations = Incarnations(store.last_seen)
        self.pools_known: set[str] = {p.name for p in pools}
        """Pool names reported on (``validation.MAX_POOLS`` at most)."""
        self.reward_error_kinds: set[str] = set()
        """Reward-error tags counted so far (``validation.MAX_REWARD_ERROR_KINDS`` at most)."""
        self.stats: dict[str, dict[str, float]] = {}
        """Each generator's latest counters (weight swaps, latency, reward errors)."""
        self.pools: dict[str, str] = {}
        """Generator id -> its pool."""
        self.returns = Returns()
        """Generators expired for silence, until they are back and their samples accepted."""

    async def on_work_request(self, identity: bytes, body: WorkRequest, _, now: float) -> None:
        wait_s = self._checked_wait(body.wait_s)
        if body.max_samples < 0:
            raise WireError("bad_field", f"WorkRequest.max_samples {body.max_samples} < 0")
        self.incarnations.claim(body.generator_id, body.incarnation)
        self._heard(body.generator_id, now)
        await self._answer_earlier(body.generator_id, now)  # one held per id: the newer counts
        items = self._dispatch(body.generator_id, body.max_samples, now)
        if items or not wait_s:
            retry = 0.0 if items else RETRY_AFTER_S
            await self.reply(identity, WorkGrant(items, self.store.policy_version, retry))
            return
        self.held.hold(HeldRequest(identity, body.generator_id, body.max_samples, now + wait_s))
        self.counters["work_requests_held"] += 1

    async def on_trajectories(self, identity: bytes, body: Trajectories, arrays, now) -> None:
        sender = sender_of(body)
        if body.pool:
            check_pool(body.pool, self.pools_known)
        if body.samples:
            self.incarnations.claim(sender, body.incarnation)
            self._heard(sender, now)
        samples = check_trajectories(
            body,
            {name: a.numpy() for name, a in arrays.items()},
            self.limits,
            self.store.policy_version + 1,  # published before the learner asks
            self.store.handed_out,
            self.reward_error_kinds,
        )
        samples = self._refuse_other_adapters(body, samples)
        accepted = self.store.ingest(samples, now)
        if accepted:
            self.returns.accepted(sender, now)
        if body.samples and body.stats:
            self.stats[sender] = dict(body.stats)
            self.pools[sender] = body.pool or "default"
        await self.reply(identity, Ack(accepted, len(body.samples) - accepted))
        await self.stored(now)

    def _refuse_other_adapters(self, body: Trajectories, samples: list[Sample]) -> list[Sample]:
        """``samples`` but those generated with another adapter than the one published
        for a version they carry: refused, counted, their groups requeued."""
        if self.adapters is None:
            return samples
        kept, refused = [], []
        for sample in samples:
            problem = self.adapters.mismatch(sample, body.adapter_digests or {})
            (kept if problem is None else refused).append(sample)
            if problem is not None:
                detail = f"{sample.meta.generator_id}: sample {sample.meta.group_id}/"
                self.log_rejection(
                    "adapter_mismatch", f"{detail}{sample.meta.sample_index}: {problem}",
                    time.monotonic(),
                )  # fmt: skip
        if refused:
            self.store.refuse(refused, Count.REFUSED_ADAPTER)
        return kept

    async def on_heartbeat(self, identity: bytes, body: Heartbeat, _, now: float) -> None:
        self.incarnations.claim(body.generator_id, body.incarnation)
        self._heard(body.generator_id, now)
        self.store.heartbeat(body.generator_id, now)
        await self.reply(identity, Ack(accepted=0))

    def _heard(self, generator_id: str, now: float) -> None:
        if self.returns.heard(generator_id, now):
            self.counters["generators_returned"] += 1

    async def on_join(self, identity: bytes, body: Join, _, now: float) -> None:
        generator_id = body.generator_id
        check_generator_id(generator_id)
        check_pool(body.pool, self.pools_known)
        live = self.incarnations.live(generator_id)
        if live is not None and live != body.incarnation:  # restarted under the same id
            await self._answer_earlier(generator_id, now)
            requeued = self.store.replace(generator_id, now)
            log.warning(
                "generator %s joined again as a new process: the old one's %d "
                "unfinished group(s) are requeued",
                generator_id,
                requeued,
            )
        self.incarnations.register(generator_id, body.incarnation)
        self.returns.forget(generator_id)  # a (new) process joining is not a return
        self.store.heartbeat(generator_id, now)
        self.pools[generator_id] = body.pool
        log.info("generator %s (pool %s) joined", generator_id, body.pool)
        cluster = self.config.cluster
        joined = Joined(cluster.weights_port, self.store.policy_version, self.config.run.name)
        await self.reply(identity, joined)

    async def on_leave(self, identity: bytes, body: Leave, _, now: float) -> None:
        generator_id = body.generator_id
        check_generator_id(generator_id)
        live = self.incarnations.live(generator_id)
        if live is not None and live != body.incarnation:
            raise WireError(
                "wrong_incarnation",
                f"Leave names generator {generator_id}, alive as another process",
            )
        await self._answer_earlier(generator_id, now)  # first: every request gets one reply
        requeued = self.store.leave(generator_id)
        self.incarnations.drop(generator_id)
        self.returns.forget(generator_id)
        log.info("generator %s left; %d unfinished group(s) requeued", generator_id, requeued)
        await self.reply(identity, Ack(accepted=requeued))

    def expire_silent(self, now: float) -> None:
        """Requeue the groups of generators silent for ``buffer.heartbeat_timeout_s``."""
        last_seen = dict(self.store.last_seen)
        for generator_id in self.store.expire_silent(now):
            self.incarnations.drop(generator_id)
            self.returns.expired(generator_id, last_seen[generator_id])
            log.warning(
                "generator %s silent for over %.1fs: its unfinished groups are requeued",
                generator_id,
                self.store.config.heartbeat_timeout_s,
            )

    # ------------------------------------------------------------ held requests

    def _dispatch(
        self, generator_id: str, max_samples: int, now: float, retry: bool = False
    ) -> list[WorkItem]:
        """Dispatch at most ``max_samples``, within the generator's in-flight cap (a request
        the cap cuts is counted once, not on each ``retry`` of a held one)."""
        room = self.max_in_flight - self.store.in_flight_samples(generator_id)
        if room < max_samples and not retry:
            self.counters["work_requests_capped"] += 1
        return self.store.dispatch(generator_id, max(0, min(max_samples, room)), now, retry)

    def _checked_wait(self, wait_s: float) -> float:
        """``WorkRequest.wait_s``, cut to the longest hold the heartbeat timeout allows."""
        if not math.isfinite(wait_s) or wait_s < 0:
            raise WireError(
                "bad_field", f"WorkRequest.wait_s must be a finite number >= 0, got {wait_s}"
            )
        return min(wait_s, MAX_WAIT_FRACTION * self.store.config.heartbeat_timeout_s)

    async def serve_held(self, now: float) -> None:
        """Answer held requests that dispatch can now serve, and those past their deadline."""
        if self.held.worth_trying(self.store.dispatch_state()):
            for held in self.held:
                items = self._dispatch(held.generator_id, held.max_samples, now, retry=True)
                if items:
                    self.counters["work_requests_held_granted"] += 1
                    await self._answer_held(held, items, now)
            self.held.tried(self.store.dispatch_state())
        for held in self.held.expired(now):
            await self._answer_held(held, [], now)

    async def answer_all_held(self, now: float) -> None:
        """Answer every held work request with an empty grant (the service stops)."""
        for held in self.held:
            await self._answer_held(held, [], now)

    async def _answer_earlier(self, generator_id: str, now: float) -> None:
        """Answer ``generator_id``'s held request, if any, with an empty grant."""
        earlier = self.held.pop(generator_id)
        if earlier is not None:
            await self._answer_held(earlier, [], now)

    async def _answer_held(self, held: HeldRequest, items: list[WorkItem], now: float) -> None:
        """Reply to a held request; the wait counts as contact when the replica is there."""
        self.held.release(held)
        grant = WorkGrant(items, self.store.policy_version, 0.0)
        if await self.reply(held.identity, grant):
            self.store.heartbeat(held.generator_id, now)
