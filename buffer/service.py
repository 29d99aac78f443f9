"""The buffer service: one asyncio process (uvloop) between generators and learner.

::

    generators ──WorkRequest──▶ ┌─────────┐ ◀──BatchRequest(V)── learner
               ◀──WorkGrant───  │ buffer  │ ───Trajectories───▶
               ──Trajectories─▶ │         │     (answered when a batch is ready)
               ──Heartbeat───▶  └─────────┘

All state lives in :class:`~asyncrl.buffer.store.BufferStore`; this module only
moves messages and supplies the clock (``time.monotonic``): every message from
a generator counts as its heartbeat, and each turn of the poll loop requeues
the groups of generators silent for ``buffer.heartbeat_timeout_s``. A
malformed or unknown message is answered with an ``ErrorReply``, counted
under ``rejected_<reason>``, and the service goes on.

The buffer trusts no peer's word (docs/security.md, "What the buffer accepts"). With
``cluster.auth`` on, every message carries the role its sender authenticated as
(:func:`~asyncrl.security.peer_role`), and each role is served only its own
requests: ``BatchRequest``, ``StartEval``, ``EvalResultsRequest`` and
``SaveBufferState`` the learner's; ``WorkRequest``, ``Trajectories``,
``Heartbeat``, ``Join`` and ``Leave`` a generator's; ``StatusRequest`` anyone's
(else ``forbidden``). A generator id belongs to one process at a time, its
*incarnation*: the random number it draws at start and sends with every
message, from any of its sockets. The first message of an id not alive
registers its incarnation; while it is alive, a message naming it with another
incarnation is refused (``wrong_incarnation``): it books no work, keeps nothing
alive, hands nothing back, delivers nothing. Only a ``Join`` replaces it (a
process restarted under the same id): the old one's unfinished groups are
requeued at once (``buffer_generators_replaced``). Samples are checked whole
before any is stored (:mod:`asyncrl.buffer.validation`), and the learner's
version may only move by one (``bad_version``).

A ``WorkRequest`` with ``wait_s > 0`` that finds nothing to hand out is held
(one per generator id) rather than answered: after each turn of the loop in
which dispatch could have changed its answer (a new policy version, freed
admission budget, requeued groups, back-pressure lifted) the held requests
are tried again in arrival order, and one still empty at its deadline is
answered with an empty grant. So an idle replica gets work the moment the
learner admits it, instead of after a ``RETRY_AFTER_S`` poll interval; an eval
round starting (``StartEval``) counts as such a change, so held replicas get
its prompts at once.

The learner starts held-out eval rounds with ``StartEval``; a finished round's
``eval_*`` results ride along with the next batch's ``stats``
(:mod:`asyncrl.buffer.evaluation`). After its last step the learner asks for the
results no batch will carry (``EvalResultsRequest``): the request is answered at
once when results wait or no round runs, and otherwise held, like a work
request, until the running round completes or its ``wait_s`` runs out.

Every prompt the store gives up on (a stale group out of retries, a filtered
group) is appended to ``RUN_DIR/skipped_prompts.jsonl`` as it happens, one line
``{"group_id", "reason", "step"}`` each, so a user can find it; the checkpoint's
``buffer.json`` keeps the same record, and a resumed buffer rewrites the file from
it (skips after that checkpoint were undone with the rest of the lost work).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import signal
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import uvloop
import zmq
import zmq.asyncio

from asyncrl import progress
from asyncrl.buffer.durable import Skip
from asyncrl.buffer.store import BufferStore, Sample
from asyncrl.buffer.validation import (
    Limits,
    check_generator_id,
    check_pool,
    check_trajectories,
    model_vocab_size,
    sender_of,
)
from asyncrl.buffer.validation import split_samples as split_samples  # benchmarks import it
from asyncrl.config import Config
from asyncrl.messages import (
    Ack,
    BatchRequest,
    ErrorReply,
    EvalResults,
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
    TrajectoryMeta,
    WireError,
    WorkGrant,
    WorkItem,
    WorkRequest,
    _Body,
    decode,
    encode,
)
from asyncrl.paths import BUFFER_STATE, checkpoint_dir
from asyncrl.security import GENERATOR, LEARNER, OBSERVER, peer_role, secure_server
from asyncrl.transport import tcp

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
REFUSALS = ("dispatch_refused_admission", "dispatch_refused_backpressure")
"""Store counters a held request adds to once, when it is first refused, not per retry."""
ROUTER_HWM = 64
"""Messages queued per peer connection on the buffer's ROUTER socket, each way (SNDHWM,
RCVHWM). A generator or the learner has one or two requests out at a time. A peer that
sends without reading its replies fills its own queue: later replies to it are dropped
at once, never waited for (``buffer_rejected_unroutable_reply``), and once its inbound
queue is full ZeroMQ stops reading its connection. Either way the buffer's memory for
one peer stays bounded by this many messages."""
MAX_HEADER_BYTES = 1 << 20
"""The largest header frame the buffer decodes (``oversized`` beyond): a generator's
message of a thousand samples has a header of about 150 KB."""
MAX_IN_FLIGHT_FACTOR = 4
"""A generator may hold at most this many times the largest pool's
``generators.max_active_samples`` in flight (samples handed to it, not yet delivered):
the ones it generates plus the finished ones still being scored (a replica asks for
``max_active_samples`` less what it generates, and a slow reward can hold as many again).
A request beyond that is granted only what fits (counted in
``buffer_work_requests_capped``), so one generator id cannot book an unbounded share of
the admission budget."""
SKIPPED_PROMPTS = "skipped_prompts.jsonl"
"""``RUN_DIR/SKIPPED_PROMPTS``: one JSON line per prompt handed out and given up on."""
SKIPS_LOGGED = 10
"""Group ids named in one log line about prompts skipped as stale (all are in the file)."""
REJECTION_LOG_EVERY_S = 10.0
"""At most one log line per rejection reason this often; the count of the others rides
along with the next line (every rejection is counted in ``buffer_rejected_<reason>``)."""
ROLES_SERVED: dict[type, frozenset[str]] = {
    BatchRequest: frozenset({LEARNER}),
    StartEval: frozenset({LEARNER}),
    EvalResultsRequest: frozenset({LEARNER}),
    SaveBufferState: frozenset({LEARNER}),
    WorkRequest: frozenset({GENERATOR}),
    Trajectories: frozenset({GENERATOR}),
    Heartbeat: frozenset({GENERATOR}),
    Join: frozenset({GENERATOR}),
    Leave: frozenset({GENERATOR}),
    StatusRequest: frozenset({LEARNER, GENERATOR, OBSERVER}),
}
"""Which authenticated roles may send each message the buffer serves."""
REJECTION_REASONS = (
    "forbidden",
    "wrong_incarnation",
    "bad_version",
    "bad_step",
    "bad_tokens",
    "bad_logprobs",
    "bad_reward",
    "bad_lengths",
    "bad_prompt",
    "bad_index",
    "bad_mask",
    "bad_stats",
    "bad_pool",
    "bad_field",
    "bad_array",
    "bad_header",
    "oversized",
    "unroutable_reply",
)
"""``buffer_rejected_<reason>`` counters reported in every batch's stats (and status),
0 until one happens; any other reason appears once it is counted."""


@dataclass
class HeldRequest:
    """A WorkRequest waiting for work: whom to answer, what it asked for, until when."""

    identity: bytes
    generator_id: str
    max_samples: int
    deadline: float
    """``time.monotonic()`` after which it is answered with an empty grant."""


@dataclass
class HeldResultsRequest:
    """An EvalResultsRequest waiting for the running round to complete."""

    identity: bytes
    deadline: float
    """``time.monotonic()`` after which it is answered with what there is (maybe nothing)."""


class RejectionLog:
    """Logs a rejection at most once per reason every ``every_s`` seconds, with the count
    of those left out since: a peer sending junk must not flood the buffer's log."""

    def __init__(self, every_s: float = REJECTION_LOG_EVERY_S):
        self.every_s = every_s
        self.last: dict[str, float] = {}
        self.unlogged: Counter[str] = Counter()

    def __call__(self, reason: str, detail: str, now: float) -> None:
        last = self.last.get(reason)
        if last is not None and now - last < self.every_s:
            self.unlogged[reason] += 1
            return
        more = self.unlogged.pop(reason, 0)
        since = f" (and {more} more since the last such line)" if more else ""
        log.warning("rejected a message: %s%s", detail[:300], since)
        self.last[reason] = now


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
        self.run_dir = run_dir
        """Where checkpoints go; without one, SaveBufferState is refused."""
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
        self.rejected: Counter[str] = Counter()
        self.log_rejection = RejectionLog()
        self.incarnations: dict[str, int] = {}
        """Generator id -> the incarnation it registered while alive (module docstring)."""
        self.pools_known: set[str] = {p.name for p in config.generators.resolved_pools()}
        """Pool names reported on (``validation.MAX_POOLS`` at most)."""
        self.reward_error_kinds: set[str] = set()
        """Reward-error tags counted so far (``validation.MAX_REWARD_ERROR_KINDS`` at most)."""
        self.last_served_to: bytes | None = None
        """The peer the last batch went to: only it may hand that batch back."""
        self.batch_taken_back = False
        """The last batch served was handed back already (it goes back once)."""
        self.pending_batch: bytes | None = None
        """Identity of the learner waiting for a batch, if any."""
        self.stopping = asyncio.Event()
        self.generator_stats: dict[str, dict[str, float]] = {}
        """Each generator's latest counters (weight swaps, latency, reward errors)."""
        self.generator_pools: dict[str, str] = {}
        self.held: dict[str, HeldRequest] = {}
        """Work requests waiting for work, by generator id, oldest first."""
        self.held_seen: tuple | None = None
        """The store's dispatch state when the held requests were last tried."""
        self.counters: Counter[str] = Counter()
        """``work_requests_held`` (ever) and ``work_requests_held_granted`` (got items)."""
        self.held_results: HeldResultsRequest | None = None
        """The learner's request for eval results, while the running round is not done."""
        self.skips_written = 0
        """How many of ``store.skipped`` are in ``RUN_DIR/skipped_prompts.jsonl``."""

    async def serve_loop(self) -> None:
        """Serve until ``stopping`` is set, then close the socket and the context."""
        auth = secure_server(self.context, self.socket, self.config.cluster)
        try:
            await self._serve()
        finally:
            if auth is not None:
                auth.stop()  # before term(), which waits for the ZAP handler's sockets
        self.socket.close(linger=STOP_LINGER_MS)
        self.context.term()

    async def _serve(self) -> None:
        self._start_skip_record()
        self.socket.bind(self.endpoint)
        log.info("buffer serving on %s", self.endpoint)
        try:
            while not self.stopping.is_set():
                ready = await self.socket.poll(self._poll_timeout_ms())
                self._expire_silent_generators()
                if ready:
                    await self._receive()
                    self._record_skips()
                await self._serve_held(time.monotonic())
                await self._serve_results(time.monotonic())
                progress.beat("serving", detail=self._progress_detail)  # the loop turned
        finally:  # no peer is left waiting on a request that will never be answered
            for held in list(self.held.values()):
                await self._answer_held(held, [], time.monotonic())
            await self._serve_results(math.inf)

    def _progress_detail(self) -> str:
        return f"{self.store.held_samples()} ready samples, {len(self.store.last_seen)} generators"

    async def _receive(self) -> None:
        identity, *frames = await self.socket.recv_multipart(copy=False)
        try:
            role = peer_role(frames[0] if frames else identity)
            if self.config.cluster.auth and role is None:
                raise WireError("forbidden", "the sender authenticated as no role")
            body, arrays = decode(frames, max_header_bytes=MAX_HEADER_BYTES)
            self._authorize(role, body)
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

    def _authorize(self, role: str | None, body: _Body) -> None:
        """Refuse (``forbidden``) a message its sender's role may not send; with
        ``cluster.auth`` off every role is taken at its word."""
        allowed = ROLES_SERVED.get(type(body))
        if self.config.cluster.auth and allowed is not None and role not in allowed:
            raise WireError(
                "forbidden",
                f"{type(body).__name__} is served to the {' or '.join(sorted(allowed))} only, "
                f"not to a {role}",
            )

    def _count_rejection(self, reason: str, detail: str) -> None:
        self.rejected[reason] += 1
        self.log_rejection(reason, detail, time.monotonic())

    def _live_incarnation(self, generator_id: str) -> int | None:
        """The incarnation ``generator_id`` registered, while it is alive; else None."""
        if generator_id not in self.store.last_seen:
            return None
        return self.incarnations.get(generator_id)

    def _claim(self, generator_id: str, incarnation: int) -> None:
        """The sender of a generator message is ``generator_id``'s live process, or the id
        is free and becomes its (else ``wrong_incarnation``, and nothing is done)."""
        check_generator_id(generator_id)
        live = self._live_incarnation(generator_id)
        if live is None:
            self.incarnations[generator_id] = incarnation
        elif live != incarnation:
            raise WireError(
                "wrong_incarnation",
                f"generator {generator_id} is alive as another process; a restarted process "
                "replaces it with Join",
            )

    def _poll_timeout_ms(self) -> int:
        """``POLL_MS``, or less when a held request's deadline comes first."""
        deadlines = [held.deadline for held in self.held.values()]
        if self.held_results is not None:
            deadlines.append(self.held_results.deadline)
        if not deadlines:
            return POLL_MS
        first = min(deadlines)
        return max(0, min(POLL_MS, math.ceil((first - time.monotonic()) * 1000)))

    def _expire_silent_generators(self) -> None:
        for generator_id in self.store.expire_silent(time.monotonic()):
            self.incarnations.pop(generator_id, None)
            log.warning(
                "generator %s silent for over %.1fs: its unfinished groups are requeued",
                generator_id,
                self.store.heartbeat_timeout_s,
            )

    async def _handle(self, identity: bytes, body, arrays) -> None:
        now = time.monotonic()
        match body:
            case WorkRequest(
                generator_id=generator_id,
                max_samples=max_samples,
                wait_s=wait_s,
                incarnation=incarnation,
            ):
                wait_s = self._checked_wait(wait_s)
                if max_samples < 0:
                    raise WireError("bad_field", f"WorkRequest.max_samples {max_samples} < 0")
                self._claim(generator_id, incarnation)
                earlier = self.held.pop(generator_id, None)
                if earlier is not None:  # one held request per generator: the newer one counts
                    await self._answer_held(earlier, [], now)
                items = self._dispatch(generator_id, max_samples, now)
                if items or not wait_s:
                    retry = 0.0 if items else RETRY_AFTER_S
                    await self._reply(identity, WorkGrant(items, self.store.policy_version, retry))
                else:
                    held = HeldRequest(identity, generator_id, max_samples, now + wait_s)
                    self.held[generator_id] = held
                    self.counters["work_requests_held"] += 1
            case Trajectories(samples=metas, stats=generator_stats, pool=pool):
                sender = sender_of(body)
                if pool:
                    check_pool(pool, self.pools_known)
                if metas:
                    self._claim(sender, body.incarnation)
                samples = check_trajectories(
                    body,
                    {name: a.numpy() for name, a in arrays.items()},
                    self.limits,
                    self.store.policy_version + 1,  # published before the learner asks
                    self.store.handed_out,
                    self.reward_error_kinds,
                )
                accepted = self.store.ingest(samples, now)
                if metas and generator_stats:
                    self.generator_stats[sender] = dict(generator_stats)
                    self.generator_pools[sender] = pool or "default"
                await self._reply(identity, Ack(accepted, len(samples) - accepted))
                await self._serve_pending()
                await self._serve_results(now)  # the sample that completes a round
            case Heartbeat(generator_id=generator_id, incarnation=incarnation):
                self._claim(generator_id, incarnation)
                self.store.heartbeat(generator_id, now)
                await self._reply(identity, Ack(accepted=0))
            case Join(generator_id=generator_id, pool=pool, incarnation=incarnation):
                check_generator_id(generator_id)
                check_pool(pool, self.pools_known)
                live = self._live_incarnation(generator_id)
                if live is not None and live != incarnation:  # restarted under the same id
                    earlier = self.held.pop(generator_id, None)
                    if earlier is not None:
                        await self._answer_held(earlier, [], now)
                    requeued = self.store.replace(generator_id, now)
                    log.warning(
                        "generator %s joined again as a new process: the old one's %d "
                        "unfinished group(s) are requeued",
                        generator_id,
                        requeued,
                    )
                self.incarnations[generator_id] = incarnation
                self.store.heartbeat(generator_id, now)
                self.generator_pools[generator_id] = pool
                log.info("generator %s (pool %s) joined", generator_id, pool)
                joined = Joined(
                    self.config.cluster.weights_port,
                    self.store.policy_version,
                    self.config.run.name,
                )
                await self._reply(identity, joined)
            case Leave(generator_id=generator_id, incarnation=incarnation):
                check_generator_id(generator_id)
                live = self._live_incarnation(generator_id)
                if live is not None and live != incarnation:
                    raise WireError(
                        "wrong_incarnation",
                        f"Leave names generator {generator_id}, alive as another process",
                    )
                earlier = self.held.pop(generator_id, None)
                if earlier is not None:  # answered first: every request gets one reply
                    await self._answer_held(earlier, [], now)
                requeued = self.store.leave(generator_id)
                self.incarnations.pop(generator_id, None)
                log.info(
                    "generator %s left; %d unfinished group(s) requeued", generator_id, requeued
                )
                await self._reply(identity, Ack(accepted=requeued))
            case StatusRequest():
                await self._reply(identity, self._status(now))
            case BatchRequest(policy_version=version):
                self._check_version("BatchRequest.policy_version", version)
                self.store.set_policy_version(version)
                self.pending_batch = identity
                await self._serve_pending()
            case StartEval(round=number, policy_version=version):
                if not self.store.evaluation.enabled:
                    raise WireError("bad_field", "this run has no eval prompts (eval is off)")
                self._check_version("StartEval.policy_version", version)
                latest = self.store.evaluation.last_started
                started = self.store.start_eval(number, version, now)
                if started:
                    log.info("eval round %d of version %d started", number, version)
                elif number > latest:
                    log.warning(
                        "eval round %d of version %d skipped: round %d is still running",
                        number,
                        version,
                        latest,
                    )
                await self._reply(identity, Ack(accepted=int(started)))
            case EvalResultsRequest(wait_s=wait_s):
                if not self.store.evaluation.enabled:
                    raise WireError("bad_field", "this run has no eval prompts (eval is off)")
                await self._serve_results(math.inf)  # an earlier one: the newer one counts
                self.held_results = HeldResultsRequest(identity, now + wait_s)
                await self._serve_results(now)
            case SaveBufferState(step=step, abandoned_batch_request=abandoned):
                if self.run_dir is None:
                    raise WireError(
                        "unexpected_type", "this buffer has no run directory to save into"
                    )
                version = self.store.policy_version
                if not 0 <= step <= version + 1:
                    raise WireError(
                        "bad_step",
                        f"SaveBufferState.step {step}: the learner at version {version} "
                        f"checkpoints a step in [0, {version + 1}]",
                    )
                if abandoned:
                    self._take_back_batch(identity)
                self._save_state(step)
                await self._reply(identity, Ack(accepted=1))
            case _:
                raise WireError(
                    "unexpected_type", f"the buffer does not serve {type(body).__name__}"
                )

    def _check_version(self, field: str, version: int) -> None:
        """The learner's version moves by at most one per message: ``version`` is the
        current one or the next (``bad_version``, and the store is not touched)."""
        current = self.store.policy_version
        if not current <= version <= current + 1:
            raise WireError("bad_version", f"{field} {version}: the buffer is at version {current}")

    def _dispatch(
        self, generator_id: str, max_samples: int, now: float, retry: bool = False
    ) -> list[WorkItem]:
        """Dispatch at most ``max_samples``, within the generator's in-flight cap (a request
        the cap cuts is counted once, not on each ``retry`` of a held one)."""
        room = self.max_in_flight - self.store.in_flight_samples(generator_id)
        if room < max_samples and not retry:
            self.counters["work_requests_capped"] += 1
        return self.store.dispatch(generator_id, max(0, min(max_samples, room)), now)

    def _checked_wait(self, wait_s: float) -> float:
        """``WorkRequest.wait_s``, cut to the longest hold the heartbeat timeout allows."""
        if not math.isfinite(wait_s) or wait_s < 0:
            raise WireError(
                "bad_field", f"WorkRequest.wait_s must be a finite number >= 0, got {wait_s}"
            )
        return min(wait_s, MAX_WAIT_FRACTION * self.store.heartbeat_timeout_s)

    def _dispatch_state(self) -> tuple:
        """What a refused dispatch depends on: held requests are tried again when it changes.

        Admission (the version, the samples started), the requeued groups
        waiting (a new one, or one taken that blocked new prompts), back-pressure,
        and the eval round (one starting, or its groups handed back).
        """
        store = self.store
        requeued = (
            len(store.requeue),
            store.counters["requeued_groups"],
            store.counters["stale_requeued_groups"],
        )
        evaluation = store.evaluation.dispatch_state()
        return (
            store.policy_version,
            store.started_samples,
            requeued,
            store.backpressured(),
            evaluation,
        )

    async def _serve_held(self, now: float) -> None:
        """Answer held requests that dispatch can now serve, and those past their deadline."""
        if not self.held:
            return
        state = self._dispatch_state()
        if state != self.held_seen:
            for held in list(self.held.values()):
                refusals = {key: self.store.counters[key] for key in REFUSALS}
                items = self._dispatch(held.generator_id, held.max_samples, now, retry=True)
                if items:
                    self.counters["work_requests_held_granted"] += 1
                    await self._answer_held(held, items, now)
                else:  # the same request refused again: not a new refusal
                    for key, value in refusals.items():
                        self.store.counters[key] = value
            self.held_seen = self._dispatch_state()
        for held in [h for h in self.held.values() if h.deadline <= now]:
            await self._answer_held(held, [], now)

    async def _answer_held(self, held: HeldRequest, items: list[WorkItem], now: float) -> None:
        """Reply to a held request; the wait counts as contact when the replica is there."""
        if self.held.get(held.generator_id) is held:
            del self.held[held.generator_id]
        grant = WorkGrant(items, self.store.policy_version, 0.0)
        if await self._reply(held.identity, grant):
            self.store.heartbeat(held.generator_id, now)

    async def _serve_results(self, now: float) -> None:
        """Answer the held request for eval results once it can be (results wait, or no
        round runs) or at its deadline, with every finished round's results not handed
        over yet."""
        held = self.held_results
        evaluation = self.store.evaluation
        if held is None or (now < held.deadline and not evaluation.results_ready()):
            return
        self.held_results = None
        reply = EvalResults(evaluation.take_results(), evaluation.running_round)
        if not await self._reply(held.identity, reply):
            for results in reversed(reply.results):  # not delivered: keep them for a batch
                evaluation.give_back(results)

    def _service_stats(self) -> dict[str, float]:
        """The service's own counters: rejected messages and held work requests."""
        reasons = [*REJECTION_REASONS, *(r for r in self.rejected if r not in REJECTION_REASONS)]
        stats = {f"buffer_rejected_{r}": float(self.rejected[r]) for r in reasons}
        return stats | {
            "buffer_abandon_noops": float(self.counters["abandon_noops"]),
            "buffer_work_requests_capped": float(self.counters["work_requests_capped"]),
            "buffer_work_requests_held": float(self.counters["work_requests_held"]),
            "buffer_work_requests_held_granted": float(self.counters["work_requests_held_granted"]),
            "buffer_work_requests_held_now": float(len(self.held)),
        }

    def _status(self, now: float) -> Status:
        stats = self.store.stats(now) | self._service_stats()
        stats |= generators_summary(self.generator_stats)
        stats |= busy_fraction(self.generator_stats, self.store.last_seen)
        generators = {
            generator_id: {"seen_s_ago": now - seen, **self.generator_stats.get(generator_id, {})}
            for generator_id, seen in self.store.last_seen.items()
        }
        return Status(self.store.policy_version, stats, generators, dict(self.generator_pools))

    def _take_back_batch(self, learner: bytes) -> None:
        """The learner gave up on its batch request: cancel it, or take back its answer.

        Messages from one peer arrive in order, so if the request is no longer
        pending here, its batch was sent and is the last one served.
        """
        if self.pending_batch == learner:
            self.pending_batch = None
            log.info("the learner's abandoned batch request is cancelled")
            return
        if self.last_served_to != learner or self.batch_taken_back:
            self.counters["abandon_noops"] += 1  # not that peer's batch, or back already
            log.warning("an abandoned batch request with no batch of its own to hand back: ignored")
            return
        returned = self.store.return_last_batch()
        self.batch_taken_back = True
        log.info("took back the last batch (%d samples): the learner stopped before it", returned)

    def _save_state(self, step: int) -> None:
        assert self.run_dir is not None
        path = checkpoint_dir(self.run_dir, step) / BUFFER_STATE
        path.parent.mkdir(parents=True, exist_ok=True)
        state = self.store.durable_state()
        _write_atomically(path, json.dumps(state))
        log.info(
            "saved buffer state for step %d: cursor %d, %d unfinished groups, %d prompts skipped",
            step,
            state["cursor"],
            len(state["unfinished_groups"]),
            len(state["skipped_groups"]),
        )

    def _start_skip_record(self) -> None:
        """Make ``skipped_prompts.jsonl`` hold exactly the skips the store knows of now
        (none in a new run; a restored checkpoint's on resume)."""
        path = self._skip_record_path()
        if path is None or not (path.exists() or self.store.skipped):
            return
        _write_atomically(path, "".join(_skip_line(skip) for skip in self.store.skipped))
        self.skips_written = len(self.store.skipped)

    def _record_skips(self) -> None:
        """Append the prompts given up on since the last call, one line each, and log them."""
        path = self._skip_record_path()
        new = self.store.skipped[self.skips_written :]
        if path is None or not new:
            return
        try:
            with path.open("a") as record:
                record.write("".join(_skip_line(skip) for skip in new))
        except OSError as error:  # kept in the store and buffer.json; tried again next time
            log.error("could not record %d skipped prompt(s) in %s: %s", len(new), path, error)
            return
        self.skips_written += len(new)
        stale = [skip.group_id for skip in new if skip.reason == "stale"]  # filtered: by design
        if stale:
            log.warning(
                "%d prompt(s) skipped as stale after buffer.stale_retries=%d retries (%s): "
                "recorded in %s",
                len(stale),
                self.store.stale_retries,
                _first_ids(stale),
                SKIPPED_PROMPTS,
            )

    def _skip_record_path(self) -> Path | None:
        return None if self.run_dir is None else self.run_dir / SKIPPED_PROMPTS

    async def _serve_pending(self) -> None:
        if self.pending_batch is None:
            return
        batch = self.store.take_batch()
        if batch is None:
            return
        stats = self.store.stats(time.monotonic()) | self._service_stats()
        stats |= generators_summary(self.generator_stats)
        stats |= busy_fraction(self.generator_stats, self.store.last_seen)
        stats |= pools_summary(self.generator_stats, self.generator_pools)
        stats |= self.store.batch_eval_results  # a finished eval round's, once
        metas, arrays = join_samples(batch)
        learner, self.pending_batch = self.pending_batch, None
        if await self._reply(learner, Trajectories(metas, stats), arrays):
            self.last_served_to, self.batch_taken_back = learner, False
        else:  # the learner is gone or not reading: the batch is not lost
            self.store.return_last_batch()
            self.last_served_to, self.batch_taken_back = None, True

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


def _write_atomically(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file: a reader never sees half."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def _skip_line(skip: Skip) -> str:
    return json.dumps(skip.as_dict()) + "\n"


def _first_ids(group_ids: list[int]) -> str:
    """Up to ``SKIPS_LOGGED`` ids for a log line, "..." if there are more."""
    shown = ", ".join(map(str, group_ids[:SKIPS_LOGGED]))
    return shown + ", ..." if len(group_ids) > SKIPS_LOGGED else shown


def generators_summary(per_generator: dict[str, dict[str, float]]) -> dict[str, float]:
    """``generators_<key>``: the mean over generators of each latest counter (latencies),
    and ``generators_<key>_total`` the sum (counts such as swaps and reward errors)."""
    summary: dict[str, float] = {}
    keys = sorted({key for stats in per_generator.values() for key in stats})
    for key in keys:
        values = [stats[key] for stats in per_generator.values() if key in stats]
        summary[f"generators_{key}"] = sum(values) / len(values)
        summary[f"generators_{key}_total"] = float(sum(values))
    return summary


def busy_fraction(
    per_generator: dict[str, dict[str, float]], live: Iterable[str]
) -> dict[str, float]:
    """``generators_busy_fraction``: the share of their time the live replicas spent
    generating or loading weights (their ``busy_s`` over their ``wall_s``, summed), so an
    idle fleet (a learner-bound run, a sync run's training phase) shows. Absent until a
    live replica has reported."""
    reports = [per_generator[g] for g in live if g in per_generator]
    wall = sum(stats.get("wall_s", 0.0) for stats in reports)
    if wall <= 0:
        return {}
    busy = sum(stats.get("busy_s", 0.0) for stats in reports)
    return {"generators_busy_fraction": busy / wall}


def pools_summary(
    per_generator: dict[str, dict[str, float]], pools: dict[str, str]
) -> dict[str, float]:
    """``pool_<name>_<key>_total``: each counter summed over the pool's generators, and
    ``pool_<name>_replicas``: how many of them have reported (restarted ones included)."""
    summary: dict[str, float] = {}
    for generator, stats in per_generator.items():
        pool = pools.get(generator, "default")
        summary[f"pool_{pool}_replicas"] = summary.get(f"pool_{pool}_replicas", 0.0) + 1
        for key, value in stats.items():
            name = f"pool_{pool}_{key}_total"
            summary[name] = summary.get(name, 0.0) + value
    return summary


# --------------------------------------------------------------------------
# trajectories <-> flat arrays


def join_samples(samples: list[Sample]) -> tuple[list[TrajectoryMeta], dict[str, np.ndarray]]:
    arrays = {
        "prompt_ids": np.concatenate([s.prompt_ids for s in samples]).astype(np.int32),
        "response_ids": np.concatenate([s.response_ids for s in samples]).astype(np.int32),
        "logprobs": np.concatenate([s.logprobs for s in samples]).astype(np.float32),
        "token_versions": np.concatenate([s.token_versions for s in samples]).astype(np.int32),
        "loss_mask": np.concatenate([s.loss_mask for s in samples]).astype(np.uint8),
    }
    return [s.meta for s in samples], arrays


# --------------------------------------------------------------------------
# process entry


def build_store(
    config: Config,
    make_item: Callable[[int], WorkItem],
    eval_items: Sequence[WorkItem] | None = None,
) -> BufferStore:
    """The store a run's ``buffer`` section describes, handing out ``make_item(index)``;
    eval rounds run on ``eval_items`` (None: the ``eval`` section's prompts)."""
    if eval_items is None:
        from asyncrl.tasks import eval_work_items

        eval_items = eval_work_items(config)
    buffer = config.buffer
    return BufferStore(
        make_item=make_item,
        samples_per_step=config.algorithm.samples_per_step,
        max_staleness=buffer.max_staleness,
        admission_control=buffer.admission_control,
        heartbeat_timeout_s=buffer.heartbeat_timeout_s,
        max_reuse=buffer.max_reuse,
        filter_equal_rewards=buffer.filter_equal_rewards,
        filter_truncated=buffer.filter_truncated,
        max_held_samples=buffer.max_held_samples,
        max_held_bytes=buffer.max_held_bytes,
        eval_items=eval_items,
        stale_retries=buffer.stale_retries,
    )


def restore_from(store: BufferStore, checkpoint: Path) -> None:
    """Restore ``store`` from ``checkpoint``'s buffer.json; a file that cannot be read or
    is not a valid state stops the buffer with one line naming it (SystemExit)."""
    path = checkpoint / BUFFER_STATE
    try:
        store.restore(json.loads(path.read_text()))
    except (OSError, ValueError) as error:  # JSONDecodeError is a ValueError
        raise SystemExit(f"cannot resume from {path}: {error}") from None
    log.info(
        "resumed from %s: cursor %d, %d unfinished groups handed out first, %d prompts "
        "skipped before, %d groups trained since it was written",
        checkpoint,
        store.cursor,
        len(store.requeue),
        len(store.skipped),
        store.counters["restored_skipped_trained"] + len(store.trained_ahead),
    )


def run(config: Config, run_dir: Path, resume_from: Path | None = None) -> None:
    """Serve until SIGTERM; with ``resume_from`` (a checkpoint), continue its dataset state."""
    from asyncrl.tasks import work_item_factory

    store = build_store(config, work_item_factory(config))
    if resume_from is not None:
        restore_from(store, resume_from)
    if store.evaluation.enabled:
        log.info(
            "eval rounds: %d held-out prompts x %d samples, every %d steps",
            len(store.evaluation.items),
            config.eval.samples_per_prompt,
            config.eval.every_steps,
        )
    endpoint = tcp(config.cluster.bind_address, config.cluster.buffer_port)
    service = BufferService(config, store, endpoint, run_dir)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, service.stopping.set)
        await service.serve_loop()

    uvloop.run(main())
