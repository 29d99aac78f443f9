"""Per-peer flow control of chunk requests: a peer that never reads pins little.

A peer has at most ``PEER_MAX_CHUNKS`` chunk replies that libzmq still holds
(queued or being written; known from a tracked frame), all of one version, and
at most ``MAX_PEERS_SERVED`` peers have any: further chunk requests wait here,
up to ``PEER_MAX_WAITING`` per peer and ``MAX_PEERS_WAITING`` peers, and are
served as replies drain; beyond that they are refused (``peer_busy``,
``busy``). Every step costs O(PEER_MAX_CHUNKS + MAX_PEERS_SERVED), never
O(peers).
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable

import zmq

from asyncrl.core.messages import WeightsChunkRequest
from asyncrl.weights.zmq.limits import (
    MAX_PEERS_SERVED,
    MAX_PEERS_WAITING,
    PEER_MAX_CHUNKS,
    PEER_MAX_WAITING,
)

SendChunk = Callable[[bytes, WeightsChunkRequest], zmq.MessageTracker | None]
"""Sends one chunk reply; the tracker of its last frame, None when nothing was queued."""
Reject = Callable[[bytes, str, str], None]
"""Refuses a request: ``(peer, reason, detail)``."""


class Peer:
    """What the server holds for one peer: its chunk replies in flight, its waiting requests."""

    __slots__ = ("in_flight", "version", "waiting")

    def __init__(self) -> None:
        self.in_flight: list[zmq.MessageTracker] = []  # last frame of each reply libzmq holds
        self.version = -1  # the version of those replies
        self.waiting: deque[WeightsChunkRequest] = deque()

    def settle(self) -> int:
        """Forget the replies libzmq let go of; how many it still holds."""
        if self.in_flight:
            self.in_flight = [tracker for tracker in self.in_flight if not tracker.done]
        return len(self.in_flight)


class ChunkScheduler:
    """Sends a peer's chunk request now, holds it back, or refuses it, within the limits."""

    def __init__(self, send: SendChunk, reject: Reject, counters: Counter[str]):
        """``counters`` is the publisher's ``served``: ``chunk_requests_deferred``."""
        self._send = send
        self._reject = reject
        self._counters = counters
        self.peers: dict[bytes, Peer] = {}  # peers with chunk replies in flight or waiting
        self.serving: dict[bytes, Peer] = {}  # those with replies in flight
        self.waiting: dict[bytes, Peer] = {}  # those with requests waiting, oldest first
        self.peak_peer_in_flight = 0
        """The most chunk replies libzmq held for one peer at once (at most PEER_MAX_CHUNKS)."""

    def request(self, identity: bytes, request: WeightsChunkRequest) -> None:
        """Serve, defer or refuse one chunk request of peer ``identity``."""
        peer = self.peers.get(identity)
        if peer is None:
            peer = Peer()
        if not peer.waiting and self._may_send(identity, peer, request.version):
            self._serve(identity, peer, request)
        elif len(peer.waiting) >= PEER_MAX_WAITING:
            self._reject(
                identity,
                "peer_busy",
                f"more than {PEER_MAX_CHUNKS + PEER_MAX_WAITING} chunk requests in flight",
            )
        elif not peer.waiting and len(self.waiting) >= MAX_PEERS_WAITING:
            self._reject(identity, "busy", f"{MAX_PEERS_WAITING} peers wait already")
        else:
            peer.waiting.append(request)
            self.waiting.setdefault(identity, peer)
            self.peers[identity] = peer
            self._counters["chunk_requests_deferred"] += 1

    def serve_waiting(self) -> None:
        """Serve the waiting requests whose peers have room now, oldest peers first."""
        slots = self.free_slots(settle=True)
        if slots > 0:
            candidates = list(self.waiting.items())
        else:  # only the peers being served can go on
            candidates = [(i, p) for i, p in self.waiting.items() if p.in_flight]
        for identity, peer in candidates:
            while peer.waiting:
                request = peer.waiting[0]
                if peer.in_flight:
                    if len(peer.in_flight) >= PEER_MAX_CHUNKS or peer.version != request.version:
                        break
                elif slots <= 0:
                    break
                else:
                    slots -= 1
                peer.waiting.popleft()
                self._serve(identity, peer, request)
            if not peer.waiting:
                del self.waiting[identity]
                self._settle(identity, peer)

    def free_slots(self, settle: bool = False) -> int:
        """How many more peers may have chunk replies in flight (settling the peers being
        served first when they fill every slot, or when asked)."""
        if settle or len(self.serving) >= MAX_PEERS_SERVED:
            for identity, peer in list(self.serving.items()):
                self._settle(identity, peer)
        return MAX_PEERS_SERVED - len(self.serving)

    def _may_send(self, identity: bytes, peer: Peer, version: int) -> bool:
        """True when ``peer`` may have one more chunk reply of ``version`` in flight now."""
        if self._settle(identity, peer):
            return len(peer.in_flight) < PEER_MAX_CHUNKS and peer.version == version
        return self.free_slots() > 0

    def _settle(self, identity: bytes, peer: Peer) -> int:
        """Forget the replies libzmq let go of, and the peer once nothing is left."""
        held = peer.settle()
        if not held:
            self.serving.pop(identity, None)
            if not peer.waiting:
                self.peers.pop(identity, None)
        return held

    def _serve(self, identity: bytes, peer: Peer, request: WeightsChunkRequest) -> None:
        tracker = self._send(identity, request)
        if tracker is not None:
            peer.in_flight.append(tracker)
            peer.version = request.version
            self.serving[identity] = self.peers[identity] = peer
            self.peak_peer_in_flight = max(self.peak_peer_in_flight, len(peer.in_flight))
