"""The buffer service: one asyncio process (uvloop) between generators and learner.

::

    generators ──WorkRequest──▶ ┌─────────┐ ◀──BatchRequest(V)── learner
               ◀──WorkGrant───  │ buffer  │ ───Trajectories───▶
               ──Trajectories─▶ │         │     (answered when a batch is ready)
               ──Heartbeat───▶  └─────────┘

All state lives in :class:`~asyncrl.buffer.store.BufferStore`; this module only
moves messages and supplies the clock (``time.monotonic``). Each message type
has one small handler (:attr:`BufferService.handlers`): the generators' here, the
learner's in :mod:`asyncrl.buffer.learner_desk`. Every message from a
generator counts as its heartbeat, and each turn of the poll loop requeues
the groups of generators silent for ``buffer.heartbeat_timeout_s``. A
malformed or unknown message is answered with an ``ErrorReply``, counted
under ``rejected_<reason>``, and the service goes on.

The buffer trusts no peer's word (docs/security.md, "What the buffer accepts"). With
``cluster.auth`` on, each role is served only its own requests
(:data:`~asyncrl.buffer.peers.ROLES_SERVED`: ``BatchRequest``, ``StartEval``,
``EvalResultsRequest`` and ``SaveBufferState`` the learner's; ``WorkRequest``,
``Trajectories``, ``Heartbeat``, ``Join`` and ``Leave`` a generator's;
``StatusRequest`` anyone's; else ``forbidden``). A generator id belongs to one
process at a time, its *incarnation*: the random number it draws at start and
sends with every message, from any of its sockets. The first message of an id
not alive registers its incarnation; while it is alive, a message naming it
with another incarnation is refused (``wrong_incarnation``): it books no work,
keeps nothing alive, hands nothing back, delivers nothing. Only a ``Join``
replaces it (a process restarted under the same id): the old one's unfinished
groups are requeued at once (``buffer_generators_replaced``). Samples are
checked whole before any is stored (:mod:`asyncrl.buffer.validation`), and the
learner's version may only move by one (``bad_version``). Before any of that, the
socket caps each frame, the connections in their handshake and the bytes a connection
holds unread (:mod:`asyncrl.core.connection_guard`, limits from :mod:`asyncrl.core.message_limits`).

A ``WorkRequest`` with ``wait_s > 0`` that finds nothing to hand out is held
(:mod:`asyncrl.buffer.held`) rather than answered, and tried again whenever
dispatch could answer differently (a new policy version, freed admission
budget, requeued groups, back-pressure lifted, an eval round starting). So an
idle replica gets work the moment the learner admits it, instead of after a
``RETRY_AFTER_S`` poll interval.

The learner starts held-out eval rounds with ``StartEval``; a finished round's
``eval_*`` results ride along with the next batch's ``stats``
(:mod:`asyncrl.buffer.evaluation`). After its last step the learner asks for the
results no batch will carry (``EvalResultsRequest``): the request is answered at
once when results wait or no round runs, and otherwise held, like a work
request, until the running round completes or its ``wait_s`` runs out.

Every prompt the store gives up on is appended to ``RUN_DIR/skipped_prompts.jsonl``
as it happens (:mod:`asyncrl.buffer.skips`); metrics: :mod:`asyncrl.buffer.metrics`.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path

import zmq
import zmq.asyncio

from asyncrl.buffer.adapters import AdapterLedger
from asyncrl.buffer.counters import Count
from asyncrl.buffer.held import HeldRequest, HeldRequests
from asyncrl.buffer.learner_desk import LearnerDesk
from asyncrl.buffer.metrics import busy_fraction, generators_summary, pools_summary, service_metrics
from asyncrl.buffer.peers import Incarnations, RejectionLog, authorize
from asyncrl.buffer.returns import Returns
from asyncrl.buffer.skips import SkipFile
from asyncrl.buffer.store import BufferStore
from asyncrl.buffer.validation import (
    Limits,
    check_generator_id,
    check_pool,
    check_trajectories,
    model_vocab_size,
    sender_of,
)
from asyncrl.config import Config
from asyncrl.core import progress
from asyncrl.core.connection_guard import ConnectionGuard
from asyncrl.core.message_limits import BUFFER_HEADER_BYTES, buffer_guard_limits
from asyncrl.core.messages import (
    Ack,
    AdapterPublished,
    BatchRequest,
    ErrorReply,
    EvalResultsRequest,
    Heartbeat,
    Join,
    Joined,
    Leave,
    SaveBufferState,
    StartEval,
    Status,
    StatusRequest,
    Trajectories,
    WireError,
    WorkGrant,
    WorkItem,
    WorkRequest,
    decode,
    encode,
)
from asyncrl.core.security import peer_role, secure_server
from asyncrl.core.trajectory import Sample
from asyncrl.core.trajectory import split_samples as split_samples  # benchmarks import it

log = logging.getLogger("asyncrl.buffer")

RETRY_AFTER_S = 0.05
"""How long a generator refused by admission control or back-pressure waits to ask again."""
POLL_MS = 100
"""Longest wait for a message before the loop checks for silent generators."""
MAX_WAIT_FRACTION = 0.5
"""A held WorkRequest waits at most this share of ``buffer.heartbeat_timeout_s`` (a
longer ``wait_s`` is cut to it), so its replica is answered, and speaks again, long
before it could be taken for silent."""
STOP_LINGER_MS = 200
"""How long closing the socket may take to send the last replies (held requests answered
on stop) to peers still connected."""
ROUTER_HWM = 64
"""Messages queued per peer connection on the buffer's ROUTER socket, each way (SNDHWM,
RCVHWM). A generator or the learner has one or two requests out at a time. A peer that
sends without reading its replies fills its own queue: later replies to it are dropped
at once, never waited for (``buffer_rejected_unroutable_reply``), and once its inbound
queue is full ZeroMQ stops reading its connection. Either way the buffer's memory for
one peer stays bounded by this many messages."""
MAX_HEADER_BYTES = BUFFER_HEADER_BYTES
"""The largest header frame the buffer decodes (``oversized`` beyond): a generator's
message of its most samples (``MAX_SAMPLES_PER_MESSAGE``) has a header of about 100 KB.
Every frame is capped by the socket first (:mod:`asyncrl.core.message_limits`)."""
MAX_IN_FLIGHT_FACTOR = 4
"""A generator may hold at most this many times the largest pool's
``generators.max_active_samples`` in flight (samples handed to it, not yet delivered):
the ones it generates plus the finished ones still being scored (a replica asks for
``max_active_samples`` less what it generates, and a slow reward can hold as many again).
A request beyond that is granted only what fits (counted in
``buffer_work_requests_capped``), so one generator id cannot book an unbounded share of
the admission budget."""

Handler = Callable[[bytes, object, dict, float], Awaitable[None]]
"""``handler(identity, body, arrays, now)``: serves one message type."""


class BufferService:
    def __init__(
        self,
        config: Config,
        store: BufferStore,
        endpoint: str,
        run_dir: Path | None = None,
        *,
        vocab_size: int | None = None,
    ):
        self.config = config
        self.store = store
        self.endpoint = endpoint
        self.limits = Limits.from_config(
            config, vocab_size if vocab_size is not None else model_vocab_size(config)
        )
        """What a generator's samples must fit (:mod:`asyncrl.buffer.validation`)."""
        most_active = max(p.settings.max_active_samples for p in config.generators.resolved_pools())
        self.max_in_flight = MAX_IN_FLIGHT_FACTOR * most_active
        """Samples one generator may hold in flight (``MAX_IN_FLIGHT_FACTOR``)."""
        self.context = zmq.asyncio.Context()
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.socket.setsockopt(zmq.SNDHWM, ROUTER_HWM)
        self.socket.setsockopt(zmq.RCVHWM, ROUTER_HWM)
        self.guard: ConnectionGuard | None = None
        """Bounds frames, connections in handshake and bytes held, while serving."""
        self.rejected: Counter[str] = Counter()
        self.log_rejection = RejectionLog()
        self.incarnations = Incarnations(store.last_seen)
        self.pools_known: set[str] = {p.name for p in config.generators.resolved_pools()}
        """Pool names reported on (``validation.MAX_POOLS`` at most)."""
        self.reward_error_kinds: set[str] = set()
        """Reward-error tags counted so far (``validation.MAX_REWARD_ERROR_KINDS`` at most)."""
        self.stopping = asyncio.Event()
        self.generator_stats: dict[str, dict[str, float]] = {}
        """Each generator's latest counters (weight swaps, latency, reward errors)."""
        self.generator_pools: dict[str, str] = {}
        self.returns = Returns()
        """Generators expired for silence, until they are back and their samples accepted."""
        self.held = HeldRequests()
        """Work requests waiting for work, and the learner's request for eval results."""
        self.counters: Counter[str] = Counter()
        """``abandon_noops``, ``work_requests_capped``, ``work_requests_held`` (ever) and
        ``work_requests_held_granted`` (got items)."""
        self.skips = SkipFile(run_dir)
        self.adapters = AdapterLedger() if config.model.publishes_adapters else None
        """The learner's adapter digests, when samples must be checked against them."""
        self.learner = LearnerDesk(
            store, self.held, self._reply, self._batch_stats, run_dir, self.counters
        )
        """Serves the learner's messages and delivers its batches and eval results."""
        self.handlers: dict[type, Handler] = {
            WorkRequest: self._on_work_request,
            Trajectories: self._on_trajectories,
            Heartbeat: self._on_heartbeat,
            Join: self._on_join,
            Leave: self._on_leave,
            StatusRequest: self._on_status_request,
            BatchRequest: self.learner.on_batch_request,
            StartEval: self.learner.on_start_eval,
            EvalResultsRequest: self.learner.on_eval_results_request,
            SaveBufferState: self.learner.on_save_buffer_state,
            AdapterPublished: self._on_adapter_published,
        }
        """The message types served, each by its handler."""

    async def serve_loop(self) -> None:
        """Serve until ``stopping`` is set, then close the socket and the context."""
        auth = secure_server(self.context, self.socket, self.config.cluster)
        try:
            await self._serve()
        finally:
            if self.guard is not None:
                self.guard.stop()
            if auth is not None:
                auth.stop()  # before term(), which waits for the ZAP handler's sockets
        self.socket.close(linger=STOP_LINGER_MS)
        self.context.term()

    async def _serve(self) -> None:
        self.skips.start(self.store.skipped)
        self.guard = ConnectionGuard(self.socket, buffer_guard_limits(self.config), "buffer")
        self.socket.bind(self.endpoint)
        log.info("buffer serving on %s", self.endpoint)
        try:
            while not self.stopping.is_set():
                ready = await self.socket.poll(self.held.poll_timeout_ms(POLL_MS, time.monotonic()))
                self._expire_silent_generators()
                if ready:
                    await self._receive()
                    self.skips.record(self.store.skipped, self.store.config.stale_retries)
                await self._serve_held(time.monotonic())
                await self.learner.serve_results(time.monotonic())
                progress.beat("serving", detail=self._progress_detail)  # the loop turned
        finally:  # no peer is left waiting on a request that will never be answered
            for held in self.held:
                await self._answer_held(held, [], time.monotonic())
            await self.learner.serve_results(math.inf)

    def _progress_detail(self) -> str:
        return f"{self.store.held_samples()} ready samples, {len(self.store.last_seen)} generators"

    async def _receive(self) -> None:
        message = await self.socket.recv_multipart(copy=False)
        assert self.guard is not None  # made before the socket binds
        self.guard.received(message)
        identity, *frames = message
        try:
            role = peer_role(frames[0] if frames else identity)
            if self.config.cluster.auth and role is None:
                raise WireError("forbidden", "the sender authenticated as no role")
            body, arrays = decode(frames, max_header_bytes=MAX_HEADER_BYTES)
            authorize(self.config.cluster.auth, role, body)
            await self._handle(identity.bytes, body, arrays)
        except WireError as error:
            self._count_rejection(error.reason, str(error))
            await self._reply(identity.bytes, ErrorReply(error.reason, str(error)))
        except AssertionError:  # a broken invariant of the store: stop, loudly
            raise
        except Exception as error:  # one bad message must not stop the service
            self.rejected["internal"] += 1
            log.exception("failed to handle a message")
            await self._reply(identity.bytes, ErrorReply("internal", repr(error)))

    def _count_rejection(self, reason: str, detail: str) -> None:
        self.rejected[reason] += 1
        self.log_rejection(reason, detail, time.monotonic())

    def _expire_silent_generators(self) -> None:
        last_seen = dict(self.store.last_seen)
        for generator_id in self.store.expire_silent(time.monotonic()):
            self.incarnations.drop(generator_id)
            self.returns.expired(generator_id, last_seen[generator_id])
            log.warning(
                "generator %s silent for over %.1fs: its unfinished groups are requeued",
                generator_id,
                self.store.config.heartbeat_timeout_s,
            )

    async def _handle(self, identity: bytes, body, arrays) -> None:
        handler = self.handlers.get(type(body))
        if handler is None:
            raise WireError("unexpected_type", f"the buffer does not serve {type(body).__name__}")
        await handler(identity, body, arrays, time.monotonic())

    # ---------------------------------------------------------------- generators

    async def _on_work_request(self, identity: bytes, body: WorkRequest, _, now: float) -> None:
        wait_s = self._checked_wait(body.wait_s)
        if body.max_samples < 0:
            raise WireError("bad_field", f"WorkRequest.max_samples {body.max_samples} < 0")
        self.incarnations.claim(body.generator_id, body.incarnation)
        self._heard(body.generator_id, now)
        await self._answer_earlier(body.generator_id, now)  # one held per id: the newer counts
        items = self._dispatch(body.generator_id, body.max_samples, now)
        if items or not wait_s:
            retry = 0.0 if items else RETRY_AFTER_S
            await self._reply(identity, WorkGrant(items, self.store.policy_version, retry))
            return
        self.held.hold(HeldRequest(identity, body.generator_id, body.max_samples, now + wait_s))
        self.counters["work_requests_held"] += 1

    async def _on_trajectories(self, identity: bytes, body: Trajectories, arrays, now) -> None:
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
            self.generator_stats[sender] = dict(body.stats)
            self.generator_pools[sender] = body.pool or "default"
        await self._reply(identity, Ack(accepted, len(body.samples) - accepted))
        await self.learner.serve_pending()
        await self.learner.serve_results(now)  # the sample that completes a round

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

    async def _on_adapter_published(
        self, identity: bytes, body: AdapterPublished, _, now: float
    ) -> None:
        if self.adapters is None:
            raise WireError(
                "unexpected_type", "this run does not publish LoRA adapters alone (model.lora)"
            )
        self.adapters.announce(body.version, body.digest)
        await self._reply(identity, Ack(accepted=1))

    async def _on_heartbeat(self, identity: bytes, body: Heartbeat, _, now: float) -> None:
        self.incarnations.claim(body.generator_id, body.incarnation)
        self._heard(body.generator_id, now)
        self.store.heartbeat(body.generator_id, now)
        await self._reply(identity, Ack(accepted=0))

    def _heard(self, generator_id: str, now: float) -> None:
        if self.returns.heard(generator_id, now):
            self.counters["generators_returned"] += 1

    async def _on_join(self, identity: bytes, body: Join, _, now: float) -> None:
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
        self.generator_pools[generator_id] = body.pool
        log.info("generator %s (pool %s) joined", generator_id, body.pool)
        cluster = self.config.cluster
        joined = Joined(cluster.weights_port, self.store.policy_version, self.config.run.name)
        await self._reply(identity, joined)

    async def _on_leave(self, identity: bytes, body: Leave, _, now: float) -> None:
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
        await self._reply(identity, Ack(accepted=requeued))

    async def _on_status_request(self, identity: bytes, _body, _, now: float) -> None:
        await self._reply(identity, self._status(now))

    # ------------------------------------------------------------------- helpers

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

    async def _serve_held(self, now: float) -> None:
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

    async def _answer_earlier(self, generator_id: str, now: float) -> None:
        """Answer ``generator_id``'s held request, if any, with an empty grant."""
        earlier = self.held.pop(generator_id)
        if earlier is not None:
            await self._answer_held(earlier, [], now)

    async def _answer_held(self, held: HeldRequest, items: list[WorkItem], now: float) -> None:
        """Reply to a held request; the wait counts as contact when the replica is there."""
        self.held.release(held)
        grant = WorkGrant(items, self.store.policy_version, 0.0)
        if await self._reply(held.identity, grant):
            self.store.heartbeat(held.generator_id, now)

    def _stats(self, now: float) -> dict[str, float]:
        """The store's metrics, the service's own, and the generators' summed up."""
        stats = self.store.stats(now)
        stats |= service_metrics(self.rejected, self.counters, len(self.held))
        stats |= generators_summary(self.generator_stats)
        if self.guard is not None:
            stats |= {f"buffer_connections_{k}": float(v) for k, v in self.guard.stats().items()}
        return stats | busy_fraction(self.generator_stats, self.store.last_seen)

    def _status(self, now: float) -> Status:
        generators = {
            generator_id: {"seen_s_ago": now - seen, **self.generator_stats.get(generator_id, {})}
            for generator_id, seen in self.store.last_seen.items()
        }
        pools = dict(self.generator_pools)
        return Status(self.store.policy_version, self._stats(now), generators, pools)

    def _batch_stats(self) -> dict[str, float]:
        """What a batch carries: the metrics of a status, and the pools' sums."""
        stats = self._stats(time.monotonic())
        return stats | pools_summary(self.generator_stats, self.generator_pools)

    @property
    def run_dir(self) -> Path | None:
        """Where checkpoints and ``skipped_prompts.jsonl`` go; without one,
        SaveBufferState is refused and no skip is written."""
        return self.learner.run_dir

    @run_dir.setter
    def run_dir(self, run_dir: Path | None) -> None:
        self.learner.run_dir = self.skips.run_dir = run_dir

    async def _reply(self, identity: bytes, body, arrays=None) -> bool:
        """Send ``body`` to ``identity`` without waiting; False (and counted) if that peer
        is gone or its queue is full (``ROUTER_HWM``)."""
        try:
            frames = [identity, *encode(body, arrays)]
            await self.socket.send_multipart(frames, copy=False, flags=zmq.DONTWAIT)
        except zmq.ZMQError as error:  # the peer went away; its work is not lost here
            self._count_rejection("unroutable_reply", f"could not reply to a peer: {error}")
            return False
        return True
