"""The buffer service: one asyncio process (uvloop) between generators and learner.

::

    generators ──WorkRequest──▶ ┌─────────┐ ◀──BatchRequest(V)── learner
               ◀──WorkGrant───  │ buffer  │ ───Trajectories───▶
               ──Trajectories─▶ │         │     (answered when a batch is ready)
               ──Heartbeat───▶  └─────────┘

All state lives in :class:`~asyncrl.buffer.store.BufferStore`; this module only
moves messages and supplies the clock (``time.monotonic``). Each message type
has one small handler (:attr:`BufferService.handlers`): the generators' in
:mod:`asyncrl.buffer.generator_desk`, the learner's in :mod:`asyncrl.buffer.learner_desk`;
status requests, metrics and replies are the service's. Every message from a
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
from asyncrl.buffer.generator_desk import GeneratorDesk
from asyncrl.buffer.held import HeldRequests
from asyncrl.buffer.learner_desk import LearnerDesk
from asyncrl.buffer.metrics import busy_fraction, generators_summary, pools_summary, service_metrics
from asyncrl.buffer.peers import RejectionLog, authorize
from asyncrl.buffer.skips import SkipFile
from asyncrl.buffer.store import BufferStore
from asyncrl.buffer.validation import Limits, model_vocab_size
from asyncrl.config import Config
from asyncrl.core import progress
from asyncrl.core.connection_guard import ConnectionGuard
from asyncrl.core.message_limits import BUFFER_HEADER_BYTES, buffer_guard_limits
from asyncrl.core.messages import (
    AdapterPublished,
    BatchRequest,
    ErrorReply,
    EvalResultsRequest,
    Heartbeat,
    Join,
    Leave,
    SaveBufferState,
    StartEval,
    Status,
    StatusRequest,
    Trajectories,
    WireError,
    WorkRequest,
    decode,
    encode,
)
from asyncrl.core.security import peer_role, secure_server
from asyncrl.core.trajectory import split_samples as split_samples  # benchmarks import it

log = logging.getLogger("asyncrl.buffer")

POLL_MS = 100
"""Longest wait for a message before the loop checks for silent generators."""
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
        self.stopping = asyncio.Event()
        self.held = HeldRequests()
        """Work requests waiting for work, and the learner's request for eval results."""
        self.counters: Counter[str] = Counter()
        """``abandon_noops``, ``work_requests_capped``, ``work_requests_held`` (ever),
        ``work_requests_held_granted`` (got items) and ``generators_returned``."""
        self.skips = SkipFile(run_dir)
        # the learner's adapter digests, when samples must be checked against them
        adapters = AdapterLedger() if config.model.publishes_adapters else None
        self.learner = LearnerDesk(
            store, self.held, self._reply, self._batch_stats, run_dir, self.counters, adapters
        )
        """Serves the learner's messages and delivers its batches and eval results."""
        limits = Limits.from_config(
            config, vocab_size if vocab_size is not None else model_vocab_size(config)
        )
        self.generators = GeneratorDesk(
            config,
            store,
            self.held,
            self._reply,
            limits,
            adapters,
            self._samples_stored,
            self.counters,
            self.log_rejection,
        )
        """Serves the generators' messages, answers their held requests, expires the silent."""
        self.handlers: dict[type, Handler] = {
            WorkRequest: self.generators.on_work_request,
            Trajectories: self.generators.on_trajectories,
            Heartbeat: self.generators.on_heartbeat,
            Join: self.generators.on_join,
            Leave: self.generators.on_leave,
            StatusRequest: self._on_status_request,
            BatchRequest: self.learner.on_batch_request,
            StartEval: self.learner.on_start_eval,
            EvalResultsRequest: self.learner.on_eval_results_request,
            SaveBufferState: self.learner.on_save_buffer_state,
            AdapterPublished: self.learner.on_adapter_published,
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
                await self.generators.serve_held(time.monotonic())
                await self.learner.serve_results(time.monotonic())
                progress.beat("serving", detail=self._progress_detail)  # the loop turned
        finally:  # no peer is left waiting on a request that will never be answered
            await self.generators.answer_all_held(time.monotonic())
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
        self.generators.expire_silent(time.monotonic())

    async def _handle(self, identity: bytes, body, arrays) -> None:
        handler = self.handlers.get(type(body))
        if handler is None:
            raise WireError("unexpected_type", f"the buffer does not serve {type(body).__name__}")
        await handler(identity, body, arrays, time.monotonic())

    async def _on_status_request(self, identity: bytes, _body, _, now: float) -> None:
        await self._reply(identity, self._status(now))

    async def _samples_stored(self, now: float) -> None:
        """A generator's samples were taken in: serve the learner what they complete."""
        await self.learner.serve_pending()
        await self.learner.serve_results(now)  # the sample that completes a round

    def _stats(self, now: float) -> dict[str, float]:
        """The store's metrics, the service's own, and the generators' summed up."""
        stats = self.store.stats(now)
        stats |= service_metrics(self.rejected, self.counters, len(self.held))
        stats |= generators_summary(self.generators.stats)
        if self.guard is not None:
            stats |= {f"buffer_connections_{k}": float(v) for k, v in self.guard.stats().items()}
        return stats | busy_fraction(self.generators.stats, self.store.last_seen)

    def _status(self, now: float) -> Status:
        generators = {
            generator_id: {"seen_s_ago": now - seen, **self.generators.stats.get(generator_id, {})}
            for generator_id, seen in self.store.last_seen.items()
        }
        pools = dict(self.generators.pools)
        return Status(self.store.policy_version, self._stats(now), generators, pools)

    def _batch_stats(self) -> dict[str, float]:
        """What a batch carries: the metrics of a status, and the pools' sums."""
        stats = self._stats(time.monotonic())
        return stats | pools_summary(self.generators.stats, self.generators.pools)

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
