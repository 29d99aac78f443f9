"""A generator's side of the weights transfer over ZeroMQ: fetch, check, rebuild.

The client (a DEALER) asks the publisher's server for weights newer than the
ones it holds, receives the manifest (the tensor index, checked for
consistency when it is decoded), then keeps ``window`` chunk requests in
flight and checks each chunk before using it: its version and index, its
pieces against the ones the index implies, its crc32. At the end it checks that
every tensor of the index got all of its bytes. Any failure raises
:class:`WireError` naming the chunk and the tensors concerned. Holding at most
``window`` chunks beyond the tensors it is filling, a fetch costs little more
memory than the weights themselves.

A version dropped by the publisher mid-transfer (two newer ones published) is
answered ``WeightsGone``: the client starts over with the newest
(``stats["restarts"]``), so it always ends with one consistent version.
"""

from __future__ import annotations

import logging
import math
import time
import zlib
from collections import Counter
from collections.abc import Callable

import numpy as np
import torch
import zmq

from asyncrl.core.messages import (
    ErrorReply,
    WeightsChunk,
    WeightsChunkRequest,
    WeightsGone,
    WeightsManifest,
    WeightsRequest,
    WeightsUpToDate,
    WireError,
    decode,
    encode,
)
from asyncrl.core.transport import client_socket
from asyncrl.weights.layout import FROM_NAME, chunk_pieces, describe_pieces
from asyncrl.weights.zmq.limits import MAX_WINDOW

log = logging.getLogger("asyncrl.weights")

SLOW_REPLY_MS = 1000
"""A client told to (``on_wait``) says it is waiting on the publisher after this long."""


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
        names = describe_pieces(self.manifest.tensors, self.pieces[index])
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
        self.deadline: float | None = None
        """A ``time.monotonic()`` instant no reply is waited for past (set by the caller
        for one fetch: the weight-sync deadline); None: ``timeout_s`` per reply only."""
        self.screen: Callable[[WeightsManifest], bool] | None = None
        """Asked about the manifest before any chunk is requested (set by the caller for
        one fetch): False ends the fetch with nothing fetched (a version the caller refused
        already); it may raise to refuse the version (a layout not the engine's)."""
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
        if self.deadline is not None:
            timeout_ms = min(
                timeout_ms, max(0, math.ceil((self.deadline - time.monotonic()) * 1000))
            )
        if self.on_wait is not None and not self.socket.poll(min(SLOW_REPLY_MS, timeout_ms)):
            self.on_wait()
            timeout_ms -= SLOW_REPLY_MS
        if timeout_ms <= 0 or not self.socket.poll(timeout_ms):
            if self.deadline is not None and time.monotonic() >= self.deadline:
                raise TimeoutError(f"no reply from {self.endpoint} before the deadline")
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
        if self.screen is not None and not self.screen(body):
            return None
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
