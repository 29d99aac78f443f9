"""What serving weights over ZeroMQ may cost the learner, whoever the peers are.

Each limit below bounds the server's time or memory per peer or in all
(docs/security.md, "What the weights server accepts"); :mod:`.server`
applies the socket options and request checks, :mod:`.peers` the per-peer
flow control. Rejections are counted and logged at most once per
``REJECTION_LOG_INTERVAL_S`` per reason (:class:`RateLimitedLog`).
"""

from __future__ import annotations

from asyncrl.core.connection_guard import RateLimitedLog as RateLimitedLog  # the server's too
from asyncrl.core.message_limits import GuardLimits, unauthenticated_limit
from asyncrl.core.security import GENERATOR

REQUEST_MAX_BYTES = 4 << 10
"""The largest request the server decodes: requests are one header frame of tens of
bytes; anything bigger is refused on its size alone (``rejected_oversized``)."""
FRAME_MAX_BYTES = 64 << 10
"""libzmq drops a peer that sends a frame larger than this (``ZMQ_MAXMSGSIZE``), before
buffering it, handshake commands included; between ``REQUEST_MAX_BYTES`` and this a
request is refused and counted."""
HELD_BYTES = 256 << 10
"""Bytes one connection may have sent that the server thread has not received: a client
keeps at most ``MAX_WINDOW`` requests of tens of bytes in flight; beyond (a message of
endless frames) the connection is shut (:mod:`asyncrl.core.connection_guard`)."""
OTHER_PEERS = 2
"""Connections beside the replicas' (a benchmark's or a test's reader), with room to spare."""
SEND_HWM = 32
"""Replies queued per peer (``ZMQ_SNDHWM``). Sends never block: with ``ROUTER_MANDATORY``
and ``NOBLOCK`` a reply to a peer with no room, or gone, fails at once and is dropped and
counted (``replies_dropped_peer_full``, ``replies_dropped_peer_gone``)."""
RECEIVE_HWM = 64
"""Requests queued per peer before libzmq stops reading from it (``ZMQ_RCVHWM``)."""
MAX_WINDOW = 4
"""The most chunk requests a :class:`WeightClient` keeps in flight (2 by default)."""
PEER_MAX_CHUNKS = 2 * MAX_WINDOW
"""Chunk replies a peer may have that libzmq still holds, all of one version. Twice the
widest window: a tracker says done a little after the reply left (pyzmq's garbage
thread sets it), so a reading client's replies lag behind its requests."""
PEER_MAX_WAITING = 2 * MAX_WINDOW
"""Chunk requests of one peer held back until its earlier replies drain; beyond:
``rejected_peer_busy``, which a client keeping at most ``MAX_WINDOW`` never meets."""
MAX_PEERS_SERVED = 16
"""Peers with chunk replies in flight at once; the others' requests wait their turn."""
MAX_PEERS_WAITING = 256
"""Peers whose chunk requests may wait at once; beyond: ``rejected_busy``."""
SERVED_ROLES = frozenset({GENERATOR})
"""Roles served weights when authentication is on: generators load them; the learner
publishes them and observers (``asyncrl status``) have no use for them."""
HEARTBEAT_INTERVAL_S = 5.0
HEARTBEAT_TIMEOUT_S = 60.0
"""The server PINGs each peer every ``HEARTBEAT_INTERVAL_S`` and drops one that sends
nothing for ``HEARTBEAT_TIMEOUT_S`` after a PING (ZMTP heartbeats, answered by the peer's
libzmq whatever its application does). A peer that stopped reading cannot answer, so
dropping it releases the chunk replies it pinned and its place among the served peers."""
REJECTION_LOG_INTERVAL_S = 60.0
"""At most one log line per rejection reason per interval, with the count since."""


def guard_limits(replicas: int) -> GuardLimits:
    """The weights server's connection limits for a run of ``replicas`` generator replicas
    (each connects once): frames, bytes held per connection, connections in handshake."""
    return GuardLimits(
        frame_bytes=FRAME_MAX_BYTES,
        held_bytes=HELD_BYTES,
        unauthenticated=unauthenticated_limit(replicas, 1, OTHER_PEERS),
    )
