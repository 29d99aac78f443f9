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
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np
import uvloop
import zmq
import zmq.asyncio

from asyncrl.buffer.store import BufferStore, Sample
from asyncrl.config import Config
from asyncrl.messages import (
    Ack,
    BatchRequest,
    ErrorReply,
    Heartbeat,
    Join,
    Joined,
    Leave,
    SaveBufferState,
    Status,
    StatusRequest,
    Trajectories,
    TrajectoryMeta,
    WireError,
    WorkGrant,
    WorkItem,
    WorkRequest,
    decode,
    encode,
)
from asyncrl.paths import BUFFER_STATE, checkpoint_dir
from asyncrl.security import curve_keys, secure_server
from asyncrl.transport import tcp

log = logging.getLogger("asyncrl.buffer")

RETRY_AFTER_S = 0.05
"""How long a generator refused by admission control or back-pressure waits to ask again."""
POLL_MS = 100
"""Longest wait for a message before the loop checks for silent generators."""


class BufferService:
    def __init__(
        self, config: Config, store: BufferStore, endpoint: str, run_dir: Path | None = None
    ):
        self.config = config
        self.store = store
        self.endpoint = endpoint
        self.run_dir = run_dir
        """Where checkpoints go; without one, SaveBufferState is refused."""
        self.curve = curve_keys(config.cluster)
        """The run's CURVE keys when its connections use them (docs/security.md)."""
        self.context = zmq.asyncio.Context()
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.rejected: Counter[str] = Counter()
        self.pending_batch: bytes | None = None
        """Identity of the learner waiting for a batch, if any."""
        self.stopping = asyncio.Event()
        self.generator_stats: dict[str, dict[str, float]] = {}
        """Each generator's latest counters (weight swaps, latency, reward errors)."""
        self.generator_pools: dict[str, str] = {}

    async def serve_loop(self) -> None:
        """Serve until ``stopping`` is set, then close the socket and the context."""
        auth = secure_server(self.context, self.socket, self.curve) if self.curve else None
        try:
            await self._serve()
        finally:
            if auth is not None:
                auth.stop()  # before term(), which waits for the ZAP handler's sockets
        self.socket.close(linger=0)
        self.context.term()

    async def _serve(self) -> None:
        self.socket.bind(self.endpoint)
        log.info("buffer serving on %s", self.endpoint)
        while not self.stopping.is_set():
            ready = await self.socket.poll(POLL_MS)
            self._expire_silent_generators()
            if not ready:
                continue
            identity, *frames = await self.socket.recv_multipart(copy=False)
            try:
                body, arrays = decode(frames)
                await self._handle(identity.bytes, body, arrays)
            except WireError as error:
                self.rejected[error.reason] += 1
                log.warning("rejected message: %s", error)
                await self._reply(identity.bytes, ErrorReply(error.reason, str(error)))
            except AssertionError:  # a broken invariant of the store: stop, loudly
                raise
            except Exception as error:  # one bad message must not stop the service
                self.rejected["internal"] += 1
                log.exception("failed to handle a message")
                await self._reply(identity.bytes, ErrorReply("internal", repr(error)))

    def _expire_silent_generators(self) -> None:
        for generator_id in self.store.expire_silent(time.monotonic()):
            log.warning(
                "generator %s silent for over %.1fs: its unfinished groups are requeued",
                generator_id,
                self.store.heartbeat_timeout_s,
            )

    async def _handle(self, identity: bytes, body, arrays) -> None:
        now = time.monotonic()
        match body:
            case WorkRequest(generator_id=generator_id, max_samples=max_samples):
                items = self.store.dispatch(generator_id, max_samples, now)
                retry = 0.0 if items else RETRY_AFTER_S
                await self._reply(identity, WorkGrant(items, self.store.policy_version, retry))
            case Trajectories(samples=metas, stats=generator_stats, pool=pool):
                samples = split_samples(metas, {name: a.numpy() for name, a in arrays.items()})
                accepted = self.store.ingest(samples, now)
                if metas and generator_stats:
                    self.generator_stats[metas[0].generator_id] = generator_stats
                    self.generator_pools[metas[0].generator_id] = pool or "default"
                await self._reply(identity, Ack(accepted, len(samples) - accepted))
                await self._serve_pending()
            case Heartbeat(generator_id=generator_id):
                self.store.heartbeat(generator_id, now)
                await self._reply(identity, Ack(accepted=0))
            case Join(generator_id=generator_id, pool=pool):
                self.store.heartbeat(generator_id, now)
                self.generator_pools[generator_id] = pool
                log.info("generator %s (pool %s) joined", generator_id, pool)
                joined = Joined(
                    self.config.cluster.weights_port,
                    self.store.policy_version,
                    self.config.run.name,
                )
                await self._reply(identity, joined)
            case Leave(generator_id=generator_id):
                requeued = self.store.leave(generator_id)
                log.info(
                    "generator %s left; %d unfinished group(s) requeued", generator_id, requeued
                )
                await self._reply(identity, Ack(accepted=requeued))
            case StatusRequest():
                await self._reply(identity, self._status(now))
            case BatchRequest(policy_version=version):
                self.store.set_policy_version(version)
                self.pending_batch = identity
                await self._serve_pending()
            case SaveBufferState(step=step):
                self._save_state(step)
                await self._reply(identity, Ack(accepted=1))
            case _:
                raise WireError(
                    "unexpected_type", f"the buffer does not serve {type(body).__name__}"
                )

    def _status(self, now: float) -> Status:
        stats = self.store.stats(now) | generators_summary(self.generator_stats)
        generators = {
            generator_id: {"seen_s_ago": now - seen, **self.generator_stats.get(generator_id, {})}
            for generator_id, seen in self.store.last_seen.items()
        }
        return Status(self.store.policy_version, stats, generators, dict(self.generator_pools))

    def _save_state(self, step: int) -> None:
        if self.run_dir is None:
            raise WireError("unexpected_type", "this buffer has no run directory to save into")
        if step < 0:
            raise WireError("bad_field", f"SaveBufferState.step must be >= 0, got {step}")
        path = checkpoint_dir(self.run_dir, step) / BUFFER_STATE
        path.parent.mkdir(parents=True, exist_ok=True)
        state = self.store.durable_state()
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(state))
        tmp.replace(path)  # atomic: a reader never sees half a file
        log.info(
            "saved buffer state for step %d: cursor %d, %d unfinished groups",
            step,
            state["cursor"],
            len(state["unfinished_groups"]),
        )

    async def _serve_pending(self) -> None:
        if self.pending_batch is None:
            return
        batch = self.store.take_batch()
        if batch is None:
            return
        stats = self.store.stats(time.monotonic()) | {
            f"buffer_rejected_{k}": float(v) for k, v in self.rejected.items()
        }
        stats |= generators_summary(self.generator_stats)
        stats |= pools_summary(self.generator_stats, self.generator_pools)
        metas, arrays = join_samples(batch)
        await self._reply(self.pending_batch, Trajectories(metas, stats), arrays)
        self.pending_batch = None

    async def _reply(self, identity: bytes, body, arrays=None) -> None:
        try:
            await self.socket.send_multipart([identity, *encode(body, arrays)], copy=False)
        except zmq.ZMQError as error:  # the peer went away; its work is not lost here
            self.rejected["unroutable_reply"] += 1
            log.warning("could not reply to a peer: %s", error)


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


def split_samples(metas: list[TrajectoryMeta], arrays: dict[str, np.ndarray]) -> list[Sample]:
    """Cut concatenated token arrays back into samples; lengths must add up."""
    prompt_total = sum(m.prompt_len for m in metas)
    response_total = sum(m.response_len for m in metas)
    if arrays["prompt_ids"].size != prompt_total:
        raise WireError(
            "bad_array",
            f"prompt_ids has {arrays['prompt_ids'].size} tokens, metas say {prompt_total}",
        )
    for name in ("response_ids", "logprobs", "token_versions", "loss_mask"):
        if arrays[name].size != response_total:
            raise WireError(
                "bad_array", f"{name} has {arrays[name].size} tokens, metas say {response_total}"
            )
    samples, p, r = [], 0, 0
    for meta in metas:
        response = slice(r, r + meta.response_len)
        samples.append(
            Sample(
                meta,
                arrays["prompt_ids"][p : p + meta.prompt_len],
                arrays["response_ids"][response],
                arrays["logprobs"][response],
                arrays["token_versions"][response],
                arrays["loss_mask"][response],
            )
        )
        p += meta.prompt_len
        r += meta.response_len
    return samples


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


def build_store(config: Config, make_item: Callable[[int], WorkItem]) -> BufferStore:
    """The store a run's ``buffer`` section describes, handing out ``make_item(index)``."""
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
    )


def run(config: Config, run_dir: Path, resume_from: Path | None = None) -> None:
    """Serve until SIGTERM; with ``resume_from`` (a checkpoint), continue its dataset state."""
    from asyncrl.tasks import work_item_factory

    store = build_store(config, work_item_factory(config))
    if resume_from is not None:
        state = json.loads((resume_from / BUFFER_STATE).read_text())
        store.restore(state)
        log.info(
            "resumed from %s: cursor %d, %d unfinished groups handed out first",
            resume_from,
            store.cursor,
            len(store.requeue),
        )
    endpoint = tcp(config.cluster.bind_address, config.cluster.buffer_port)
    service = BufferService(config, store, endpoint, run_dir)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, service.stopping.set)
        await service.serve_loop()

    uvloop.run(main())
