"""Rank 0's line to the buffer: batches, eval rounds and the buffer's part of a checkpoint.

Every wait is stoppable (:func:`~asyncrl.core.waiting.wait_with_stop`): SIGTERM
(:class:`~asyncrl.core.stop_signals.StopSignals`) abandons a batch still awaited within
``STOP_POLL_S``, and cuts any other wait for the buffer to at most
``FINAL_SAVE_TIMEOUT_S``, so a dead buffer never holds a stopping learner.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import zmq

from asyncrl.core.messages import (
    Ack,
    AdapterPublished,
    BatchRequest,
    EvalResults,
    EvalResultsRequest,
    SaveBufferState,
    StartEval,
    Trajectories,
    WireError,
)
from asyncrl.core.transport import RequestClient
from asyncrl.core.waiting import Waited, wait_with_stop
from asyncrl.learner.batch import TrainBatch, collate

STOP_POLL_S = 0.2
"""While rank 0 waits for a batch, how often it checks whether it was asked to stop."""
FINAL_SAVE_TIMEOUT_S = 5.0
"""How long the checkpoint written on a stop waits for the buffer's part of it; also how
long any wait for the buffer lasts once a stop is asked (a dead buffer never holds it up)."""
START_EVAL_TIMEOUT_S = 30.0
"""How long starting an eval round waits for the buffer's answer (it answers at once)."""
ANNOUNCE_TIMEOUT_S = 30.0
"""How long announcing an adapter's digest waits for the buffer's answer (at once too)."""


class BufferStateNotSaved(RuntimeError):
    """The buffer did not save its part of a checkpoint: no answer in time, or a refusal."""


class BufferClient:
    """Rank 0's line to the buffer: batches (waiting however long generation takes)
    and the buffer's share of each checkpoint.

    Every wait for an answer checks ``stop`` (SIGTERM) every ``STOP_POLL_S``; once it
    is true, the wait lasts at most ``FINAL_SAVE_TIMEOUT_S`` more.
    """

    def __init__(
        self,
        context: zmq.Context,
        endpoint: str,
        pad_id: int,
        stop: Callable[[], bool] = lambda: False,
        device: torch.device | str = "cpu",
    ):
        self.client = RequestClient(context, endpoint, timeout_s=3600.0)
        self.pad_id = pad_id
        self.device = device
        """Where batches are padded: the learner's device, so a batch crosses to it once."""
        self.stop = stop
        self.abandoned = False
        """A batch request is out that this learner stopped waiting for."""
        self.unanswered = 0
        """Announcements a stop stopped waiting for: their answers, if any come, come
        before the next request's and are read past."""

    def next_batch(
        self, policy_version: int, stop: Callable[[], bool] = lambda: False
    ) -> tuple[TrainBatch, dict[str, float]] | None:
        """The next batch, or None once ``stop()`` is true and no batch has come.

        An abandoned request stays open at the buffer: :meth:`save_state` cancels
        it, or hands its batch back if the buffer answered it after all.
        """
        if stop():
            return None
        self.client.send(BatchRequest(policy_version))
        waited = self._wait(self.client.timeout_s, stop)
        if waited is Waited.STOPPED:
            self.abandoned = True
            return None
        if waited is Waited.TIMED_OUT:
            raise TimeoutError(
                f"no batch from {self.client.endpoint} within {self.client.timeout_s:g}s"
            )
        reply, arrays = self.client.receive(timeout_s=0)
        if not isinstance(reply, Trajectories):
            raise RuntimeError(f"buffer answered a batch request with {reply!r}")
        return collate(reply.samples, arrays, self.pad_id, self.device), reply.stats

    def announce_adapter(self, version: int, digest: str) -> bool:
        """Tell the buffer ``version``'s adapter digest (before the version is published).
        False when a stop cut the wait short: the version must not be published (the
        buffer could not vouch for its samples), and the stopping learner need not."""
        request = AdapterPublished(version, digest)
        self.client.send(request)
        try:
            reply, _ = self.reply_within(ANNOUNCE_TIMEOUT_S)
        except TimeoutError:
            if not self.stop():
                raise
            self.unanswered += 1  # a late answer comes before the next request's
            return False
        if not isinstance(reply, Ack):
            raise RuntimeError(f"buffer answered {request!r} with {reply!r}")
        return True

    def start_eval(self, number: int, policy_version: int) -> bool:
        """Start eval round ``number`` of ``policy_version``; False if the buffer did not
        (an earlier round is still running: skipped and counted there)."""
        request = StartEval(round=number, policy_version=policy_version)
        self.client.send(request)
        reply, _ = self.reply_within(START_EVAL_TIMEOUT_S)
        if not isinstance(reply, Ack):
            raise RuntimeError(f"buffer answered {request!r} with {reply!r}")
        return bool(reply.accepted)

    def eval_results(self, wait_s: float, stop: Callable[[], bool]) -> EvalResults | None:
        """Eval results no batch carried; the buffer holds the request up to ``wait_s``
        while a round runs. None once ``stop()`` is true first (the learner is exiting)."""
        self.client.send(EvalResultsRequest(wait_s=wait_s))
        limit_s = wait_s + START_EVAL_TIMEOUT_S
        waited = self._wait(limit_s, stop)
        if waited is Waited.STOPPED:
            return None
        if waited is Waited.TIMED_OUT:
            raise TimeoutError(f"no eval results from {self.client.endpoint} within {limit_s:g}s")
        reply, _ = self.client.receive(timeout_s=0)
        if not isinstance(reply, EvalResults):
            raise RuntimeError(f"buffer answered a request for eval results with {reply!r}")
        return reply

    def save_state(self, step: int, timeout_s: float | None = None) -> None:
        """Have the buffer write its part of checkpoint ``step``; BufferStateNotSaved if
        it refuses or does not answer within ``timeout_s`` (default: the client's)."""
        request = SaveBufferState(step, abandoned_batch_request=self.abandoned)
        limit_s = self.client.timeout_s if timeout_s is None else timeout_s
        try:
            self.client.send(request)
            for _ in range(self.unanswered):  # answers to announcements given up on
                self.reply_within(limit_s)
            self.unanswered = 0
            reply, _ = self.reply_within(limit_s)
            if self.abandoned and isinstance(reply, Trajectories):
                # the abandoned request's answer, sent before the buffer read this one,
                # which handed that batch back: untrained, it stays in the saved state
                reply, _ = self.reply_within(limit_s)
        except (TimeoutError, WireError, zmq.ZMQError) as error:
            raise BufferStateNotSaved(f"the buffer did not save its part ({error})") from error
        self.abandoned = False
        if not isinstance(reply, Ack):
            raise BufferStateNotSaved(f"the buffer refused to save its part: {reply!r}")

    def reply_within(self, timeout_s: float):
        """The answer to the request out, within ``timeout_s``, or within
        ``FINAL_SAVE_TIMEOUT_S`` of a stop, whichever ends first; TimeoutError if none."""
        waited = self._wait(timeout_s, self.stop, grace_s=FINAL_SAVE_TIMEOUT_S)
        if waited is not Waited.READY:
            cut = (
                f", cut to {FINAL_SAVE_TIMEOUT_S:g}s by a stop" if waited is Waited.STOPPED else ""
            )
            raise TimeoutError(f"no reply from {self.client.endpoint} within {timeout_s:g}s{cut}")
        return self.client.receive(timeout_s=0)

    def _wait(self, timeout_s: float, stop: Callable[[], bool], grace_s: float = 0.0) -> Waited:
        """Wait for the answer to the request out (read it with ``client.receive`` once
        READY), checking ``stop`` every ``STOP_POLL_S``."""
        return wait_with_stop(self._answered, timeout_s, stop, STOP_POLL_S, grace_s)

    def _answered(self, within_s: float) -> bool:
        return bool(self.client.socket.poll(int(within_s * 1000)))
