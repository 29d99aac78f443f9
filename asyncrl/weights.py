"""Versioned weights from the learner to the generators over ZeroMQ, in chunks.

Publishing. Every ``sync_interval`` versions the learner calls
:meth:`WeightPublisher.publish` with a dict or any iterable of ``(name, tensor)``
pairs, e.g. a generator that gathers one parameter at a time with
``DTensor.full_tensor()``, so the full model never exists twice on the learner's
device. ``publish`` copies each tensor into a host snapshot and returns the
seconds that took: the learner's only stall, reported as
``time_publish_stall_s``. Serving happens on a server thread beside the next
training step. When the tensor shapes repeat (they do, step after step) the copy
goes into the buffers of the snapshot two versions back, so a steady-state
publish is a memory copy into warm memory, not a fresh allocation.

Layout. A version's tensors are laid end to end, in index order, as one byte
stream (each tensor C-contiguous), cut into chunks of ``chunk_bytes``: a chunk
carries the tail of a tensor begun in the chunk before, whole small tensors, and
the head of one that continues; a tensor larger than a chunk spans several.
Each piece travels as its own zero-copy frame, named after its tensor, so a
chunk costs the server no copy and the client at most ``window`` chunks of
memory beyond the tensors it is filling.

Protocol (pull; the client is a DEALER, the server thread here a ROUTER)::

    WeightsRequest(have_version)  -> WeightsUpToDate(latest_version)
                                   | WeightsManifest(version, published_at, chunk_bytes,
                                                     total_bytes, num_chunks, tensors)
    WeightsChunkRequest(version, i) -> WeightsChunk(version, i, crc32) + piece frames
                                     | WeightsGone(version, latest_version)
    anything malformed              -> ErrorReply(reason), counted; the server carries on

Limits. Whoever the peers are, serving costs the learner bounded time and memory
(docs/security.md, "What the weights server accepts"):

- with authentication on (``cluster=``) only peers admitted as ``generator`` are
  served; any other role is answered ``ErrorReply("forbidden")``
  (``rejected_forbidden``), a peer without a role ``rejected_no_role``;
- a request is one frame of at most ``REQUEST_MAX_BYTES``: anything else is
  refused on its frame count and sizes, before it is decoded (``rejected_bad_array``,
  ``rejected_oversized``); libzmq itself drops a peer that sends a frame above
  ``FRAME_MAX_BYTES``;
- a peer has at most ``PEER_MAX_CHUNKS`` chunk replies that libzmq still holds
  (queued or being written; known from a tracked frame), all of one version, and
  at most ``MAX_PEERS_SERVED`` peers have any: further chunk requests wait in the
  server, up to ``PEER_MAX_WAITING`` per peer and ``MAX_PEERS_WAITING`` peers, and
  are served as replies drain; beyond that they are answered ``ErrorReply("busy")``
  (``rejected_peer_busy``, ``rejected_busy``). A client that never reads therefore
  pins at most ``PEER_MAX_CHUNKS`` chunks, and the snapshot it pins cannot be
  recycled until libzmq lets go of them;
- the ROUTER queues at most ``SEND_HWM`` replies per peer; a reply to a peer with
  no room is dropped and counted (``replies_dropped_peer_full``), never waited for;
  it holds at most ``RECEIVE_HWM`` requests per peer;
- a peer that stops reading altogether stops answering the server's heartbeats and is
  dropped after ``HEARTBEAT_TIMEOUT_S``, which releases what it pinned.

Rejections are counted in ``served`` and logged at most once per
``REJECTION_LOG_INTERVAL_S`` per reason; :meth:`WeightPublisher.stats` reports
every counter for the learner's metrics.

The manifest is the tensor index (name, dtype, shape, offset, nbytes of each
tensor), checked for consistency when it is decoded. The client keeps ``window``
chunk requests in flight and checks each chunk before using it: its version and
index, its pieces against the ones the index implies, its crc32. At the end it
checks that every tensor of the index got all of its bytes. Any failure raises
:class:`WireError` naming the chunk and the tensors concerned.

Versions in flight. The server keeps two snapshots: the latest and the one
before it. A client that began fetching version ``v`` finishes ``v`` as long as
at most one newer version is published meanwhile. When a second one is, ``v``'s
buffers are recycled for the newest, ``v``'s chunk requests are answered
``WeightsGone`` (``served["version_gone"]``) and the client starts over with the
newest (``stats["restarts"]``). A client therefore always ends with one
consistent version, and the publisher never holds more than two snapshots.
"""

from __future__ import annotations

import logging
import threading
import time
import zlib
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING

import numpy as np
import torch
import zmq

from asyncrl.messages import (
    ArraySpec,
    ErrorReply,
    TensorEntry,
    WeightsChunk,
    WeightsChunkRequest,
    WeightsGone,
    WeightsManifest,
    WeightsRequest,
    WeightsUpToDate,
    WireError,
    decode,
    encode,
    encode_raw,
)
from asyncrl.security import GENERATOR, peer_role, secure_server
from asyncrl.transport import client_socket

if TYPE_CHECKING:
    from asyncrl.config import ClusterConfig

log = logging.getLogger("asyncrl.weights")

TORCH_DTYPES = {
    torch.float32: "float32",
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
    torch.int64: "int64",
    torch.int32: "int32",
    torch.uint8: "uint8",
    torch.bool: "bool",
}
FROM_NAME = {name: dtype for dtype, name in TORCH_DTYPES.items()}
DEFAULT_CHUNK_BYTES = 16 << 20
"""Bytes per chunk: big enough that a round trip per chunk costs nothing, small
enough that a chunk's receive buffer is reused by the allocator (glibc maps
anything above 32 MiB afresh, page faults and all, on every receive)."""
REQUEST_MAX_BYTES = 4 << 10
"""The largest request the server decodes: requests are one header frame of tens of
bytes; anything bigger is refused on its size alone (``rejected_oversized``)."""
FRAME_MAX_BYTES = 64 << 10
"""libzmq drops a peer that sends a frame larger than this (``ZMQ_MAXMSGSIZE``), before
buffering it; between ``REQUEST_MAX_BYTES`` and this a request is refused and counted."""
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
SLOW_REPLY_MS = 1000
"""A client told to (``on_wait``) says it is waiting on the publisher after this long."""
_WAITING_POLL_MS = 2
"""How often the server thread looks for drained chunk replies while requests wait."""
_RECEIVE_BATCH = 256
"""Requests handled in a row before waiting requests get a turn."""
_DETAIL_CHARS = 200
"""An error reply's detail, and a log line's, is cut to this many characters."""
_MORE = zmq.SNDMORE | zmq.NOBLOCK

Piece = tuple[int, int, int]
"""``(tensor index, start byte, stop byte)`` within that tensor."""


def chunk_pieces(tensors: list[TensorEntry], chunk_bytes: int) -> list[list[Piece]]:
    """The pieces of each chunk, in stream order: the layout both ends derive from the index."""
    total = sum(entry.nbytes for entry in tensors)
    chunks: list[list[Piece]] = [[] for _ in range(-(-total // chunk_bytes))]
    for index, entry in enumerate(tensors):
        position, end = entry.offset, entry.offset + entry.nbytes
        while position < end:
            chunk = position // chunk_bytes
            stop = min(end, (chunk + 1) * chunk_bytes)
            chunks[chunk].append((index, position - entry.offset, stop - entry.offset))
            position = stop
    return chunks


def _describe(tensors: list[TensorEntry], pieces: list[Piece], limit: int = 4) -> str:
    names = [f"'{tensors[index].name}'" for index, _, _ in pieces]
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more if names else "no tensors"


def _byte_view(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


class _Snapshot:
    """One published version: host tensors, their index and their chunk layout."""

    def __init__(
        self,
        version: int,
        published_at: float,
        tensors: list[TensorEntry],
        buffers: list[torch.Tensor],
        chunk_bytes: int,
    ):
        self.version = version
        self.tensors = tensors
        self.buffers = buffers
        self.pieces = chunk_pieces(tensors, chunk_bytes)
        total = sum(entry.nbytes for entry in tensors)
        manifest = WeightsManifest(
            version, published_at, chunk_bytes, total, len(self.pieces), tensors
        )
        self.manifest_frames = encode(manifest)
        self.views = [
            _byte_view(buffer) if entry.nbytes else memoryview(b"")
            for entry, buffer in zip(tensors, buffers, strict=True)
        ]
        self.crcs: dict[int, int] = {}  # chunk -> crc32, computed when first served
        self.readers = 0  # server replies being built from these buffers
        self.index = {entry.name: index for index, entry in enumerate(tensors)}
        self.held: list[tuple[int, zmq.MessageTracker]] = []
        """``(tensor index, tracker)`` of the zero-copy frames zmq may still read."""

    @property
    def trackers(self) -> list[zmq.MessageTracker]:
        return [tracker for _, tracker in self.held]

    def idle(self) -> bool:
        """True when nothing reads the buffers any more, so they can be overwritten."""
        return self.readers == 0 and all(tracker.done for _, tracker in self.held)

    def reusable_buffers(self) -> list[torch.Tensor | None]:
        """Its buffers, each None while zmq may still read it (call with no reply being
        built): a peer slow to read pins only the tensors of the chunks it was sent."""
        held = {index for index, tracker in self.held if not tracker.done}
        return [None if index in held else buffer for index, buffer in enumerate(self.buffers)]


class _Peer:
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


class _RateLimitedLog:
    """At most one line per reason per ``interval_s``: :meth:`due` says when, and how many."""

    def __init__(self, interval_s: float):
        self.interval_s = interval_s
        self._last: dict[str, float] = {}
        self._count: Counter[str] = Counter()

    def due(self, reason: str) -> int:
        """Count one more ``reason``; the count since the last line if one is due now, else 0."""
        self._count[reason] += 1
        now = time.monotonic()
        last = self._last.get(reason)
        if last is not None and now - last < self.interval_s:
            return 0
        self._last[reason] = now
        return self._count.pop(reason)


class WeightPublisher:
    """Snapshots the learner's weights per version and serves them in chunks from a thread."""

    def __init__(
        self,
        endpoint: str,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        cluster: ClusterConfig | None = None,
    ):
        """With ``cluster`` (the run's ``config.cluster``) serve only the run's authenticated
        peers; without it any peer (tests and benchmarks on a trusted machine)."""
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
        self.endpoint = endpoint
        self.chunk_bytes = chunk_bytes
        self.version = -1
        self._latest: _Snapshot | None = None
        self._previous: _Snapshot | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.served: Counter[str] = Counter()
        self._peers: dict[bytes, _Peer] = {}  # peers with chunk replies in flight or waiting
        self._serving: dict[bytes, _Peer] = {}  # those with replies in flight
        self._waiting: dict[bytes, _Peer] = {}  # those with requests waiting, oldest first
        self.peak_peer_in_flight = 0
        """The most chunk replies libzmq held for one peer at once (at most PEER_MAX_CHUNKS)."""
        self._rejections = _RateLimitedLog(REJECTION_LOG_INTERVAL_S)
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.SNDHWM, SEND_HWM)
        self._socket.setsockopt(zmq.RCVHWM, RECEIVE_HWM)
        self._socket.setsockopt(zmq.MAXMSGSIZE, FRAME_MAX_BYTES)
        # every send is NOBLOCK, so a peer at its SNDHWM (or gone) fails the send at once:
        # the reply is dropped and counted, the server thread never waits for a peer
        self._socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._socket.setsockopt(zmq.HEARTBEAT_IVL, int(HEARTBEAT_INTERVAL_S * 1000))
        self._socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(HEARTBEAT_TIMEOUT_S * 1000))
        self._auth = secure_server(self._context, self._socket, cluster) if cluster else None
        self._socket.bind(endpoint)
        self._thread = threading.Thread(target=self._serve_loop, name="weights-server", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ learner side

    def publish(
        self,
        tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
        version: int,
        *,
        copy: bool = True,
    ) -> float:
        """Snapshot ``tensors`` as ``version``; returns the seconds the caller was stalled.

        ``tensors`` is a state dict or an iterable of ``(name, tensor)`` pairs,
        consumed once, one tensor at a time (the time spent producing them, e.g.
        gathering shards, counts in the stall). Each is copied to host memory.
        With ``copy=False`` the caller hands the tensors over and promises never
        to modify them: host contiguous ones are served as they are, without a
        copy (e.g. freshly gathered full tensors). Versions must increase.
        """
        start = time.perf_counter()
        with self._lock:
            if version <= self.version:
                raise ValueError(f"version {version} is not newer than {self.version}")
            recycled, self._previous = self._previous, None  # its late readers get WeightsGone
            pool: list[torch.Tensor | None] = []
            if copy and recycled is not None and recycled.readers == 0:
                pool = recycled.reusable_buffers()
        if recycled is not None and copy and (not pool or any(b is None for b in pool)):
            self.served["snapshot_not_reused"] += 1  # all of it, or the tensors zmq holds
        items = tensors.items() if isinstance(tensors, Mapping) else tensors
        entries: list[TensorEntry] = []
        buffers: list[torch.Tensor] = []
        names: set[str] = set()
        offset = 0
        for index, (name, tensor) in enumerate(items):
            if name in names:
                raise ValueError(f"tensor '{name}' is published twice in version {version}")
            names.add(name)
            if hasattr(tensor, "full_tensor"):  # a DTensor shard: gathering is the caller's
                raise TypeError(f"tensor '{name}' is sharded: publish tensor.full_tensor()")
            dtype = TORCH_DTYPES.get(tensor.dtype)
            if dtype is None:
                raise ValueError(f"tensor '{name}' has unsupported dtype {tensor.dtype}")
            tensor = tensor.detach()
            if not copy:
                buffer = tensor.to("cpu").contiguous()
            else:
                spare = pool[index] if index < len(pool) else None
                if spare is None or spare.dtype != tensor.dtype or spare.shape != tensor.shape:
                    spare = torch.empty(tensor.shape, dtype=tensor.dtype)
                buffer = spare.copy_(tensor)
            nbytes = buffer.numel() * buffer.element_size()
            entries.append(TensorEntry(name, dtype, tuple(buffer.shape), offset, nbytes))
            buffers.append(buffer)
            offset += nbytes
        snapshot = _Snapshot(version, time.time(), entries, buffers, self.chunk_bytes)
        with self._lock:
            self._previous, self._latest = self._latest, snapshot
            self.version = version
        self.served["published"] += 1
        return time.perf_counter() - start

    # ------------------------------------------------------------------ server thread

    def _serve_loop(self) -> None:
        settled = time.monotonic()
        while not self._stop.is_set():
            if self._socket.poll(_WAITING_POLL_MS if self._waiting else 100):
                for _ in range(_RECEIVE_BATCH):
                    try:
                        identity, *frames = self._socket.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    self._handle(identity, frames)
            if self._waiting:
                self._serve_waiting()
            elif self._serving and time.monotonic() - settled > 0.1:
                self._free_slots(settle=True)  # keeps the served peers (and stats) current
                settled = time.monotonic()

    def _handle(self, identity: zmq.Frame, frames: list) -> None:
        try:
            self._answer(identity, frames)
        except Exception:  # a bug must not silence the server for every generator
            self._internal_error(identity.bytes)

    def _internal_error(self, identity: bytes) -> None:
        """Called in an ``except`` block: count, log (rate-limited) and answer."""
        self.served["server_errors"] += 1
        count = self._rejections.due("server_error")
        if count:
            log.exception("weights server failed to answer %d request(s)", count)
        self._reply(identity, encode(ErrorReply("internal", "see the learner's log")))

    def _reply(self, identity: bytes, frames: list) -> bool:
        """Send a reply unless the peer's queue is full or the peer is gone (counted)."""
        try:
            self._socket.send_multipart([identity, *frames], zmq.NOBLOCK, copy=False)
        except zmq.ZMQError as error:
            self._dropped(error)
            return False
        return True

    def _dropped(self, error: zmq.ZMQError) -> None:
        """A reply the ROUTER refused at its first frame, so nothing of it was queued."""
        if error.errno == zmq.EAGAIN:
            self.served["replies_dropped_peer_full"] += 1
        elif error.errno == zmq.EHOSTUNREACH:
            self.served["replies_dropped_peer_gone"] += 1
        else:
            raise error

    def _reject(self, identity: bytes, reason: str, detail: str) -> None:
        """Count, log (rate-limited) and answer a refused request."""
        detail = detail[:_DETAIL_CHARS]
        self.served[f"rejected_{reason}"] += 1
        count = self._rejections.due(reason)
        if count:
            log.warning(
                "weights server refused %d request(s) (%s) in the last %.0fs; latest: %s",
                count,
                reason,
                self._rejections.interval_s,
                detail,
            )
        self._reply(identity, encode(ErrorReply(reason, detail)))

    def _answer(self, identity: zmq.Frame, frames: list) -> None:
        """Refuse what is not a generator's small request before any decoding, then answer."""
        key = identity.bytes
        if self._auth is not None:
            role = peer_role(identity)
            if role is None:
                return self._reject(key, "no_role", "an authenticated peer must have a role")
            if role not in SERVED_ROLES:
                return self._reject(key, "forbidden", f"the weights are not served to a {role}")
        if len(frames) != 1:
            return self._reject(
                key, "bad_array", f"a weights request is one frame, got {len(frames)}"
            )
        size = len(frames[0])
        if size > REQUEST_MAX_BYTES:
            return self._reject(
                key, "oversized", f"{size} bytes exceeds the limit of {REQUEST_MAX_BYTES}"
            )
        try:
            body, _ = decode(frames, max_bytes=REQUEST_MAX_BYTES)  # one frame: no arrays
        except WireError as error:
            return self._reject(key, error.reason, str(error))
        if isinstance(body, WeightsRequest):
            self._reply(key, self._manifest_reply(body.have_version))
        elif isinstance(body, WeightsChunkRequest):
            self._chunk_request(key, body)
        else:
            self._reject(key, "unexpected_type", f"weights server got {type(body).__name__}")

    def _manifest_reply(self, have_version: int) -> list:
        with self._lock:
            latest = self._latest
        if latest is None or latest.version <= have_version:
            self.served["up_to_date"] += 1
            return encode(WeightsUpToDate(-1 if latest is None else latest.version))
        self.served["manifests_sent"] += 1
        return latest.manifest_frames

    # Chunk requests: at most PEER_MAX_CHUNKS replies held by libzmq per peer, at most
    # MAX_PEERS_SERVED peers with any; the other requests wait here, in bounded numbers.
    # Every step below costs O(PEER_MAX_CHUNKS + MAX_PEERS_SERVED), never O(peers).

    def _chunk_request(self, identity: bytes, request: WeightsChunkRequest) -> None:
        peer = self._peers.get(identity)
        if peer is None:
            peer = _Peer()
        if not peer.waiting and self._may_send(identity, peer, request.version):
            self._serve_chunk(identity, peer, request)
        elif len(peer.waiting) >= PEER_MAX_WAITING:
            self._reject(
                identity,
                "peer_busy",
                f"more than {PEER_MAX_CHUNKS + PEER_MAX_WAITING} chunk requests in flight",
            )
        elif not peer.waiting and len(self._waiting) >= MAX_PEERS_WAITING:
            self._reject(identity, "busy", f"{MAX_PEERS_WAITING} peers wait already")
        else:
            peer.waiting.append(request)
            self._waiting.setdefault(identity, peer)
            self._peers[identity] = peer
            self.served["chunk_requests_deferred"] += 1

    def _may_send(self, identity: bytes, peer: _Peer, version: int) -> bool:
        """True when ``peer`` may have one more chunk reply of ``version`` in flight now."""
        if self._settle(identity, peer):
            return len(peer.in_flight) < PEER_MAX_CHUNKS and peer.version == version
        return self._free_slots() > 0

    def _free_slots(self, settle: bool = False) -> int:
        """How many more peers may have chunk replies in flight (settling the peers being
        served first when they fill every slot, or when asked)."""
        if settle or len(self._serving) >= MAX_PEERS_SERVED:
            for identity, peer in list(self._serving.items()):
                self._settle(identity, peer)
        return MAX_PEERS_SERVED - len(self._serving)

    def _settle(self, identity: bytes, peer: _Peer) -> int:
        """Forget the replies libzmq let go of, and the peer once nothing is left."""
        held = peer.settle()
        if not held:
            self._serving.pop(identity, None)
            if not peer.waiting:
                self._peers.pop(identity, None)
        return held

    def _serve_waiting(self) -> None:
        """Serve the waiting requests whose peers have room now, oldest peers first."""
        slots = self._free_slots(settle=True)
        if slots > 0:
            candidates = list(self._waiting.items())
        else:  # only the peers being served can go on
            candidates = [(i, p) for i, p in self._waiting.items() if p.in_flight]
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
                self._serve_chunk(identity, peer, request)
            if not peer.waiting:
                del self._waiting[identity]
                self._settle(identity, peer)

    def _serve_chunk(self, identity: bytes, peer: _Peer, request: WeightsChunkRequest) -> None:
        try:
            tracker = self._send_chunk(identity, request)
        except WireError as error:
            self._reject(identity, error.reason, str(error))
            return
        except Exception:
            self._internal_error(identity)
            return
        if tracker is not None:
            peer.in_flight.append(tracker)
            peer.version = request.version
            self._serving[identity] = self._peers[identity] = peer
            self.peak_peer_in_flight = max(self.peak_peer_in_flight, len(peer.in_flight))

    def _send_chunk(
        self, identity: bytes, request: WeightsChunkRequest
    ) -> zmq.MessageTracker | None:
        """Send chunk ``request.index`` (or WeightsGone); the tracker of its last frame."""
        with self._lock:
            snapshot = next(
                (
                    s
                    for s in (self._latest, self._previous)
                    if s is not None and s.version == request.version
                ),
                None,
            )
            latest = self.version
            if snapshot is not None:
                if not 0 <= request.index < len(snapshot.pieces):
                    raise WireError(
                        "bad_request",
                        f"version {request.version} has {len(snapshot.pieces)} chunks, "
                        f"no chunk {request.index}",
                    )
                snapshot.readers += 1
        if snapshot is None:
            self.served["version_gone"] += 1
            self._reply(identity, encode(WeightsGone(request.version, latest)))
            return None
        trackers: list[zmq.MessageTracker] = []
        specs: list[ArraySpec] = []
        try:
            body, specs, views = self._chunk_message(snapshot, request.index)
            frames = encode_raw(body, specs, views)
            try:  # the routing frame: fails, and queues nothing, if the peer has no room
                self._socket.send(identity, _MORE, copy=False)
            except zmq.ZMQError as error:
                self._dropped(error)
                return None
            self.served["chunks_sent"] += 1  # counted first: the client may be done at once
            self.served["bytes_sent"] += sum(view.nbytes for view in views)
            if request.index == len(snapshot.pieces) - 1:
                self.served["transfers_finished"] += 1
            for frame in frames[:-1]:  # the rest of a message is always accepted
                trackers.append(self._socket.send(frame, _MORE, copy=False, track=True))
            # the last frame is shared, not copied, even when small, so that its tracker
            # says when libzmq lets go of the whole reply (frames are released in order)
            last = frames[-1]
            if memoryview(last).nbytes < self._socket.copy_threshold:
                last = zmq.Frame(last, copy=False, track=True)
            trackers.append(self._socket.send(last, zmq.NOBLOCK, copy=False, track=True))
        finally:
            tensors = [-1] + [snapshot.index.get(spec.name, -1) for spec in specs]  # per frame
            sent = [(i, t) for i, t in zip(tensors, trackers, strict=False) if not t.done]
            with self._lock:
                snapshot.readers -= 1
                snapshot.held = [(i, t) for i, t in snapshot.held if not t.done] + sent
        return trackers[-1]

    def _chunk_message(
        self, snapshot: _Snapshot, index: int
    ) -> tuple[WeightsChunk, list[ArraySpec], list[memoryview]]:
        """Header, piece specs and zero-copy piece views of chunk ``index``."""
        pieces = snapshot.pieces[index]
        views = [snapshot.views[tensor][start:stop] for tensor, start, stop in pieces]
        crc = snapshot.crcs.get(index)
        if crc is None:
            crc = 0
            for view in views:
                crc = zlib.crc32(view, crc)  # releases the GIL: training carries on
            snapshot.crcs[index] = crc
        specs = [
            ArraySpec(snapshot.tensors[tensor].name, "uint8", (stop - start,))
            for tensor, start, stop in pieces
        ]
        return WeightsChunk(snapshot.version, index, crc), specs, views

    def stats(self) -> dict[str, float]:
        """The server's counters as metrics: ``weights_<counter>_total`` for each counter of
        ``served`` (``weights_chunks_sent_total``, ``weights_rejected_<reason>_total``, ...),
        ``weights_refused_auth_total`` (handshakes refused for unknown credentials) when
        authentication is on, and the peers being served or waiting now."""
        served = dict(self.served)  # one C-level copy: the server thread keeps counting
        stats = {f"weights_{name}_total": float(count) for name, count in served.items()}
        if self._auth is not None:
            stats["weights_refused_auth_total"] = float(self._auth.refused)
        stats["weights_peers_served"] = float(len(self._serving))
        stats["weights_peers_waiting"] = float(len(self._waiting))
        return stats

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._socket.close(linger=0)
        if self._auth is not None:
            self._auth.stop()  # before term(), which waits for the ZAP handler's sockets
        self._context.term()


# ---------------------------------------------------------------------- generator side


class _Restart(Exception):
    """The version being fetched is gone; start over with the latest."""


class _Assembly:
    """Tensors of one manifest being filled chunk by chunk, each chunk checked first."""

    def __init__(self, manifest: WeightsManifest, reuse: list[torch.Tensor] | None = None):
        self.manifest = manifest
        self.pieces = chunk_pieces(manifest.tensors, manifest.chunk_bytes)
        sizes = [entry.nbytes for entry in manifest.tensors]
        if reuse is not None and [buffer.numel() for buffer in reuse] == sizes:
            self.buffers = reuse
        else:
            self.buffers = [torch.empty(size, dtype=torch.uint8) for size in sizes]
        self.arrays = [buffer.numpy() for buffer in self.buffers]
        self.received = [0] * len(manifest.tensors)

    def describe(self, index: int) -> str:
        names = _describe(self.manifest.tensors, self.pieces[index])
        return f"chunk {index} of v{self.manifest.version} ({names})"

    def take(self, index: int, body, arrays: dict) -> None:
        """Check chunk ``index`` against the index, then copy its pieces into the tensors."""
        tensors = self.manifest.tensors
        if isinstance(body, ErrorReply):
            raise WireError(body.reason, f"weights server on {self.describe(index)}: {body.detail}")
        if not isinstance(body, WeightsChunk):
            raise WireError(
                "unexpected_type", f"expected a weights chunk, got {type(body).__name__}"
            )
        if body.version != self.manifest.version or body.index != index:
            raise WireError(
                "missing_chunk",
                f"expected {self.describe(index)}, got chunk {body.index} of v{body.version}",
            )
        frames = list(arrays.values())
        for position, (tensor, start, stop) in enumerate(self.pieces[index]):
            frame = frames[position] if position < len(frames) else None
            if (
                frame is None
                or frame.spec.name != tensors[tensor].name
                or frame.spec.dtype != "uint8"
                or frame.buffer.nbytes != stop - start
            ):
                got = (
                    "nothing"
                    if frame is None
                    else f"'{frame.spec.name}' ({frame.buffer.nbytes} bytes)"
                )
                raise WireError(
                    "missing_tensor",
                    f"{self.describe(index)} lacks bytes [{start}, {stop}) of tensor "
                    f"'{tensors[tensor].name}': got {got}",
                )
        if len(frames) > len(self.pieces[index]):
            extra = frames[len(self.pieces[index])].spec.name
            raise WireError("bad_chunk", f"{self.describe(index)} carries an extra piece '{extra}'")
        crc = 0
        for frame in frames:
            crc = zlib.crc32(frame.buffer, crc)
        if crc != body.crc32:
            raise WireError("corrupt_chunk", f"{self.describe(index)} fails its crc32 check")
        for (tensor, start, stop), frame in zip(self.pieces[index], frames, strict=True):
            self.arrays[tensor][start:stop] = np.frombuffer(frame.buffer, dtype=np.uint8)
            self.received[tensor] += stop - start

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The rebuilt tensors, once every tensor of the index has all its bytes."""
        state_dict = {}
        for entry, buffer, received in zip(
            self.manifest.tensors, self.buffers, self.received, strict=True
        ):
            if received != entry.nbytes:
                raise WireError(
                    "missing_tensor",
                    f"tensor '{entry.name}' of v{self.manifest.version} got {received} of "
                    f"{entry.nbytes} bytes",
                )
            state_dict[entry.name] = buffer.view(FROM_NAME[entry.dtype]).reshape(entry.shape)
        return state_dict


class WeightClient:
    """A generator's view of the publisher: fetch weights newer than the ones held.

    ``window`` chunk requests (at most ``MAX_WINDOW``) are kept in flight. A fetch
    whose version the publisher dropped meanwhile starts over with the latest, at
    most ``max_restarts`` times; after that it gives up (returns None, counted in
    ``stats["gave_up"]``) and the generator tries again at its next check.

    With ``reuse_buffers`` the client fills the host buffers of its previous
    fetch again when the layout is the same, instead of fresh memory (whose
    first touch costs page faults, often more than the transfer itself): the
    tensors returned by one fetch are then only valid until the next fetch, which
    suits a caller that copies them into its model at once (``load_weights``).
    """

    def __init__(
        self,
        context: zmq.Context,
        endpoint: str,
        timeout_s: float = 120.0,
        window: int = 2,
        max_restarts: int = 8,
        reuse_buffers: bool = False,
        on_wait: Callable[[], None] | None = None,
    ):
        if not 1 <= window <= MAX_WINDOW:
            raise ValueError(f"window must be between 1 and {MAX_WINDOW}, got {window}")
        self.context = context
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self.window = window
        self.max_restarts = max_restarts
        self.reuse_buffers = reuse_buffers
        self.on_wait = on_wait
        """Called once when a reply takes over :data:`SLOW_REPLY_MS`: the caller says it is
        waiting on the publisher (the learner), so a frozen learner is not its stall."""
        self._buffers: list[torch.Tensor] | None = None
        self.socket = client_socket(context, endpoint, timeout_s)
        self.errors: Counter[str] = Counter()
        self.stats: Counter[str] = Counter()

    def fetch_newer(self, have_version: int) -> tuple[int, float, dict[str, torch.Tensor]] | None:
        """``(version, published_at, state_dict)`` if newer weights exist, else None.

        Raises WireError naming the chunk or tensor when what arrives does not
        match the version's index, TimeoutError when the publisher is silent.
        """
        for _ in range(self.max_restarts + 1):
            try:
                return self._fetch(have_version)
            except _Restart:
                self.stats["restarts"] += 1
            except WireError as error:
                self.errors[error.reason] += 1
                self._reconnect()  # replies still in flight must not answer the next fetch
                raise
            except TimeoutError:
                self._reconnect()
                raise
        self.stats["gave_up"] += 1
        log.warning(
            "gave up fetching weights after %d restarts: the publisher moved on twice during "
            "each transfer (publish less often or serve faster)",
            self.max_restarts,
        )
        return None

    def _receive(self, max_bytes: int):
        timeout_ms = int(self.timeout_s * 1000)
        if self.on_wait is not None and not self.socket.poll(min(SLOW_REPLY_MS, timeout_ms)):
            self.on_wait()
            timeout_ms -= SLOW_REPLY_MS
        if timeout_ms <= 0 or not self.socket.poll(timeout_ms):
            raise TimeoutError(f"no reply from {self.endpoint} within {self.timeout_s:.0f}s")
        return decode(self.socket.recv_multipart(copy=False), max_bytes=max_bytes)

    def _send(self, body) -> None:
        self.socket.send_multipart(encode(body), copy=False)

    def _fetch(self, have_version: int):
        self._send(WeightsRequest(have_version))
        body, _ = self._receive(max_bytes=1 << 30)
        if isinstance(body, WeightsUpToDate):
            return None
        if isinstance(body, ErrorReply):
            raise WireError(body.reason, f"weights server: {body.detail}")
        if not isinstance(body, WeightsManifest):
            raise WireError("unexpected_type", f"expected a manifest, got {type(body).__name__}")
        assembly = _Assembly(body, self._buffers if self.reuse_buffers else None)
        if self.reuse_buffers:
            self._buffers = assembly.buffers
        count = body.num_chunks
        max_bytes = body.chunk_bytes + (1 << 20)
        requested = 0
        while requested < min(self.window, count):
            self._send(WeightsChunkRequest(body.version, requested))
            requested += 1
        for index in range(count):
            reply, arrays = self._receive(max_bytes + 256 * len(assembly.pieces[index]))
            if isinstance(reply, WeightsGone):
                self._drain(requested - index - 1)
                raise _Restart
            assembly.take(index, reply, arrays)
            if requested < count:
                self._send(WeightsChunkRequest(body.version, requested))
                requested += 1
        self.stats["fetched"] += 1
        self.stats["bytes"] += body.total_bytes
        return body.version, body.published_at, assembly.state_dict()

    def _drain(self, pending: int) -> None:
        """Discard the replies to chunk requests still in flight."""
        for _ in range(pending):
            if not self.socket.poll(int(self.timeout_s * 1000)):
                self._reconnect()
                return
            self.socket.recv_multipart(copy=False)

    def _reconnect(self) -> None:
        self.socket.close(linger=0)
        self.socket = client_socket(self.context, self.endpoint, self.timeout_s)

    def close(self) -> None:
        self.socket.close(linger=0)
