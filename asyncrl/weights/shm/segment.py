"""The shared-memory weight segment: its layout, its name, and the checks on both ends.

On one host the learner writes each published version once into a file in
``/dev/shm`` and the replicas read it in place (``shm/writer.py``,
``shm/reader.py``). The segment is a page of header and two slots::

    header  magic "ASRLWSHM", format, slots (2), slot_bytes, retired
    slot    seq, version, published_at, index_nbytes, data_offset, data_nbytes,
            plan_seq, progress,
            the tensor index (msgpack list of TensorEntry), then the tensors' bytes

``seq`` is a seqlock: odd while the writer fills the slot, even once it is
complete, 0 never written. The writer fills the older slot, so the slot a
reader most likely reads (the newest) is only overwritten by the publish after
the next one. A reader notes ``seq``, loads, and checks ``seq`` again: a changed
counter means a write overlapped the read, and the load is discarded.
A write whose tensors come in the layout of the one before (every write after
the first, unless the model changed) is announced before its first byte: the
writer puts that layout in the slot's index and then sets ``plan_seq`` to the
write's (odd) ``seq``; as it writes it sets ``progress`` to the bytes of data
written so far (after each tensor, and every :data:`WRITE_PIECE` bytes within
a large one). A reader may then *follow* the write, loading each tensor (or
sending each byte range) the moment it is written, while the learner writes
the rest; its load still counts only
if ``seq`` is the write's plus one once it is done. A write that leaves the
announced layout sets ``progress`` to ``PLAN_BROKEN``: followers give up and
read the slot once it is complete. (Both ends rely on x86-64's ordering of
stores and of loads; elsewhere readers never follow: ``FOLLOW_WRITES``.)

``retired`` tells readers the learner has stopped writing here (it exited, or
a version outgrew the slots): they fall back to another path.

The segment's name is random (``asyncrl-`` and 32 hex digits) and recorded in
``RUN_DIR/weights_shm`` (0600), where the run's replicas find it, and where the
next learner of the same run dir finds a crashed run's leftover to remove it.
File and segment are created owner-only; a reader refuses a segment that is
not a regular file of its own user with no group or other permissions. Any
process of that user can still write it (and change its mode), so readers check
what they load, not only its bounds (:mod:`asyncrl.weights.checks`).
"""

from __future__ import annotations

import mmap
import os
import platform
import re
import stat
import struct
from pathlib import Path

import msgspec

from asyncrl.core.messages import TensorEntry
from asyncrl.core.paths import WEIGHTS_SHM_POINTER
from asyncrl.core.wire import DTYPES, nbytes_of
from asyncrl.weights.checks import LAYOUT, WeightsRefused
from asyncrl.weights.source import WeightTransferError

SHM_DIR = Path("/dev/shm")
POINTER_FILE = WEIGHTS_SHM_POINTER
"""The file in the run dir naming the run's segment."""
NAME = re.compile(r"asyncrl-[0-9a-f]{32}")
MAGIC = b"ASRLWSHM"
FORMAT = 3
"""3: ``progress`` counts bytes written (2 counted tensors)."""
SLOTS = 2
PAGE = 4096
ALIGN = 64
"""Each tensor starts at a multiple of this within a slot's data (aligned vector loads)."""
MAX_INDEX_BYTES = 64 << 20
"""The largest tensor index a reader decodes (a 1000-layer model's index is ~1 MB)."""

HEADER = struct.Struct("<8sIIQQ")  # magic, format, slots, slot_bytes, retired
RETIRED_OFFSET = 24
SLOT_HEADER = struct.Struct("<QqdQQQQQ")  # seq, version, published_at, index, data at,
# data, plan_seq, progress
SLOT_HEADER_BYTES = 64
PLAN_SEQ_OFFSET = 48
PROGRESS_OFFSET = 56
PLAN_BROKEN = 2**64 - 1
"""``progress`` of a write that left the layout it announced."""
WRITE_PIECE = 8 << 20
"""The writer marks its progress at least this often within a large tensor, so a reader
need not wait for a whole embedding before it may send the first bytes of it."""
FOLLOW_WRITES = platform.machine().lower() in ("x86_64", "amd64")
"""Whether readers follow a write in progress: sound where stores and loads keep their
order (x86-64's TSO); on weaker orderings a reader waits for the complete slot."""
INDEX_DECODER = msgspec.msgpack.Decoder(list[TensorEntry])
INDEX_ENCODER = msgspec.msgpack.Encoder()


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def segment_path(name: str) -> Path:
    return SHM_DIR / name


def aligned_layout(entries: list[tuple[str, str, tuple[int, ...]]]) -> list[TensorEntry]:
    """``(name, dtype, shape)`` laid out in a slot's data: each at an ALIGN boundary."""
    tensors, offset = [], 0
    for name, dtype, shape in entries:
        nbytes = nbytes_of(dtype, shape)
        tensors.append(TensorEntry(name, dtype, tuple(shape), offset, nbytes))
        offset = round_up(offset + nbytes, ALIGN)
    return tensors


def data_nbytes(tensors: list[TensorEntry]) -> int:
    return max((t.offset + t.nbytes for t in tensors), default=0)


def check_index(tensors: list[TensorEntry], data_bytes: int, version: int) -> None:
    """Raise WeightsRefused (``layout``) naming the first entry that does not fit the slot:
    an unknown dtype, a size that is not its shape's, an offset out of order or unaligned,
    bytes past the slot's data, a name listed twice."""

    def refuse(problem: str) -> None:
        raise WeightsRefused(f"shm v{version}: {problem}", reason=LAYOUT)

    names: set[str] = set()
    end = 0
    for entry in tensors:
        where = f"tensor '{entry.name[:80]}'"
        if entry.name in names:
            refuse(f"{where} is listed twice")
        names.add(entry.name)
        if entry.dtype not in DTYPES or any(dim < 0 for dim in entry.shape):
            refuse(f"{where} has unsupported {entry.dtype}{entry.shape}")
        if entry.nbytes != nbytes_of(entry.dtype, entry.shape):
            refuse(
                f"{where} {entry.shape} {entry.dtype} must be "
                f"{nbytes_of(entry.dtype, entry.shape)} bytes, the index says {entry.nbytes}"
            )
        if entry.offset < end or entry.offset % ALIGN:
            refuse(f"{where} starts at {entry.offset}: overlaps or unaligned")
        end = entry.offset + entry.nbytes
        if end > data_bytes:
            refuse(f"{where} ends at byte {end}, past the slot's {data_bytes} bytes of data")


def read_pointer(run_dir: Path) -> str | None:
    """The segment name ``run_dir`` records, None when there is none or it is malformed."""
    try:
        text = (run_dir / POINTER_FILE).read_text()[:128].strip()
    except OSError:
        return None
    return text if NAME.fullmatch(text) else None


def check_owner_only(fd: int, what: str) -> os.stat_result:
    """Refuse a file that is not a regular file of this user, or that others may open."""
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        raise WeightTransferError(f"{what} is not a regular file")
    if info.st_uid != os.geteuid():
        raise WeightTransferError(f"{what} belongs to uid {info.st_uid}, not to this user")
    if info.st_mode & 0o077:
        raise WeightTransferError(f"{what} is open to others (mode {info.st_mode & 0o777:o})")
    return info


def read_u64(buffer: mmap.mmap, offset: int) -> int:
    """One 8-byte field of the segment, read on its own (a seqlock's counters)."""
    return int.from_bytes(buffer[offset : offset + 8], "little")


def write_u64(buffer: mmap.mmap, offset: int, value: int) -> None:
    """One 8-byte field, written on its own, after every write before it (x86-64)."""
    buffer[offset : offset + 8] = value.to_bytes(8, "little")
