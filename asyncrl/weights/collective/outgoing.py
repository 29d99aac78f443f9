"""What the learner broadcasts to a member: the shared-memory slot, followed, or a snapshot.

The learner's rank 0 writes each version once, into the shared-memory slot
(``shm/writer.py``). The broadcast sends from there (:class:`SlotVersion`):
each bucket is a byte range of the slot, sent as it is, with no packing copy,
and while the learner is still writing a version whose layout it announced,
each piece of a bucket goes the moment the writer's progress (bytes written)
has passed its last byte.
So the broadcast runs beside the learner's write instead of after it, and
after no second copy into the ZeroMQ snapshot. The learner may rewrite the
slot meanwhile (two publishes during one send): the seqlock counter, read
again after the last bucket, gives the verdict the receiver waits for.

Where there is no slot to send (no segment yet, a retired one, a version the
slot no longer holds) the ZeroMQ snapshot is sent (:class:`SnapshotVersion`),
packed bucket by bucket as before; its verdict is always intact (the snapshot
is checked out for the whole send).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Protocol

import torch

from asyncrl.weights.collective.buckets import (
    FIRST_PIECE,
    Bucket,
    in_pieces,
    plan_buckets,
    plan_slot_buckets,
)
from asyncrl.weights.shm.reader import FOLLOW_POLL_S, ShmSource, Slot
from asyncrl.weights.shm.segment import PLAN_BROKEN
from asyncrl.weights.snapshot import Snapshot, SnapshotStore
from asyncrl.weights.source import PathUnavailable, WeightTransferError

Stage = Callable[[int], torch.Tensor]
"""A staging buffer of at least that many bytes on the member's device."""


class Outgoing(Protocol):
    """One version on its way to one member."""

    version: int
    published_at: float
    buckets: tuple[Bucket, ...]

    def piece(
        self, number: int, start: int, end: int, deadline: float, stage: Stage
    ) -> torch.Tensor:
        """Bytes ``[start, end)`` of bucket ``number`` (uint8, flat) once they may be sent;
        asked for in order."""
        ...

    def intact(self, deadline: float) -> bool:
        """After the last bucket: every byte sent was this version's."""
        ...

    def release(self) -> None: ...


class SlotVersion:
    """A version in the shared-memory slot: complete, or being written as announced."""

    def __init__(self, slots: ShmSource, slot: Slot, following: bool, bucket_bytes: int):
        self.slots = slots
        self.slot = slot
        self.following = following
        self.version = slot.version
        self.published_at = slot.published_at or time.time()  # a write in progress: now
        self._plan = plan_slot_buckets(slots.index(slot), bucket_bytes, FIRST_PIECE)
        self.buckets = tuple(bucket for bucket, _ in self._plan)

    def piece(
        self, number: int, start: int, end: int, deadline: float, stage: Stage
    ) -> torch.Tensor:
        at = self._plan[number][1]
        if self.following:
            why = f"v{self.version}'s write did not reach bucket {number}"
            _wait_until(functools.partial(self._written, at + end), deadline, why)
        return self.slots.data(self.slot, at + start, end - start)

    def _written(self, nbytes: int) -> bool:
        """The write has passed byte ``nbytes`` of the data, or will not as announced (then
        the bytes go as they are, and the verdict says so)."""
        progress = self.slots.progress(self.slot)
        return progress >= nbytes or not self.slots.on_plan(self.slot, progress)

    def intact(self, deadline: float) -> bool:
        slots, slot = self.slots, self.slot
        if not self.following:
            return slots.seq(slot) == slot.seq
        # sent all: wait for the write's last bytes
        why = f"v{self.version}'s write did not complete"
        _wait_until(lambda: slots.seq(slot) != slot.seq, deadline, why)
        # the write completed as announced, and nothing has overwritten it since
        return slots.seq(slot) == slot.seq + 1 and slots.progress(slot) != PLAN_BROKEN

    def release(self) -> None:
        pass


def _wait_until(done: Callable[[], bool], deadline: float, why: str) -> None:
    """Poll the learner's write until ``done``; past ``deadline``, TimeoutError(``why``)."""
    while not done():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{why} in time")
        time.sleep(FOLLOW_POLL_S)


class SnapshotVersion:
    """A version in the ZeroMQ server's host snapshot, checked out for the send."""

    def __init__(self, store: SnapshotStore, snapshot: Snapshot, bucket_bytes: int):
        self.store = store
        self.snapshot = snapshot
        self.version = snapshot.version
        self.published_at = snapshot.published_at
        self._plan = plan_buckets(snapshot.tensors, bucket_bytes)
        self.buckets = tuple(in_pieces([b for b, _ in self._plan], bucket_bytes, FIRST_PIECE))
        self._packed: tuple[int, torch.Tensor] | None = None

    def piece(
        self, number: int, start: int, end: int, deadline: float, stage: Stage
    ) -> torch.Tensor:
        """One tensor: the snapshot's buffer itself; several: packed into staging (once,
        at the bucket's first piece)."""
        bucket, indices = self._plan[number]
        buffers = self.snapshot.buffers
        if len(indices) == 1:
            return buffers[indices[0]].reshape(-1).view(torch.uint8)[start:end]
        if self._packed is None or self._packed[0] != number:
            flat = stage(bucket.nbytes)[: bucket.nbytes]
            for tensor, index in zip(bucket.tensors, indices, strict=True):
                source = buffers[index].reshape(-1).view(torch.uint8)
                flat[tensor.offset : tensor.offset + source.numel()].copy_(
                    source, non_blocking=True
                )
            self._packed = (number, flat)
        return self._packed[1][start:end]

    def intact(self, deadline: float) -> bool:
        return True

    def release(self) -> None:
        self.store.release(self.snapshot, [])


def newest_in_slots(slots: ShmSource, have_version: int, bucket_bytes: int) -> Outgoing | None:
    """The newest version in shared memory newer than ``have_version``, as the replicas'
    shm path would read it: a complete slot, else a write in progress to follow; None when
    the segment has nothing newer (or there is no segment)."""
    try:
        slots.ensure_mapped()
        newest = slots.newest()
        if newest is not None and newest.version > have_version:
            return SlotVersion(slots, newest, False, bucket_bytes)
        announced = slots.announced(have_version)
        if announced is not None:
            outgoing = SlotVersion(slots, announced, True, bucket_bytes)
            if slots.on_plan(announced):  # the plan read is this write's
                return outgoing
    except (PathUnavailable, WeightTransferError):
        return None
    return None


def newest_in_snapshots(
    store: SnapshotStore, have_version: int, bucket_bytes: int
) -> Outgoing | int:
    """The newest snapshot newer than ``have_version``, checked out; else the newest
    version there is (-1: none)."""
    for _ in range(3):  # a version may be recycled between newest() and checkout()
        newest = store.newest()
        if newest is None or newest.version <= have_version or not newest.pieces:
            return -1 if newest is None else newest.version
        snapshot, _ = store.checkout(newest.version, 0)
        if snapshot is not None:
            return SnapshotVersion(store, snapshot, bucket_bytes)
    return -1
