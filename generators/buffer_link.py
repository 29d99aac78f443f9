"""A generator replica's conversation with the buffer, kept to one round trip per turn
of its loop.

The buffer answers a peer's messages in order, so the replica never waits for the Ack
of the samples it hands in: it counts them (``unanswered``) and reads them just before
the reply to its next request. A replica with nothing to do lets the buffer hold its
``WorkRequest`` (``wait_s``) and looks every ``STOP_POLL_S`` whether it should stop; a
request given up that way is answered anyway, when the replica says ``Leave``. Once
stopping, no reply is waited for longer than ``LEAVE_TIMEOUT_S``: a dead buffer (its
launcher killed) must not hold the replica and its reward workers for the client's
whole ``timeout_s``. The loop that decides what to ask is
:class:`~asyncrl.generators.worker.GeneratorReplica`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import zmq

from asyncrl.core.messages import Ack, Leave, Trajectories, WorkGrant, WorkRequest
from asyncrl.core.transport import RequestClient
from asyncrl.core.waiting import Waited, wait_with_stop

log = logging.getLogger("asyncrl.generator")

LEAVE_TIMEOUT_S = 2.0
"""How long a stopping replica waits for the buffer to acknowledge that it leaves."""
STOP_POLL_S = 0.1
"""How often a replica whose work request the buffer holds checks whether it should stop."""


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


class BufferLink:
    """The messages one replica sends the buffer, and the order their answers come in."""

    def __init__(
        self,
        buffer: RequestClient,
        generator_id: str,
        incarnation: int,
        is_stopping: Callable[[], bool],
    ):
        """``is_stopping``: whether the replica was told to stop (checked while waiting)."""
        self.buffer = buffer
        self.generator_id = generator_id
        self.incarnation = incarnation
        self.is_stopping = is_stopping
        self.unanswered = 0
        """Trajectories messages sent whose Ack is not read yet: read before the reply to
        the next request, so handing in samples costs no round trip of its own."""

    def hand_in(self, message: Trajectories, arrays: dict[str, np.ndarray]) -> None:
        """Send finished samples; their Ack is read before the next request's reply."""
        self.buffer.send(message, arrays)
        self.unanswered += 1

    def ask(self, room: int) -> None:
        """Send a WorkRequest for ``room`` samples to be answered at once; read the answer
        with :meth:`grant` (the caller may do something else while the buffer answers)."""
        self.buffer.send(WorkRequest(self.generator_id, room, incarnation=self.incarnation))

    def grant(self) -> WorkGrant:
        """The answer to :meth:`ask`, after the Acks of the samples sent before it."""
        self.read_acks()
        grant, _ = self._next_reply()
        assert isinstance(grant, WorkGrant), grant
        return grant

    def wait_for_work(self, room: int, wait_s: float) -> WorkGrant | None:
        """A WorkRequest the buffer may hold for up to ``wait_s`` until work is admitted;
        its answer, or None if the replica was told to stop while it waited."""
        self.read_acks()  # nothing else may answer the held request
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
        assert reply.value is not None
        grant, _ = reply.value
        assert isinstance(grant, WorkGrant), grant
        return grant

    def read_acks(self) -> None:
        """Read the Acks of the Trajectories messages sent without waiting for them."""
        while self.unanswered:
            ack, _ = self._next_reply()
            assert isinstance(ack, Ack), ack
            self.unanswered -= 1

    def _next_reply(self) -> tuple:
        reply = BufferReply(self.buffer)
        patience_s = LEAVE_TIMEOUT_S if self.is_stopping() else self.buffer.timeout_s
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
