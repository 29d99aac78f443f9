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
from collections import Counter
from collections.abc import Iterable, Mapping

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
from asyncrl.security import CurveKeys, secure_server
from asyncrl.transport import client_socket

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
REQUEST_MAX_BYTES = 64 << 10

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
        self.trackers: list[zmq.MessageTracker] = []  # zero-copy frames zmq may still read

    def idle(self) -> bool:
        """True when nothing reads the buffers any more, so they can be overwritten."""
        return self.readers == 0 and all(tracker.done for tracker in self.trackers)


class WeightPublisher:
    """Snapshots the learner's weights per version and serves them in chunks from a thread."""

    def __init__(
        self,
        endpoint: str,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        curve: CurveKeys | None = None,
    ):
        """With ``curve`` (``security.curve_keys(config.cluster)``) serve only the run's clients."""
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
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._auth = secure_server(self._context, self._socket, curve) if curve else None
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
            reusable = copy and recycled is not None and recycled.idle()
        pool = recycled.buffers if reusable else []
        if recycled is not None and copy and not pool:
            self.served["snapshot_not_reused"] += 1
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
        while not self._stop.is_set():
            if not self._socket.poll(100):
                continue
            while True:
                try:
                    identity, *frames = self._socket.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                try:
                    self._answer(identity, frames)
                except Exception:  # a bug must not silence the server for every generator
                    log.exception("weights server failed to answer a request")
                    self.served["server_errors"] += 1
                    self._reply(identity, encode(ErrorReply("internal", "see the learner's log")))

    def _reply(self, identity, frames: list) -> None:
        self._socket.send_multipart([identity, *frames], copy=False)

    def _answer(self, identity, frames: list) -> None:
        try:
            body, arrays = decode(frames, max_bytes=REQUEST_MAX_BYTES)
            if arrays:
                raise WireError("bad_array", "weights requests carry no arrays")
            if isinstance(body, WeightsRequest):
                self._reply(identity, self._manifest_reply(body.have_version))
            elif isinstance(body, WeightsChunkRequest):
                self._send_chunk(identity, body)
            else:
                raise WireError("unexpected_type", f"weights server got {type(body).__name__}")
        except WireError as error:
            self.served[f"rejected_{error.reason}"] += 1
            self._reply(identity, encode(ErrorReply(error.reason, str(error))))

    def _manifest_reply(self, have_version: int) -> list:
        with self._lock:
            latest = self._latest
        if latest is None or latest.version <= have_version:
            self.served["up_to_date"] += 1
            return encode(WeightsUpToDate(-1 if latest is None else latest.version))
        self.served["manifests_sent"] += 1
        return latest.manifest_frames

    def _send_chunk(self, identity, request: WeightsChunkRequest) -> None:
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
            return
        trackers = []
        try:
            body, specs, views = self._chunk_message(snapshot, request.index)
            frames = encode_raw(body, specs, views)
            self.served["chunks_sent"] += 1  # counted first: the client may be done at once
            self.served["bytes_sent"] += sum(view.nbytes for view in views)
            if request.index == len(snapshot.pieces) - 1:
                self.served["transfers_finished"] += 1
            self._socket.send(identity, zmq.SNDMORE, copy=False)
            for frame in frames[:-1]:
                trackers.append(self._socket.send(frame, zmq.SNDMORE, copy=False, track=True))
            trackers.append(self._socket.send(frames[-1], copy=False, track=True))
        finally:
            with self._lock:
                snapshot.readers -= 1
                pending = [t for t in snapshot.trackers if not t.done]
                snapshot.trackers = pending + [t for t in trackers if t is not None]

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

    ``window`` chunk requests are kept in flight. A fetch whose version the
    publisher dropped meanwhile starts over with the latest, at most
    ``max_restarts`` times; after that it gives up (returns None, counted in
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
    ):
        if window < 1:
            raise ValueError(f"window must be at least 1, got {window}")
        self.context = context
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self.window = window
        self.max_restarts = max_restarts
        self.reuse_buffers = reuse_buffers
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
        if not self.socket.poll(int(self.timeout_s * 1000)):
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
