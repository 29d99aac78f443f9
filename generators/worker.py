"""A generator replica: ask for prompts, generate in chunks, stream trajectories.

::

    buffer ──WorkGrant──▶ replica ──chunk──▶ chunk ──▶ ... ──Trajectories──▶ buffer
                             ▲ between chunks: newer weights from the learner?

The loop keeps up to ``max_active_samples`` rollouts going. Between chunks it
tops them up with new work and loads the newest published weights, so a long
generation never blocks an update and an update never discards a half-made
sample: its earlier tokens keep the version and log-probs they were made with
(partial rollouts). Each finished sample is scored and sent at the end of the
chunk in which it finished. Liveness is not the loop's job: a thread of its own
(:mod:`asyncrl.generators.liveness`) sends a ``Heartbeat`` every
``buffer.heartbeat_interval_s`` on its own socket, so a chunk, a prefill or a
weight load of any length never makes the buffer take a busy replica for a
dead one and requeue its groups.

A replica with nothing at all to do (no rollout, no episode waiting for its
environment, no reward being computed) lets the buffer hold its work request
for up to ``buffer.heartbeat_interval_s`` (``WorkRequest.wait_s``): the buffer
answers the moment work is admitted, so new prompts, and the weights fetched
just before the next chunk, follow a learner step without a poll interval.
It reports ``busy_s`` (generating and loading weights) and ``wall_s`` with its
trajectories, so the run's metrics show how busy the replicas are.

Prompts of a held-out eval round (``WorkItem.eval_round``, negative group ids)
are generated like any other, in chunks, across weight loads, one turn or a
multi-turn episode, scored by the same reward path, and sent back tagged with
their round (``TrajectoryMeta.eval_round``); the buffer keeps them out of training.

The process around the loop (policy, backend, joining the run, stop signals,
heartbeats) is :mod:`asyncrl.generators.main`.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, wait
from pathlib import Path

import msgspec
import numpy as np
import zmq

from asyncrl.config import Config
from asyncrl.core import progress
from asyncrl.core.message_limits import split_for_sending
from asyncrl.core.messages import (
    MAX_ADAPTER_DIGESTS,
    NOT_EVAL,
    Ack,
    Leave,
    Trajectories,
    TrajectoryMeta,
    WorkGrant,
    WorkRequest,
)
from asyncrl.core.trajectory import build_columns
from asyncrl.core.transport import RequestClient
from asyncrl.core.waiting import Waited, wait_with_stop
from asyncrl.generation.rewards import RewardScorer, Score
from asyncrl.generators.backend import Backend, Rollout
from asyncrl.generators.episodes import Episodes
from asyncrl.generators.weight_sync import WeightSync
from asyncrl.weights import WeightClient
from asyncrl.weights.paths import replica_sources
from asyncrl.weights.source import WeightSource
from asyncrl.weights.zmq.source import ZmqSource

log = logging.getLogger("asyncrl.generator")

LEAVE_TIMEOUT_S = 2.0
"""How long a stopping replica waits for the buffer to acknowledge that it leaves."""
SCORE_WAIT_S = 0.005
"""How long ``send`` waits for the scores it just asked for; later ones go with a later send."""
STOP_POLL_S = 0.1
"""How often a replica whose work request the buffer holds checks whether it should stop."""


def waiting_for_weights() -> None:
    """A weight fetch the learner has not answered for a second: the learner's stall, not
    this replica's (the watchdog then blames the learner instead of restarting us)."""
    progress.beat("waiting for weights from the learner", advanced=False, waiting_for="learner")


class BufferReply:
    """A ``ready`` for :func:`~asyncrl.core.waiting.wait_with_stop` that receives the buffer's
    answer in slices. A receive that times out has blocked for its whole slice, so the
    slices asked for are the time waited: :meth:`waited` is the wait's clock."""

    def __init__(self, buffer: RequestClient) -> None:
        self.buffer = buffer
        self.value: tuple | None = None
        """``(reply, arrays)``, once :meth:`receive` said True."""
        self.waited_s = 0.0

    def receive(self, within_s: float) -> bool:
        try:
            self.value = self.buffer.receive(timeout_s=within_s)
        except TimeoutError:
            self.waited_s += within_s
            return False
        return True

    def waited(self) -> float:
        return self.waited_s


class GeneratorReplica:
    def __init__(
        self,
        config: Config,
        generator_id: str,
        backend: Backend,
        context: zmq.Context,
        pool: str,
        buffer: RequestClient,
        weights_endpoint: str,
        incarnation: int = 0,
        *,
        run_dir: Path | None = None,
        collective: WeightSource | None = None,
    ):
        """``run_dir``: the learner's, where a replica on its host finds the shared-memory
        weights; ``collective``: the broadcast path's source, when one is configured."""
        self.config = config
        self.generator_id = generator_id
        self.incarnation = incarnation
        """This process's incarnation, sent with every message (``new_incarnation``)."""
        self.pool = pool
        self.backend = backend
        self.buffer = buffer
        self.zmq_source = ZmqSource(
            WeightClient(context, weights_endpoint, on_wait=waiting_for_weights)
        )
        self.weight_sync = WeightSync(
            replica_sources(config, run_dir, self.zmq_source, collective),
            config.weights.deadline_s,
            generator_id,
        )
        self.active: list[Rollout] = []
        self.stopping = False
        self.unanswered = 0
        """Trajectories messages sent whose Ack is not read yet: read before the reply to
        the next request (the buffer answers a peer's messages in order), so handing in
        samples costs no round trip of its own."""
        self.weights_checked = False
        """Newer weights were looked for in this turn of the loop (while the buffer was
        answering a work request)."""
        self.stats = {"samples_sent": 0, "weight_swaps": 0, "weight_swap_latency_s": 0.0}
        self.stats["weight_load_s"] = 0.0
        self.stats["reward_errors"] = 0
        self.stats["eval_samples_sent"] = 0
        self.stats["busy_s"] = 0.0  # generating chunks, fetching and loading weights
        self.stats["wall_s"] = 0.0  # since run_loop started, as of the latest send
        self.stats["chunks"] = 0
        self.stats["chunk_s_max"] = 0.0  # the longest engine call: liveness must not mind it
        self.started_at = time.monotonic()
        self.scorer = RewardScorer.from_config(config.reward)
        """Scores finished samples in worker processes, off this loop
        (asyncrl.generation.rewards)."""
        self.scoring: list[tuple[Rollout, Future]] = []
        """Finished samples waiting for their reward."""
        self.extra_info: dict[int, list] = {}
        """group_id -> [its WorkItem's extra_info, samples not yet scored], when not empty."""
        self.served_adapters: dict[int, str] = {}
        """Version -> digest of the LoRA adapter the engine held for it (adapters published
        alone: ``backend.adapter_digest``), reported with the samples of those versions."""
        self._note_adapter()
        self.eval_rounds: dict[int, int] = {}
        """Eval group id -> the round it was last handed out in (at most one entry per
        eval prompt; training group ids are never negative, so never here)."""
        self.episodes: Episodes | None = None
        """Multi-turn episodes, when ``environment`` is configured: the environment gives
        their reward, its named reward function scored by this replica's ``scorer``."""
        if config.environment is not None:
            self.episodes = Episodes(
                config.environment,
                backend.tokenizer,
                config.generators.max_new_tokens,
                scorer=self.scorer,
                max_prompt_tokens=config.data.max_prompt_tokens,
            )

    @property
    def weights(self):
        """The ZeroMQ client (the path every chain ends with)."""
        return self.zmq_source.client

    @weights.setter
    def weights(self, client) -> None:
        self.zmq_source.client = client

    def run_loop(self) -> None:
        retry_after = 0.0
        self.started_at = time.monotonic()
        while not self.stopping:
            self.weights_checked = False
            retry_after = self.top_up()
            if retry_after is None:  # stopping; only Leave may follow the request left open
                break
            self.collect_episodes()
            if not self.active:
                stepping = self.episodes is not None and self.episodes.waiting
                pause_s = 0.005 if stepping else max(retry_after, 0.01)
                if self.scoring:  # wait for the rewards, not out the pause: samples go at once
                    self.send([], wait_s=pause_s)
                else:
                    time.sleep(pause_s)
                progress.beat("waiting for work", detail=self._progress_detail)  # a turn
                continue
            busy_from = time.monotonic()
            if not self.weights_checked:
                self.sync_weights()
            chunk_from = time.monotonic()
            self.backend.generate_chunk(self.active, self.config.generators.chunk_tokens)
            chunk_s = time.monotonic() - chunk_from
            self.stats["chunks"] += 1
            self.stats["chunk_s_max"] = max(self.stats["chunk_s_max"], chunk_s)
            self.stats["busy_s"] += time.monotonic() - busy_from
            ended = [r for r in self.active if r.finished]
            self.active = [r for r in self.active if not r.finished]
            finished = []
            for rollout in ended:
                if self.episodes is not None and self.episodes.owns(rollout):
                    self.episodes.end_turn(rollout)  # a turn ended, maybe not the episode
                else:
                    finished.append(rollout)
            if finished or self.scoring:
                self.send(finished)
            progress.beat("generating", detail=self._progress_detail)  # a chunk made

    def _progress_detail(self) -> str:
        return f"{len(self.active)} rollouts, {self.stats['samples_sent']} samples sent"

    def collect_episodes(self) -> None:
        """Episodes the environment has answered go back to generation or out as samples."""
        if self.episodes is None:
            return
        continuing, finished = self.episodes.collect()
        self.active += continuing
        for rollout, score in finished:
            scored: Future = Future()
            scored.set_result(score)
            self.scoring.append((rollout, scored))
        self.stats.update({f"env_{key}": value for key, value in self.episodes.stats.items()})

    def close(self) -> None:
        """Leave the run, then stop the reward workers and the environments' threads."""
        self.leave()
        self.weight_sync.close()
        self.scorer.close()
        if self.episodes is not None:
            self.episodes.close()

    def leave(self) -> None:
        """Tell the buffer this replica stops, so its unfinished groups are requeued now."""
        try:
            reply, _ = self.buffer.request(
                Leave(self.generator_id, self.incarnation), timeout_s=LEAVE_TIMEOUT_S
            )
            # answers to what was sent before Leave: a held work request's, samples' Acks
            owed = self.unanswered
            while isinstance(reply, WorkGrant) or (owed and isinstance(reply, Ack)):
                owed -= isinstance(reply, Ack)
                reply, _ = self.buffer.receive(LEAVE_TIMEOUT_S)
            self.unanswered = 0
        except (TimeoutError, zmq.ZMQError) as error:  # the buffer is gone: nothing to tell
            log.info("could not say goodbye to the buffer: %s", error)
            return
        if isinstance(reply, Ack):
            log.info("left the run; %d unfinished group(s) handed back", reply.accepted)
        else:
            log.warning("the buffer answered Leave with %r", reply)

    def top_up(self) -> float | None:
        """Ask the buffer for as many samples as there is room for; returns its retry hint,
        or None when asked to stop while the buffer held the request."""
        room = self.config.generators.max_active_samples - len(self.active)
        if self.episodes is not None:
            room -= self.episodes.waiting
        if room < self.config.algorithm.group_size:
            return 0.0
        grant = self.ask_for_work(room)
        if grant is None:
            return None
        now = time.time()
        for item in grant.items:
            if item.eval_round != NOT_EVAL:
                self.eval_rounds[item.group_id] = item.eval_round
            if self.episodes is not None:
                for index in range(item.num_samples):
                    rollout = self.episodes.start(item, index, now)
                    if not rollout.finished:
                        self.active.append(rollout)
                continue
            if item.extra_info:
                self.extra_info[item.group_id] = [item.extra_info, item.num_samples]
            for index in range(item.num_samples):
                self.active.append(
                    Rollout(
                        item.group_id,
                        index,
                        list(item.prompt_ids),
                        item.ground_truth,
                        item.data_source,
                        started_at=now,
                    )
                )
        return grant.retry_after_s

    def idle(self) -> bool:
        """Nothing generating, waiting for an environment or being scored: a replica that
        blocks at the buffer now delays nothing of its own."""
        stepping = self.episodes is not None and self.episodes.waiting
        return not (self.active or self.scoring or stepping)

    def ask_for_work(self, room: int) -> WorkGrant | None:
        """The buffer's answer to a WorkRequest for ``room`` samples, or None if asked to stop.

        An idle replica lets the buffer hold the request until work is admitted, for
        up to ``buffer.heartbeat_interval_s``, and checks every ``STOP_POLL_S``
        whether it should stop. A request given up
        that way is answered anyway, when the replica says ``Leave``.
        """
        if not self.idle():
            self.buffer.send(WorkRequest(self.generator_id, room, incarnation=self.incarnation))
            # the weight check's round trip overlaps the buffer's: across a link with latency,
            # one round trip per turn of the loop instead of three
            if not self.stopping:
                busy_from = time.monotonic()
                self.sync_weights()
                self.stats["busy_s"] += time.monotonic() - busy_from
                self.weights_checked = True
            grant, _ = self.reply()
            assert isinstance(grant, WorkGrant), grant
            return grant
        self.read_acks()  # nothing else may answer the held request
        wait_s = self.config.buffer.heartbeat_interval_s
        self.buffer.send(WorkRequest(self.generator_id, room, wait_s, self.incarnation))
        reply = BufferReply(self.buffer)
        waited = wait_with_stop(
            reply.receive, wait_s + self.buffer.timeout_s, self.is_stopping, STOP_POLL_S,
            clock=reply.waited,
        )  # fmt: skip
        if waited is Waited.STOPPED:
            return None
        if waited is Waited.TIMED_OUT:
            raise TimeoutError(
                f"no answer from {self.buffer.endpoint} within "
                f"{wait_s + self.buffer.timeout_s:.0f}s of a held work request"
            )
        grant, _ = reply.value
        assert isinstance(grant, WorkGrant), grant
        return grant

    def is_stopping(self) -> bool:
        return self.stopping

    def reply(self) -> tuple:
        """The buffer's answer to the request just sent, after the Acks of the samples sent
        before it. Once stopping, the replica waits for each at most ``LEAVE_TIMEOUT_S``
        more: a dead buffer (its launcher killed) must not hold the replica and its reward
        workers for the client's whole ``timeout_s``."""
        self.read_acks()
        return self._next_reply()

    def read_acks(self) -> None:
        """Read the Acks of the Trajectories messages sent without waiting for them."""
        while self.unanswered:
            ack, _ = self._next_reply()
            assert isinstance(ack, Ack), ack
            self.unanswered -= 1

    def _next_reply(self) -> tuple:
        reply = BufferReply(self.buffer)
        patience_s = LEAVE_TIMEOUT_S if self.stopping else self.buffer.timeout_s
        waited = wait_with_stop(
            reply.receive, patience_s, self.is_stopping, STOP_POLL_S, LEAVE_TIMEOUT_S,
            clock=reply.waited,
        )  # fmt: skip
        if waited is not Waited.READY:
            stopping = " while stopping" if waited is Waited.STOPPED else ""
            raise TimeoutError(
                f"no reply from {self.buffer.endpoint} within {reply.waited_s:.0f}s{stopping}"
            )
        return reply.value

    def sync_weights(self) -> None:
        """Load newer weights over the first path of the chain that works
        (:mod:`asyncrl.generators.weight_sync`); raises when every path failed."""
        try:
            loaded = self.weight_sync.sync(self.backend)
        finally:
            self.stats.update(self.weight_sync.stats())
        if loaded is None:
            return
        self._note_adapter()
        self.stats["weight_swaps"] += 1
        self.stats["weight_swap_latency_s"] = time.time() - loaded.published_at
        self.stats["weight_load_s"] = self.backend.last_load_s
        log.info(
            "loaded weights v%d over %s (%.3fs after publish; loading into the engine took %.3fs)",
            loaded.version,
            loaded.path,
            self.stats["weight_swap_latency_s"],
            self.backend.last_load_s,
        )

    def _note_adapter(self) -> None:
        """Record the digest of the adapter the engine holds for its version (read back
        from the engine, not taken from the path that delivered it)."""
        digest = getattr(self.backend, "adapter_digest", None)
        if digest is None:
            return
        self.served_adapters[self.backend.version] = digest
        while len(self.served_adapters) > MAX_ADAPTER_DIGESTS:
            del self.served_adapters[min(self.served_adapters)]

    def adapter_digests(self, rollouts: list[Rollout]) -> dict[int, str]:
        """The digests of the versions ``rollouts``' model tokens carry (those known)."""
        if not self.served_adapters:
            return {}
        versions = {v for r in rollouts for v in r.token_versions if v >= 0}
        return {v: self.served_adapters[v] for v in versions if v in self.served_adapters}

    def send(self, finished: list[Rollout], wait_s: float = SCORE_WAIT_S) -> None:
        """Ask for the rewards of ``finished``; send every sample whose reward is in after
        at most ``wait_s`` (sooner once all are), in messages that fit the buffer's frame cap
        (:func:`~asyncrl.core.message_limits.split_for_sending`)."""
        decode = self.backend.tokenizer.decode
        samples = []
        for r in finished:
            text = decode(r.response_ids, skip_special_tokens=True)
            extra = self.extra_info.get(r.group_id)
            if extra is not None:
                extra[1] -= 1
                if extra[1] <= 0:
                    del self.extra_info[r.group_id]
            samples.append((r.data_source, text, r.ground_truth, extra[0] if extra else {}))
        if samples:  # one batch for the reward workers, not a round trip per sample
            futures = self.scorer.submit_many(samples)
            self.scoring += zip(finished, futures, strict=True)
        wait([future for _, future in self.scoring], timeout=wait_s)
        done = [future.done() for _, future in self.scoring]
        scored = [pair for pair, ready in zip(self.scoring, done, strict=True) if ready]
        if not scored:
            return
        self.scoring = [pair for pair, ready in zip(self.scoring, done, strict=True) if not ready]
        rollouts = [r for r, _ in scored]
        scores = [future.result() for _, future in scored]
        lengths = [(len(r.prompt_ids), len(r.response_ids)) for r in rollouts]
        for part in split_for_sending(lengths):  # each message within the buffer's frame cap
            metas, arrays = self.package(rollouts[part], scores[part])
            # the replica's own counters ride along, so the run's metrics show them
            self.stats["wall_s"] = time.monotonic() - self.started_at
            stats = {key: float(value) for key, value in self.stats.items()}
            digests = self.adapter_digests(rollouts[part]) or msgspec.UNSET
            message = Trajectories(metas, stats, self.pool, self.incarnation, digests)
            self.buffer.send(message, arrays)
            self.unanswered += 1  # its Ack is read before the next request's reply
            self.stats["samples_sent"] += len(metas)

    def package(
        self, rollouts: list[Rollout], scores: list[Score]
    ) -> tuple[list[TrajectoryMeta], dict[str, np.ndarray]]:
        """Finished rollouts and their scores as one message's metas and token columns."""
        now = time.time()
        metas = []
        for r, (reward, error, _) in zip(rollouts, scores, strict=True):
            self.stats["reward_errors"] += error is not None
            eval_round = self.eval_rounds.get(r.group_id, NOT_EVAL)
            self.stats["eval_samples_sent"] += eval_round != NOT_EVAL
            metas.append(
                TrajectoryMeta(
                    r.group_id,
                    r.sample_index,
                    len(r.prompt_ids),
                    len(r.response_ids),
                    float(reward),
                    r.finish_reason or "length",
                    self.generator_id,
                    now - r.started_at,
                    reward_error=error or "",
                    eval_round=eval_round,
                    episode=msgspec.UNSET if r.episode is None else r.episode,
                )
            )
        return metas, build_columns(rollouts).to_wire()
