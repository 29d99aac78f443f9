"""The learner's side of the buffer: its batches, its eval rounds and results, its checkpoints.

The learner has at most one batch request pending; it is answered when the
store can form a batch, with the buffer's metrics, the batch's own episode figures
(``episode_*``, when it holds multi-turn episodes) and a finished eval round's
results riding along. Only the peer the last batch went to may hand it back
(``SaveBufferState.abandoned_batch_request``), and only once. A request for
eval results is held (:mod:`asyncrl.buffer.held`) until the running round
completes or its deadline passes. The learner's version may only move by one
per message (``bad_version``).
"""

from __future__ import annotations

import json
import logging
import math
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path

from asyncrl.buffer.durable import write_atomically
from asyncrl.buffer.held import HeldRequests, HeldResultsRequest
from asyncrl.buffer.metrics import episode_metrics
from asyncrl.buffer.store import BufferStore
from asyncrl.core.messages import (
    Ack,
    BatchRequest,
    EvalResults,
    EvalResultsRequest,
    SaveBufferState,
    StartEval,
    Trajectories,
    WireError,
)
from asyncrl.core.paths import BUFFER_STATE, checkpoint_dir
from asyncrl.core.trajectory import join_samples

log = logging.getLogger("asyncrl.buffer")

Reply = Callable[..., Awaitable[bool]]
"""``reply(identity, body, arrays=None)``: False when the peer could not be sent it."""


class LearnerDesk:
    """Serves the learner's messages (``BatchRequest``, ``StartEval``,
    ``EvalResultsRequest``, ``SaveBufferState``) and delivers what it waits for."""

    def __init__(
        self,
        store: BufferStore,
        held: HeldRequests,
        reply: Reply,
        batch_stats: Callable[[], dict[str, float]],
        run_dir: Path | None,
        counters: Counter[str],
    ):
        self.store = store
        self.held = held
        self.reply = reply
        self.batch_stats = batch_stats
        """The metrics a batch carries, taken when it is sent."""
        self.run_dir = run_dir
        """Where checkpoints go; without one, SaveBufferState is refused."""
        self.pending_batch: bytes | None = None
        """Identity of the learner waiting for a batch, if any."""
        self.last_served_to: bytes | None = None
        """The peer the last batch went to: only it may hand that batch back."""
        self.batch_taken_back = False
        """The last batch served was handed back already (it goes back once)."""
        self.counters = counters
        """The service's: ``abandon_noops`` counts hand-backs with nothing to hand back."""

    async def on_batch_request(self, identity: bytes, body: BatchRequest, _, now: float) -> None:
        self._check_version("BatchRequest.policy_version", body.policy_version)
        self.store.set_policy_version(body.policy_version)
        self.pending_batch = identity
        await self.serve_pending()

    async def on_start_eval(self, identity: bytes, body: StartEval, _, now: float) -> None:
        self._check_eval_enabled()
        number, version = body.round, body.policy_version
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
        await self.reply(identity, Ack(accepted=int(started)))

    async def on_eval_results_request(
        self, identity: bytes, body: EvalResultsRequest, _, now: float
    ) -> None:
        self._check_eval_enabled()
        await self.serve_results(math.inf)  # an earlier one: the newer one counts
        self.held.hold_results(HeldResultsRequest(identity, now + body.wait_s))
        await self.serve_results(now)

    async def on_save_buffer_state(
        self, identity: bytes, body: SaveBufferState, _, now: float
    ) -> None:
        if self.run_dir is None:
            raise WireError("unexpected_type", "this buffer has no run directory to save into")
        step, version = body.step, self.store.policy_version
        if not 0 <= step <= version + 1:
            raise WireError(
                "bad_step",
                f"SaveBufferState.step {step}: the learner at version {version} "
                f"checkpoints a step in [0, {version + 1}]",
            )
        if body.abandoned_batch_request:
            self._take_back_batch(identity)
        self._save_state(self.run_dir, step)
        await self.reply(identity, Ack(accepted=1))

    def _check_version(self, field: str, version: int) -> None:
        """The learner's version moves by at most one per message: ``version`` is the
        current one or the next (``bad_version``, and the store is not touched)."""
        current = self.store.policy_version
        if not current <= version <= current + 1:
            raise WireError("bad_version", f"{field} {version}: the buffer is at version {current}")

    def _check_eval_enabled(self) -> None:
        if not self.store.evaluation.enabled:
            raise WireError("bad_field", "this run has no eval prompts (eval is off)")

    async def serve_pending(self) -> None:
        """Answer the pending batch request if the store can form a batch."""
        if self.pending_batch is None:
            return
        batch = self.store.take_batch()
        if batch is None:
            return
        metas, arrays = join_samples(batch)
        stats = self.batch_stats() | episode_metrics(metas)  # turns and tools, with episodes
        stats |= self.store.batch_eval_results  # a finished round's, once
        learner, self.pending_batch = self.pending_batch, None
        if await self.reply(learner, Trajectories(metas, stats), arrays):
            self.last_served_to, self.batch_taken_back = learner, False
        else:  # the learner is gone or not reading: the batch is not lost
            self.store.return_last_batch()
            self.last_served_to, self.batch_taken_back = None, True

    async def serve_results(self, now: float) -> None:
        """Answer the held request for eval results once it can be (results wait, or no
        round runs) or at its deadline, with every finished round's results not handed
        over yet."""
        evaluation = self.store.evaluation
        held = self.held.take_results(now, evaluation.results_ready())
        if held is None:
            return
        reply = EvalResults(evaluation.take_results(), evaluation.running_round)
        if not await self.reply(held.identity, reply):
            for results in reversed(reply.results):  # not delivered: keep them for a batch
                evaluation.give_back(results)

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

    def _save_state(self, run_dir: Path, step: int) -> None:
        path = checkpoint_dir(run_dir, step) / BUFFER_STATE
        path.parent.mkdir(parents=True, exist_ok=True)
        state = self.store.durable_state()
        write_atomically(path, json.dumps(state))
        log.info(
            "saved buffer state for step %d: cursor %d, %d unfinished groups, %d prompts skipped",
            step,
            state["cursor"],
            len(state["unfinished_groups"]),
            len(state["skipped_groups"]),
        )
