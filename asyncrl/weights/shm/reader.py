"""A replica's end of the shared-memory path: load the newest complete slot in place.

:class:`ShmSource` maps the segment the run dir names (read-only, after checking
it is this user's and owner-only), picks the newest slot whose seqlock counter
is even, checks its index against the slot's bounds, hands the engine
zero-copy views of the slot, and reads the counter again once the engine has
copied them. A changed counter means the learner rewrote the slot meanwhile
(two publishes during one load): the load is discarded and retried once with
the then newest slot; a second overlap raises ``WeightTransferError(partial=True)``
since the engine may hold a mix. A learner that restarted writes a new segment
and a new record in the run dir: the source notices the record changed and maps
the new one.

When no complete slot is newer than the engine's version but the learner is
writing one whose layout it announced, and the engine loads in parts
(``load_weights_in_parts``, the HF backend), the source *follows* the write:
it hands the engine each tensor as soon as the writer's progress (bytes
written) passes its end, so the replica's copy runs beside the learner's instead of after
it. The load counts once the slot's counter says that very write completed;
a write that left its plan or was overlapped leaves a mix in the engine, and
the newest complete slot is then loaded whole.

Any process of the run's user may write the segment, so nothing of it reaches
the engine unchecked (:mod:`~asyncrl.weights.checks`): a slot whose layout is not the engine's,
or that holds a NaN or an infinity, is refused before the engine is handed a
byte of it (a followed write: each part before it is handed over). A refused
slot is remembered by its write (start and counter), counted and logged once;
the source then loads the other slot when that one is newer than the engine's
version (or the engine holds a mix), else raises ``WeightsRefused`` and the
replica keeps the version it holds. A refused part of a followed write leaves
the parts before it in the engine: the newest complete slot not refused, most
often the version held before, is then loaded whole.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import mmap
import os
import time
import warnings
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import msgspec
import torch

from asyncrl.core.messages import TensorEntry
from asyncrl.weights.checks import (
    LAYOUT,
    NONFINITE,
    EngineLayout,
    Layout,
    Refusals,
    WeightsRefused,
    check_finite,
    check_layout,
    nonfinite,
)
from asyncrl.weights.layout import FROM_NAME
from asyncrl.weights.shm.segment import (
    FOLLOW_WRITES,
    FORMAT,
    HEADER,
    INDEX_DECODER,
    MAGIC,
    MAX_INDEX_BYTES,
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
    check_index,
    check_owner_only,
    read_pointer,
    read_u64,
)
from asyncrl.weights.source import Loaded, PathUnavailable, WeightTransferError

if TYPE_CHECKING:
    from asyncrl.generators.backend import Backend

log = logging.getLogger("asyncrl.weights")

FOLLOW_POLL_S = 0.0001
"""How long a follower sleeps when it has loaded every tensor written so far."""


class _LeftPlan(Exception):
    """The write being followed left its plan, or another write overlapped it."""


class Slot(NamedTuple):
    start: int
    seq: int
    version: int
    published_at: float
    index_nbytes: int
    data_at: int
    data_nbytes: int
    plan_seq: int
    progress: int


class ShmSource:
    """The shared-memory path as a :class:`~asyncrl.weights.source.WeightSource`."""

    name = "shm"

    def __init__(self, run_dir: Path | None, shm_dir: Path = SHM_DIR):
        """``run_dir`` None: a replica with no run dir of the learner's (joined by hand):
        the path is never available."""
        self.run_dir = run_dir
        self.shm_dir = shm_dir
        self.counters: Counter[str] = Counter()
        self._refusals = Refusals(self.counters)
        self._engine_layout = EngineLayout()
        self._map: mmap.mmap | None = None
        self._segment = ""
        self._pointer_stamp: tuple[int, int] | None = None
        self._slot_bytes = 0

    # ------------------------------------------------------------------ mapping

    def _pointer_changed(self) -> bool:
        assert self.run_dir is not None
        try:
            info = os.stat(self.run_dir / POINTER_FILE)
        except OSError:
            return True
        return (info.st_ino, info.st_mtime_ns) != self._pointer_stamp

    def ensure_mapped(self) -> mmap.mmap:
        if self.run_dir is None:
            raise PathUnavailable("shm: this replica has no run dir of the learner's")
        if self._map is not None and (self._retired() or self._pointer_changed()):
            self._unmap()
        if self._map is None:
            self._map = self._attach()
        if self._retired():
            raise PathUnavailable(f"shm: segment {self._segment} is retired by the learner")
        return self._map

    def _attach(self) -> mmap.mmap:
        assert self.run_dir is not None
        try:
            info = os.stat(self.run_dir / POINTER_FILE)
        except OSError:
            raise PathUnavailable("shm: the learner has not shared a segment (yet)") from None
        name = read_pointer(self.run_dir)
        if name is None:
            raise WeightTransferError(f"shm: {self.run_dir / POINTER_FILE} names no segment")
        path = self.shm_dir / name
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError as error:  # the learner is on another host, or gone
            raise PathUnavailable(f"shm: cannot open {path}: {error.strerror}") from None
        try:
            size = check_owner_only(fd, f"shm segment {path}").st_size
            if size < PAGE:
                raise WeightTransferError(f"shm segment {path} is {size} bytes, no header")
            mapped = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
        finally:
            os.close(fd)
        magic, fmt, slots, slot_bytes, _ = HEADER.unpack_from(mapped, 0)
        if magic != MAGIC or fmt != FORMAT or slots != SLOTS or PAGE + slots * slot_bytes != size:
            mapped.close()
            raise WeightTransferError(
                f"shm segment {path}: corrupt header (magic {magic!r}, format {fmt}, "
                f"{slots} slots of {slot_bytes} bytes in {size})"
            )
        self._segment, self._slot_bytes = name, slot_bytes
        self._pointer_stamp = (info.st_ino, info.st_mtime_ns)
        return mapped

    def _retired(self) -> bool:
        assert self._map is not None
        return int.from_bytes(self._map[RETIRED_OFFSET : RETIRED_OFFSET + 8], "little") != 0

    def _unmap(self) -> None:
        if self._map is not None:
            # views still held: the mapping goes when they do
            with contextlib.suppress(BufferError):
                self._map.close()
            self._map = None

    # ------------------------------------------------------------------ reading

    def _slot(self, index: int) -> Slot:
        return self._slot_at(PAGE + index * self._slot_bytes)

    def _slot_at(self, start: int) -> Slot:
        assert self._map is not None
        return Slot(start, *SLOT_HEADER.unpack_from(self._map, start))

    def seq(self, slot: Slot) -> int:
        assert self._map is not None
        return read_u64(self._map, slot.start)

    def newest(self, refused: Refusals | None = None) -> Slot | None:
        """The complete slot (even counter, ever written) with the highest version, of those
        whose write is not among ``refused``."""
        complete = [
            s
            for s in map(self._slot, range(SLOTS))
            if s.seq and s.seq % 2 == 0 and (refused is None or (s.start, s.seq) not in refused)
        ]
        return max(complete, key=lambda s: s.version, default=None)

    def index(self, slot: Slot) -> list[TensorEntry]:
        """The slot's tensor index, checked against the slot's bounds."""
        assert self._map is not None
        where = f"shm v{slot.version}"
        if (
            not 0 <= slot.index_nbytes <= MAX_INDEX_BYTES
            or slot.data_at % PAGE
            or slot.data_at < SLOT_HEADER_BYTES + slot.index_nbytes
            or slot.data_at + slot.data_nbytes > self._slot_bytes
        ):
            raise WeightsRefused(
                f"{where}: corrupt slot header (index {slot.index_nbytes} bytes, data "
                f"{slot.data_nbytes} bytes at {slot.data_at} in a {self._slot_bytes}-byte slot)",
                reason=LAYOUT,
            )
        index_at = slot.start + SLOT_HEADER_BYTES
        try:
            tensors = INDEX_DECODER.decode(self._map[index_at : index_at + slot.index_nbytes])
        except msgspec.MsgspecError as error:
            raise WeightsRefused(f"{where}: corrupt tensor index: {error}", reason=LAYOUT) from None
        check_index(tensors, slot.data_nbytes, slot.version)
        return tensors

    def data(self, slot: Slot, offset: int, nbytes: int) -> torch.Tensor:
        """Bytes ``[offset, offset + nbytes)`` of the slot's data: a read-only view of the
        mapping (whoever reads it only copies or sends from it)."""
        assert self._map is not None
        if not nbytes:
            return torch.empty(0, dtype=torch.uint8)
        at = slot.start + slot.data_at + offset
        with warnings.catch_warnings():  # torch warns that the buffer is not writable
            warnings.simplefilter("ignore", UserWarning)
            return torch.frombuffer(self._map, dtype=torch.uint8, count=nbytes, offset=at)

    def progress(self, slot: Slot) -> int:
        """How many bytes of its data the write of ``slot`` has written (or PLAN_BROKEN)."""
        assert self._map is not None
        return read_u64(self._map, slot.start + PROGRESS_OFFSET)

    def _views(
        self, slot: Slot, entries: list[TensorEntry] | None = None
    ) -> dict[str, torch.Tensor]:
        """The slot's tensors (its checked index, unless given) as read-only views of the
        mapping."""
        return {
            entry.name: self.data(slot, entry.offset, entry.nbytes)
            .view(FROM_NAME[entry.dtype])
            .reshape(entry.shape)
            for entry in (self.index(slot) if entries is None else entries)
        }

    def sync_into(self, backend: Backend, have_version: int, deadline: float) -> Loaded | None:
        """Load the newest complete slot not refused if newer than ``have_version``, or
        follow the write of a newer one; see the module."""
        self.ensure_mapped()
        layout = self._engine_layout.of(backend)
        torn = False  # the engine holds a load a write overlapped, or a refused part
        refusal: WeightsRefused | None = None
        load_parts = getattr(backend, "load_weights_in_parts", None)
        if load_parts is not None and FOLLOW_WRITES:
            newest = self.newest()
            announced = self.announced(have_version)
            if announced is not None and (newest is None or newest.version <= have_version):
                try:
                    loaded, torn = self._follow(announced, load_parts, layout, deadline)
                except WeightsRefused as error:
                    # a part's values: the write, once complete (seq + 1), is not read again
                    written = announced.seq + (error.reason == NONFINITE)
                    self._refusals.note((announced.start, written), error)
                    loaded, torn, refusal = None, error.partial, error
                if loaded is not None:
                    return loaded
        overlaps = 0
        while True:  # ends: each pass refuses a slot (at most SLOTS) or counts an overlap
            slot = self.newest(refused=self._refusals)
            if slot is None or (not torn and slot.version <= have_version):
                break
            if time.monotonic() > deadline:
                raise WeightTransferError(
                    f"shm v{slot.version}: deadline passed before the load",
                    partial=torn,
                    deadline_missed=True,
                )
            try:
                views = self._checked_views(slot, layout)
            except WeightsRefused as error:
                if self.seq(slot) == slot.seq:  # the slot's own bytes: refused, try the other
                    self._refusals.note((slot.start, slot.seq), error)
                    refusal = error
                    continue
                views = None  # the slot changed under us: an overlap, not corruption
            if views is not None:
                started = time.perf_counter()
                try:
                    backend.load_weights(views, slot.version)
                except ValueError as error:  # refused before any weight changed (contract)
                    raise WeightTransferError(
                        f"shm v{slot.version}: {error}", partial=torn
                    ) from None
                except Exception as error:
                    raise WeightTransferError(
                        f"shm v{slot.version}: loading failed: {error!r}", partial=True
                    ) from error
                finally:
                    del views
                load_s = time.perf_counter() - started
                if self.seq(slot) == slot.seq:
                    return Loaded(slot.version, slot.published_at, self.name, load_s)
                torn = True
            self.counters["overlaps"] += 1
            log.info("shm v%d was rewritten while it was read; reading again", slot.version)
            overlaps += 1
            if overlaps == 2:
                raise WeightTransferError(
                    "shm: the learner rewrote the slot during two loads in a row", partial=torn
                )
        if refusal is not None:
            refusal.partial = torn
            raise refusal
        if torn:
            raise WeightTransferError("shm: no whole version left to reload", partial=True)
        return None

    def _checked_views(self, slot: Slot, layout: Layout | None) -> dict[str, torch.Tensor]:
        """The slot's tensors as views, once its layout is the engine's and every value is
        finite (WeightsRefused otherwise): the engine is handed nothing else."""
        entries = self.index(slot)
        check_layout(layout, entries, slot.version, self.name)
        views = self._views(slot, entries)
        check_finite(views.items(), slot.version, self.name)
        return views

    def announced(self, have_version: int) -> Slot | None:
        """A slot being written, newer than ``have_version``, whose layout is announced."""
        assert self._map is not None
        for index in range(SLOTS):
            start = PAGE + index * self._slot_bytes
            seq = read_u64(self._map, start)  # the counter first, then what it guards
            if seq % 2 and read_u64(self._map, start + PLAN_SEQ_OFFSET) == seq:
                slot = self._slot_at(start)
                if slot.seq == seq and slot.version > have_version:
                    return slot
        return None

    def _follow(
        self, slot: Slot, load_parts, layout: Layout | None, deadline: float
    ) -> tuple[Loaded | None, bool]:
        """Load ``slot``'s tensors as the learner writes them, each part checked before the
        engine gets it: ``(loaded, False)`` when that write completed as announced;
        ``(None, partial)`` when it left its plan; WeightsRefused when a part failed."""
        assert self._map is not None
        try:
            entries = self.index(slot)
            check_layout(layout, entries, slot.version, self.name)
        except WeightTransferError:
            if self.on_plan(slot):
                raise
            return None, False  # rewritten while we read the plan: nothing loaded
        views = self._views(slot, entries)
        names = list(views)
        ends = [entry.offset + entry.nbytes for entry in entries]
        loading = False

        def parts():
            nonlocal loading
            done = 0
            while done < len(names):
                progress = self.progress(slot)
                if not self.on_plan(slot, progress):
                    raise _LeftPlan
                written = bisect.bisect_right(ends, progress, lo=done)  # whole tensors
                if written > done:
                    part = {name: views[name] for name in names[done:written]}
                    problem = nonfinite(part.items())
                    if problem is not None:
                        if not self.on_plan(slot):
                            raise _LeftPlan  # overwritten while checked: not its values
                        raise WeightsRefused(
                            f"shm v{slot.version}: refused: {problem}", reason=NONFINITE
                        )
                    loading = True
                    yield part
                    done = written
                else:
                    self._wait(deadline, slot, "while following the write")

        started = time.perf_counter()
        try:
            load_parts(names, parts(), slot.version)
            while self.seq(slot) == slot.seq:  # loaded all: wait for the write's last bytes
                self._wait(deadline, slot, "for the write to complete")
        except _LeftPlan:
            self.counters["overlaps"] += 1
            log.info("shm v%d left its announced layout while followed", slot.version)
            return None, loading
        except WeightTransferError as error:
            error.partial = loading
            raise
        except ValueError as error:  # refused: names before any part, shapes before each
            raise WeightTransferError(f"shm v{slot.version}: {error}", partial=loading) from None
        except Exception as error:
            raise WeightTransferError(
                f"shm v{slot.version}: loading failed: {error!r}", partial=loading
            ) from error
        if self.seq(slot) == slot.seq + 1:
            published_at = self._slot_at(slot.start).published_at
            self.counters["followed"] += 1
            load_s = time.perf_counter() - started
            return Loaded(slot.version, published_at, self.name, load_s), False
        self.counters["overlaps"] += 1
        log.info("shm v%d was rewritten while it was followed", slot.version)
        return None, True

    def on_plan(self, slot: Slot, progress: int | None = None) -> bool:
        """The write ``slot`` was read in is still that one (or just completed it), as
        announced."""
        assert self._map is not None
        if progress is None:
            progress = self.progress(slot)
        seq = self.seq(slot)
        return progress != PLAN_BROKEN and seq in (slot.seq, slot.seq + 1)

    @staticmethod
    def _wait(deadline: float, slot: Slot, what: str) -> None:
        if time.monotonic() > deadline:
            raise WeightTransferError(
                f"shm v{slot.version}: deadline passed {what}", deadline_missed=True
            )
        time.sleep(FOLLOW_POLL_S)

    def close(self) -> None:
        self._unmap()
