"""The learner's weight server: a ZeroMQ ROUTER thread serving snapshots in chunks.

:class:`WeightPublisher` takes the learner's weights into a
:class:`~asyncrl.weights.snapshot.SnapshotStore` (``publish``, the learner's only
stall) and serves them from a thread beside the next training step. Each
chunk's pieces travel as their own zero-copy frames, named after their tensor,
so a chunk costs the server no copy.

Protocol (pull; the client is a DEALER, the server thread here a ROUTER)::

    WeightsRequest(have_version)  -> WeightsUpToDate(latest_version)
                                   | WeightsManifest(version, published_at, chunk_bytes,
                                                     total_bytes, num_chunks, tensors)
    WeightsChunkRequest(version, i) -> WeightsChunk(version, i, crc32) + piece frames
                                     | WeightsGone(version, latest_version)
    anything malformed              -> ErrorReply(reason), counted; the server carries on

Limits (:mod:`.limits`). Whoever the peers are, serving costs the learner
bounded time and memory (docs/security.md, "What the weights server accepts"):

- with authentication on (``cluster=``) only peers admitted as ``generator`` are
  served; any other role is answered ``ErrorReply("forbidden")``
  (``rejected_forbidden``), a peer without a role ``rejected_no_role``;
- a request is one frame of at most ``REQUEST_MAX_BYTES``: anything else is
  refused on its frame count and sizes, before it is decoded (``rejected_bad_array``,
  ``rejected_oversized``); libzmq itself drops a peer that sends a frame above
  ``FRAME_MAX_BYTES``, handshake commands included, and the connection guard
  (:mod:`asyncrl.core.connection_guard`) one holding more than ``HELD_BYTES`` unread and the
  oldest connections in their handshake beyond ``guard_limits(replicas)``;
- a peer has at most ``PEER_MAX_CHUNKS`` chunk replies that libzmq still holds,
  all of one version, and at most ``MAX_PEERS_SERVED`` peers have any; further
  chunk requests wait or are refused (:mod:`.peers`). A client that never
  reads therefore pins at most ``PEER_MAX_CHUNKS`` chunks, and the snapshot it
  pins cannot be recycled until libzmq lets go of them;
- the ROUTER queues at most ``SEND_HWM`` replies per peer; a reply to a peer with
  no room is dropped and counted (``replies_dropped_peer_full``), never waited for;
  it holds at most ``RECEIVE_HWM`` requests per peer;
- a peer that stops reading altogether stops answering the server's heartbeats and is
  dropped after ``HEARTBEAT_TIMEOUT_S``, which releases what it pinned.

Rejections are counted in ``served`` and logged at most once per
``REJECTION_LOG_INTERVAL_S`` per reason; :meth:`WeightPublisher.stats` reports
every counter for the learner's metrics. A chunk request for a version the
store dropped is answered ``WeightsGone`` (``served["version_gone"]``).
"""

from __future__ import annotations

import logging
import threading
import time
import zlib
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING

import zmq

from asyncrl.core.connection_guard import GAUGES, ConnectionGuard
from asyncrl.core.messages import (
    ArraySpec,
    ErrorReply,
    WeightsChunk,
    WeightsChunkRequest,
    WeightsGone,
    WeightsRequest,
    WeightsUpToDate,
    WireError,
    decode,
    encode,
    encode_raw,
)
from asyncrl.core.security import peer_role, secure_server
from asyncrl.weights.layout import DEFAULT_CHUNK_BYTES
from asyncrl.weights.snapshot import Handle, NamedTensors, Snapshot, SnapshotStore
from asyncrl.weights.zmq.limits import (
    HEARTBEAT_INTERVAL_S,
    HEARTBEAT_TIMEOUT_S,
    RECEIVE_HWM,
    REJECTION_LOG_INTERVAL_S,
    REQUEST_MAX_BYTES,
    SEND_HWM,
    SERVED_ROLES,
    RateLimitedLog,
    guard_limits,
)
from asyncrl.weights.zmq.peers import ChunkScheduler

if TYPE_CHECKING:
    from asyncrl.config import ClusterConfig

log = logging.getLogger("asyncrl.weights")

_WAITING_POLL_MS = 2
"""How often the server thread looks for drained chunk replies while requests wait."""
_RECEIVE_BATCH = 256
"""Requests handled in a row before waiting requests get a turn."""
_DETAIL_CHARS = 200
"""An error reply's detail, and a log line's, is cut to this many characters."""
_MORE = zmq.SNDMORE | zmq.NOBLOCK


class WeightPublisher:
    """Snapshots the learner's weights per version and serves them in chunks from a thread."""

    def __init__(
        self,
        endpoint: str,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        cluster: ClusterConfig | None = None,
        *,
        replicas: int = 1,
    ):
        """With ``cluster`` (the run's ``config.cluster``) serve only the run's authenticated
        peers; without it any peer (tests and benchmarks on a trusted machine). ``replicas``:
        the run's generator replicas, whom the connections in handshake are sized for."""
        self.served: Counter[str] = Counter()
        self.snapshots = SnapshotStore(chunk_bytes, self.served)
        self.endpoint = endpoint
        self.before_manifest: Callable[[], None] | None = None
        """Called on the server thread before each manifest request is answered: a sink
        that snapshots lazily (``ShmPublisher``) brings the store up to date there."""
        self._stop = threading.Event()
        self._chunks = ChunkScheduler(self._send_chunk_or_refuse, self._reject, self.served)
        self._rejections = RateLimitedLog(REJECTION_LOG_INTERVAL_S)
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.SNDHWM, SEND_HWM)
        self._socket.setsockopt(zmq.RCVHWM, RECEIVE_HWM)
        # every send is NOBLOCK, so a peer at its SNDHWM (or gone) fails the send at once:
        # the reply is dropped and counted, the server thread never waits for a peer
        self._socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._socket.setsockopt(zmq.HEARTBEAT_IVL, int(HEARTBEAT_INTERVAL_S * 1000))
        self._socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(HEARTBEAT_TIMEOUT_S * 1000))
        self._auth = secure_server(self._context, self._socket, cluster) if cluster else None
        self._guard = ConnectionGuard(self._socket, guard_limits(replicas), "weights server")
        self._socket.bind(endpoint)
        self._thread = threading.Thread(target=self._serve_loop, name="weights-server", daemon=True)
        self._thread.start()

    @property
    def chunk_bytes(self) -> int:
        return self.snapshots.chunk_bytes

    @property
    def version(self) -> int:
        """The latest published version, -1 before the first."""
        return self.snapshots.version

    @property
    def peak_peer_in_flight(self) -> int:
        """The most chunk replies libzmq held for one peer at once (at most PEER_MAX_CHUNKS)."""
        return self._chunks.peak_peer_in_flight

    # ------------------------------------------------------------------ learner side

    def publish(self, tensors: NamedTensors, version: int, *, copy: bool = True) -> float:
        """Snapshot ``tensors`` as ``version``; the seconds the caller was stalled
        (:meth:`SnapshotStore.publish <asyncrl.weights.snapshot.SnapshotStore.publish>`)."""
        return self.snapshots.publish(tensors, version, copy=copy)

    # ------------------------------------------------------------------ server thread

    def _serve_loop(self) -> None:
        chunks = self._chunks
        settled = time.monotonic()
        while not self._stop.is_set():
            if self._socket.poll(_WAITING_POLL_MS if chunks.waiting else 100):
                for _ in range(_RECEIVE_BATCH):
                    try:
                        message = self._socket.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    self._guard.received(message)
                    identity, *frames = message
                    self._handle(identity, frames)
            if chunks.waiting:
                chunks.serve_waiting()
            elif chunks.serving and time.monotonic() - settled > 0.1:
                chunks.free_slots(settle=True)  # keeps the served peers (and stats) current
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
            self._chunks.request(key, body)
        else:
            self._reject(key, "unexpected_type", f"weights server got {type(body).__name__}")

    def _manifest_reply(self, have_version: int) -> list:
        if self.before_manifest is not None:
            self.before_manifest()
        latest = self.snapshots.newest()
        if latest is None or latest.version <= have_version:
            self.served["up_to_date"] += 1
            return encode(WeightsUpToDate(-1 if latest is None else latest.version))
        self.served["manifests_sent"] += 1
        return latest.manifest_frames

    def _send_chunk_or_refuse(
        self, identity: bytes, request: WeightsChunkRequest
    ) -> zmq.MessageTracker | None:
        """:meth:`_send_chunk`, answering a bad request or a server bug with an ErrorReply."""
        try:
            return self._send_chunk(identity, request)
        except WireError as error:
            self._reject(identity, error.reason, str(error))
        except Exception:
            self._internal_error(identity)
        return None

    def _send_chunk(
        self, identity: bytes, request: WeightsChunkRequest
    ) -> zmq.MessageTracker | None:
        """Send chunk ``request.index`` (or WeightsGone); the tracker of its last frame."""
        snapshot, latest = self.snapshots.checkout(request.version, request.index)
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
            sent: list[tuple[int, Handle]] = [
                (i, t) for i, t in zip(tensors, trackers, strict=False) if not t.done
            ]
            self.snapshots.release(snapshot, sent)
        return trackers[-1]

    def _chunk_message(
        self, snapshot: Snapshot, index: int
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
        authentication is on, the connection guard's ``weights_connections_<counter>_total``
        and its gauges, and the peers being served or waiting now."""
        served = dict(self.served)  # one C-level copy: the server thread keeps counting
        stats = {f"weights_{name}_total": float(count) for name, count in served.items()}
        if self._auth is not None:
            stats["weights_refused_auth_total"] = float(self._auth.refused)
        for name, count in self._guard.stats().items():
            suffix = "" if name in GAUGES else "_total"
            stats[f"weights_connections_{name}{suffix}"] = float(count)
        stats["weights_peers_served"] = float(len(self._chunks.serving))
        stats["weights_peers_waiting"] = float(len(self._chunks.waiting))
        return stats

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._guard.stop()
        self._socket.close(linger=0)
        if self._auth is not None:
            self._auth.stop()  # before term(), which waits for the ZAP handler's sockets
        self._context.term()
