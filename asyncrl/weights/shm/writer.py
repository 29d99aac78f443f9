"""The learner's end of the shared-memory path: each version written once into a slot.

:class:`ShmWriter` creates the segment (``shm/segment.py`` describes it) at the first
publish, sized for that version, and records its name in ``RUN_DIR/weights_shm``.
Each later publish streams the tensors, one at a time as the learner gathers
them, straight into the older slot: one memory copy, the learner's whole stall
on this path. It first announces the layout of the version before (``shm/segment.py``:
the plan) and marks its progress in bytes after each tensor and every
``WRITE_PIECE`` bytes within a large one, so replicas may load the
tensors already written while the rest are (``shm/reader.py``). A version
that no longer fits (a model that grew) retires the segment: readers fall back
to ZeroMQ, which still gets the version.

A segment left by a crashed learner is removed when the next learner of the
same run dir starts (its name is in the run dir); :meth:`close` removes it on a
clean exit.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import secrets
import time
from collections import Counter
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

from asyncrl.core.messages import TensorEntry
from asyncrl.weights.layout import FROM_NAME, TORCH_DTYPES
from asyncrl.weights.shm.segment import (
    ALIGN,
    FORMAT,
    HEADER,
    INDEX_ENCODER,
    MAGIC,
    PAGE,
    PLAN_BROKEN,
    PLAN_SEQ_OFFSET,
    POINTER_FILE,
    PROGRESS_OFFSET,
    RETIRED_OFFSET,
    SHM_DIR,
    SLOT_HEADER,
    SLOT_HEADER_BYTES,
    SLOTS,
    WRITE_PIECE,
    aligned_layout,
    data_nbytes,
    read_pointer,
    round_up,
    write_u64,
)
from asyncrl.weights.snapshot import NamedTensors

log = logging.getLogger("asyncrl.weights")

INDEX_HEADROOM = 64 << 10
"""Index bytes reserved beyond the first version's (names may grow a little)."""


class _Outgrown(Exception):
    """A version does not fit the slots sized for the first one."""


class ShmWriter:
    """Writes published versions into a shared-memory segment named in the run dir."""

    def __init__(self, run_dir: Path, shm_dir: Path = SHM_DIR):
        self.run_dir = run_dir
        self.shm_dir = shm_dir
        self.name: str | None = None
        self.retired = False
        self.counters: Counter[str] = Counter()
        self._map: mmap.mmap | None = None
        self._fd: int | None = None
        self._slot_bytes = 0
        self._index_cap = 0
        self._data_at = 0
        self._data_cap = 0
        self._next_slot = 0
        self._seq = [0] * SLOTS
        self._plan: list[TensorEntry] = []  # the last complete version's layout
        remove_leftover(run_dir, shm_dir)

    @property
    def ready(self) -> bool:
        """A segment exists and takes new versions."""
        return self._map is not None and not self.retired

    def create(self, layout: list[TensorEntry]) -> bool:
        """Create the segment for versions laid out like ``layout``; False (logged) when
        /dev/shm cannot hold it: the run goes on over ZeroMQ."""
        entries = aligned_layout([(t.name, t.dtype, tuple(t.shape)) for t in layout])
        self._index_cap = len(_encode_index(entries)) * 2 + INDEX_HEADROOM
        self._data_at = round_up(SLOT_HEADER_BYTES + self._index_cap, PAGE)
        self._data_cap = round_up(max(data_nbytes(entries), 1), PAGE)
        self._slot_bytes = self._data_at + self._data_cap
        size = PAGE + SLOTS * self._slot_bytes
        name = f"asyncrl-{secrets.token_hex(16)}"
        path = self.shm_dir / name
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except OSError as error:
            log.warning("no shared-memory weights (%s): replicas use ZeroMQ", error)
            self.retired = True
            return False
        try:
            os.fchmod(fd, 0o600)
            os.posix_fallocate(fd, 0, size)  # ENOSPC now, not SIGBUS on a later write
            self._map = mmap.mmap(fd, size)
        except OSError as error:
            os.close(fd)
            path.unlink(missing_ok=True)
            log.warning("no shared-memory weights (%s, %d bytes): replicas use ZeroMQ", error, size)
            self.retired = True
            return False
        self._fd, self.name = fd, name
        HEADER.pack_into(self._map, 0, MAGIC, FORMAT, SLOTS, self._slot_bytes, 0)
        _write_pointer(self.run_dir, name)
        log.info("weights shared in memory: %s (%.1f MiB)", path, size / 2**20)
        return True

    def publish(self, tensors: NamedTensors, version: int) -> list[tuple[str, torch.Tensor]]:
        """Write ``tensors`` (consumed once) as ``version`` into the older slot; returns the
        ``(name, view)`` pairs written, valid until the publish after next reuses the slot.

        A version that does not fit retires the segment; the tensors not yet written are
        then copied to host memory and returned too, so the caller can still serve them.
        """
        assert self._map is not None and not self.retired
        slot = self._next_slot
        start = PAGE + slot * self._slot_bytes
        self._seq[slot] += 1  # odd: readers skip or discard this slot, or follow the plan
        seq = self._seq[slot]
        write_u64(self._map, start, seq)
        self._announce(start, seq, version)
        items = iter(tensors.items() if isinstance(tensors, Mapping) else tensors)
        written: list[tuple[str, torch.Tensor]] = []
        entries: list[TensorEntry] = []
        try:
            self._write_tensors(items, start, written, entries)
            index = _encode_index(entries)
            if len(index) > self._index_cap:
                raise _Outgrown(
                    f"its index is {len(index)} bytes, the slots hold {self._index_cap}"
                )
        except _Outgrown as error:
            self._break_plan(start)
            self.retire(f"v{version} does not fit the shared-memory slots: {error}")
            return written + [(name, _host_copy(name, t)) for name, t in items]
        kept_plan = entries == self._plan
        if not kept_plan:
            self._break_plan(start)  # fewer tensors than announced
        index_at = start + SLOT_HEADER_BYTES
        self._map[index_at : index_at + len(index)] = index
        end = data_nbytes(entries)
        # fields first, the counter last (struct writes go out in order on x86-64)
        SLOT_HEADER.pack_into(
            self._map,
            start,
            seq,
            version,
            time.time(),
            len(index),
            self._data_at,
            end,
            seq if kept_plan else 0,
            end if kept_plan else PLAN_BROKEN,  # progress: every byte written
        )
        self._seq[slot] += 1  # even: complete
        write_u64(self._map, start, self._seq[slot])
        self._plan = entries
        self._next_slot = (slot + 1) % SLOTS
        self.counters["shm_published"] += 1
        return written

    def _announce(self, start: int, seq: int, version: int) -> None:
        """Put the last version's layout in the slot as this write's plan, then mark the plan
        as this write's (``plan_seq``): readers may follow from here on."""
        assert self._map is not None
        index = _encode_index(self._plan) if self._plan else b""
        fits = 0 < len(index) <= self._index_cap
        if fits:
            index_at = start + SLOT_HEADER_BYTES
            self._map[index_at : index_at + len(index)] = index
        SLOT_HEADER.pack_into(
            self._map,
            start,
            seq,
            version,
            0.0,
            len(index) if fits else 0,
            self._data_at,
            data_nbytes(self._plan) if fits else 0,
            0,
            0 if fits else PLAN_BROKEN,
        )
        if fits:
            write_u64(self._map, start + PLAN_SEQ_OFFSET, seq)
        else:
            self._plan = []

    def _break_plan(self, start: int) -> None:
        """Tell followers this write left its plan: they read the slot once complete."""
        assert self._map is not None
        write_u64(self._map, start + PROGRESS_OFFSET, PLAN_BROKEN)
        self._plan = []

    def _write_tensors(
        self,
        items: Iterator[tuple[str, torch.Tensor]],
        start: int,
        written: list[tuple[str, torch.Tensor]],
        entries: list[TensorEntry],
    ) -> None:
        assert self._map is not None
        offset = 0
        names: set[str] = set()
        plan = self._plan
        for name, tensor in items:
            if name in names:
                raise ValueError(f"tensor '{name}' is published twice")
            names.add(name)
            dtype = _dtype_name(name, tensor)
            nbytes = tensor.numel() * tensor.element_size()
            if offset + nbytes > self._data_cap:
                written.append((name, _host_copy(name, tensor)))
                raise _Outgrown(f"tensor '{name}' ends past {self._data_cap} bytes")
            entry = TensorEntry(name, dtype, tuple(tensor.shape), offset, nbytes)
            if plan and (len(entries) >= len(plan) or plan[len(entries)] != entry):
                self._break_plan(start)
                plan = []
            view = torch.frombuffer(
                self._map, dtype=torch.uint8, count=nbytes, offset=start + self._data_at + offset
            ) if nbytes else torch.empty(0, dtype=torch.uint8)  # fmt: skip
            view = view.view(FROM_NAME[dtype]).reshape(tensor.shape)
            if plan and nbytes > WRITE_PIECE:
                self._copy_in_pieces(view, tensor.detach(), start, offset)
            else:
                view.copy_(tensor.detach())
            written.append((name, view))
            entries.append(entry)
            if plan:  # after the bytes: a follower may load this tensor now
                write_u64(self._map, start + PROGRESS_OFFSET, offset + nbytes)
            offset = round_up(offset + nbytes, ALIGN)

    def _copy_in_pieces(
        self, view: torch.Tensor, tensor: torch.Tensor, start: int, offset: int
    ) -> None:
        """Copy a large tensor :data:`WRITE_PIECE` bytes at a time, marking the progress after
        each piece: a follower may send its first bytes while the rest are written."""
        assert self._map is not None
        target, source = view.reshape(-1), tensor.reshape(-1)
        itemsize = view.element_size()
        step = max(WRITE_PIECE // itemsize, 1)
        for first in range(0, target.numel(), step):
            last = min(first + step, target.numel())
            target[first:last].copy_(source[first:last])
            write_u64(self._map, start + PROGRESS_OFFSET, offset + last * itemsize)

    def retire(self, why: str) -> None:
        """Tell readers to stop reading here (they fall back to ZeroMQ)."""
        if self._map is not None and not self.retired:
            self._map[RETIRED_OFFSET : RETIRED_OFFSET + 8] = (1).to_bytes(8, "little")
            log.warning("shared-memory weights retired: %s; replicas use ZeroMQ", why)
            self.counters["shm_retired"] += 1
        self.retired = True

    def close(self) -> None:
        """Retire, unmap and remove the segment and its record in the run dir."""
        if self._map is None:
            return
        if not self.retired:
            self._map[RETIRED_OFFSET : RETIRED_OFFSET + 8] = (1).to_bytes(8, "little")
            self.retired = True
        # views still held somewhere: the mapping goes with the process
        with contextlib.suppress(BufferError):
            self._map.close()
        self._map = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self.name is not None:
            (self.shm_dir / self.name).unlink(missing_ok=True)
            if read_pointer(self.run_dir) == self.name:
                (self.run_dir / POINTER_FILE).unlink(missing_ok=True)


def _dtype_name(name: str, tensor: torch.Tensor) -> str:
    if hasattr(tensor, "full_tensor"):  # a DTensor shard: gathering is the caller's
        raise TypeError(f"tensor '{name}' is sharded: publish tensor.full_tensor()")
    dtype = TORCH_DTYPES.get(tensor.dtype)
    if dtype is None:
        raise ValueError(f"tensor '{name}' has unsupported dtype {tensor.dtype}")
    return dtype


def _host_copy(name: str, tensor: torch.Tensor) -> torch.Tensor:
    _dtype_name(name, tensor)
    return tensor.detach().to("cpu", copy=True).contiguous()


def _encode_index(entries: list[TensorEntry]) -> bytes:
    return INDEX_ENCODER.encode(entries)


def _write_pointer(run_dir: Path, name: str) -> None:
    """Record the segment's name in the run dir (owner-only, replaced atomically)."""
    temporary = run_dir / f".{POINTER_FILE}.tmp"
    temporary.unlink(missing_ok=True)
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as file:
        file.write(name + "\n")
    os.replace(temporary, run_dir / POINTER_FILE)


def remove_leftover(run_dir: Path, shm_dir: Path = SHM_DIR) -> None:
    """Remove the segment an earlier learner of ``run_dir`` left (it crashed), if it is this
    user's, and its record."""
    name = read_pointer(run_dir)
    if name is None:
        return
    path = shm_dir / name
    try:
        info = path.lstat()
    except FileNotFoundError:
        info = None
    if info is not None and info.st_uid == os.geteuid():
        path.unlink(missing_ok=True)
        log.info("removed %s, the weights segment an earlier learner of %s left", path, run_dir)
    (run_dir / POINTER_FILE).unlink(missing_ok=True)
