"""Host snapshots of the learner's weights: the latest version and the one before it.

Publishing. Every ``sync_interval`` versions the learner calls
:meth:`SnapshotStore.publish` with a dict or any iterable of ``(name, tensor)``
pairs, e.g. a generator that gathers one parameter at a time with
``DTensor.full_tensor()``, so the full model never exists twice on the learner's
device. ``publish`` copies each tensor into a host snapshot and returns the
seconds that took: the learner's only stall, reported as
``time_publish_stall_s``. When the tensor shapes repeat (they do, step after
step) the copy goes into the buffers of the snapshot two versions back, so a
steady-state publish is a memory copy into warm memory, not a fresh allocation.

Versions in flight. The store keeps two snapshots: the latest and the one
before it. A reader that began on version ``v`` finishes ``v`` as long as at
most one newer version is published meanwhile. When a second one is, ``v``'s
buffers are recycled for the newest and :meth:`SnapshotStore.checkout` no
longer finds ``v``: its readers are told it is gone and start over with the
newest. The publisher therefore never holds more than two snapshots.

Nothing here depends on how the snapshots are served: a server checks a chunk
out, sends it, and hands back what the transport still reads
(:meth:`SnapshotStore.release`), so buffers a peer still reads are never
overwritten.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Protocol

import torch

from asyncrl.core.messages import TensorEntry, WeightsManifest, WireError, encode
from asyncrl.weights.layout import TORCH_DTYPES, byte_view, chunk_pieces

NamedTensors = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]
"""A state dict, or ``(name, tensor)`` pairs produced one at a time."""


class Handle(Protocol):
    """What a transport keeps for bytes it may still read (a ``zmq.MessageTracker``)."""

    @property
    def done(self) -> bool: ...


class Snapshot:
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
        self.published_at = published_at
        self.tensors = tensors
        self.buffers = buffers
        self.pieces = chunk_pieces(tensors, chunk_bytes)
        total = sum(entry.nbytes for entry in tensors)
        manifest = WeightsManifest(
            version, published_at, chunk_bytes, total, len(self.pieces), tensors
        )
        self.manifest_frames = encode(manifest)
        self.views = [
            byte_view(buffer) if entry.nbytes else memoryview(b"")
            for entry, buffer in zip(tensors, buffers, strict=True)
        ]
        self.crcs: dict[int, int] = {}  # chunk -> crc32, computed when first served
        self.readers = 0  # server replies being built from these buffers
        self.index = {entry.name: index for index, entry in enumerate(tensors)}
        self.held: list[tuple[int, Handle]] = []
        """``(tensor index, tracker)`` of the zero-copy frames a transport may still read."""

    @property
    def trackers(self) -> list[Handle]:
        return [tracker for _, tracker in self.held]

    def idle(self) -> bool:
        """True when nothing reads the buffers any more, so they can be overwritten."""
        return self.readers == 0 and all(tracker.done for _, tracker in self.held)

    def reusable_buffers(self) -> list[torch.Tensor | None]:
        """Its buffers, each None while a transport may still read it (call with no reply
        being built): a peer slow to read pins only the tensors of the chunks it was sent."""
        held = {index for index, tracker in self.held if not tracker.done}
        return [None if index in held else buffer for index, buffer in enumerate(self.buffers)]


class SnapshotStore:
    """The latest two versions, published by the learner and read by a server thread."""

    def __init__(self, chunk_bytes: int, counters: Counter[str]):
        """``counters`` is the publisher's ``served``: ``published``, ``snapshot_not_reused``."""
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
        self.chunk_bytes = chunk_bytes
        self.counters = counters
        self.version = -1
        self.latest: Snapshot | None = None
        self.previous: Snapshot | None = None
        self.lock = threading.Lock()

    def publish(
        self,
        tensors: NamedTensors,
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
        with self.lock:
            if version <= self.version:
                raise ValueError(f"version {version} is not newer than {self.version}")
            recycled, self.previous = self.previous, None  # its late readers get WeightsGone
            pool: list[torch.Tensor | None] = []
            if copy and recycled is not None and recycled.readers == 0:
                pool = recycled.reusable_buffers()
        if recycled is not None and copy and (not pool or any(b is None for b in pool)):
            self.counters["snapshot_not_reused"] += 1  # all of it, or the tensors zmq holds
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
        snapshot = Snapshot(version, time.time(), entries, buffers, self.chunk_bytes)
        with self.lock:
            self.previous, self.latest = self.latest, snapshot
            self.version = version
        self.counters["published"] += 1
        return time.perf_counter() - start

    def newest(self) -> Snapshot | None:
        """The latest snapshot, None before the first publish."""
        with self.lock:
            return self.latest

    def checkout(self, version: int, chunk: int) -> tuple[Snapshot | None, int]:
        """``(snapshot, latest version)``: the snapshot of ``version`` with one more reader,
        so its buffers are not recycled until :meth:`release`, or None when it is gone.
        Raises WireError when it has no chunk ``chunk``."""
        with self.lock:
            snapshot = next(
                (s for s in (self.latest, self.previous) if s is not None and s.version == version),
                None,
            )
            if snapshot is not None:
                if not 0 <= chunk < len(snapshot.pieces):
                    raise WireError(
                        "bad_request",
                        f"version {version} has {len(snapshot.pieces)} chunks, no chunk {chunk}",
                    )
                snapshot.readers += 1
            return snapshot, self.version

    def release(self, snapshot: Snapshot, sent: list[tuple[int, Handle]]) -> None:
        """One reader less; ``sent``: ``(tensor index, tracker)`` of what the transport may
        still read, which keeps those buffers from reuse until their trackers are done."""
        with self.lock:
            snapshot.readers -= 1
            snapshot.held = [(i, t) for i, t in snapshot.held if not t.done] + sent
