"""A replica's heartbeat, sent from its own thread so that liveness never depends on
how long the work takes.

The generation loop can be inside one engine call for a long time: a 60-second
chunk, a long prefill, a weight load, an engine start. If the buffer heard from
a replica only between chunks, a slow chunk would look like a death: its groups
would be requeued and its finished samples dropped as late. This thread speaks
for the process on its own socket every ``buffer.heartbeat_interval_s``,
whatever the loop is doing. A replica that is really gone still falls silent at
once: a killed process has no threads, and a SIGSTOPped one stops them all, so
the buffer still finds it within ``buffer.heartbeat_timeout_s``.

torch's kernels release the GIL, so the thread gets to run during a chunk; a
replica that holds the GIL for longer than the timeout would still be presumed
dead (no engine here does).
"""

from __future__ import annotations

import logging
import threading
import time

import zmq

from asyncrl.core.messages import Ack, Heartbeat
from asyncrl.core.transport import RequestClient

log = logging.getLogger("asyncrl.generator")

POLL_S = 0.1
"""How often a heartbeat waiting for its answer checks whether it should stop."""


class HeartbeatThread:
    """Sends ``Heartbeat(generator_id, incarnation)`` every ``interval_s`` until ``stop``."""

    def __init__(
        self,
        context: zmq.Context,
        endpoint: str,
        generator_id: str,
        interval_s: float,
        reply_timeout_s: float,
        incarnation: int = 0,
    ):
        self.context = context
        self.endpoint = endpoint
        self.generator_id = generator_id
        self.incarnation = incarnation
        """The replica process's incarnation: the buffer takes no heartbeat without it."""
        self.interval_s = interval_s
        self.reply_timeout_s = reply_timeout_s
        self.sent = 0
        """Heartbeats the buffer acknowledged."""
        self.missed = 0
        """Heartbeats that got no acknowledgement in time (the buffer busy or gone)."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)

    def start(self) -> HeartbeatThread:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop sending; returns within about ``POLL_S`` (the thread closes its socket)."""
        self._stop.set()
        self._thread.join(timeout=10 * POLL_S)

    def _run(self) -> None:
        client = RequestClient(self.context, self.endpoint, timeout_s=self.reply_timeout_s)
        try:
            while not self._stop.wait(self.interval_s):
                reply = self._beat(client)
                if reply is None and self._stop.is_set():
                    return
                if reply is None:
                    # a late Ack would answer the next heartbeat: start on a fresh socket
                    client.close()
                    client = RequestClient(
                        self.context, self.endpoint, timeout_s=self.reply_timeout_s
                    )
                elif isinstance(reply, Ack):
                    self.sent += 1
                else:
                    log.warning("the buffer answered a heartbeat with %r", reply)
        except zmq.ZMQError as error:  # the process is going down
            log.info("heartbeats stop: %s", error)
        finally:
            client.close()

    def _beat(self, client: RequestClient):
        """One heartbeat's reply; None if none came in time or ``stop`` was called."""
        client.send(Heartbeat(self.generator_id, self.incarnation))
        give_up = time.monotonic() + self.reply_timeout_s
        while not self._stop.is_set():
            try:
                reply, _ = client.receive(timeout_s=POLL_S)
                return reply
            except TimeoutError:
                if time.monotonic() > give_up:
                    self.missed += 1
                    log.warning(
                        "no answer to a heartbeat from %s in %.1fs (%d missed so far)",
                        self.endpoint,
                        self.reply_timeout_s,
                        self.missed,
                    )
                    return None
        return None
