"""The messages of the weights transfer: learner -> generators.

A generator asks whether newer weights exist (:class:`WeightsRequest`); the learner's
weight endpoint answers with :class:`WeightsUpToDate` or the newest version's
:class:`WeightsManifest`, whose chunks the generator then fetches one by one
(:class:`WeightsChunkRequest` -> :class:`WeightsChunk`, or :class:`WeightsGone`
once that version is no longer served). They travel in the same envelope as every
other message (:mod:`asyncrl.core.messages`).
"""

from __future__ import annotations

import msgspec

from asyncrl.core.wire import DTYPES, Shape, _Body, nbytes_of

WEIGHT_PATHS = ("collective", "shm", "zmq")
"""The weight-sync paths, in the order a replica's chain tries them (``weights.transport``
picks the first)."""
WEIGHT_SYNC_STATS = frozenset(
    {
        "weights_transfer_failures",
        "weights_deadline_missed",
        "weights_fallbacks",
        *(f"weights_{what}_{path}" for what in ("loads", "failures") for path in WEIGHT_PATHS),
        "weights_shm_overlaps",  # a read a write overlapped: discarded and read again
        "weights_shm_followed",  # loads that followed the learner's write
        "weights_refused",  # versions refused by a replica's checks (asyncrl.weights.checks)
        *(
            f"weights_{path}_refused_{reason}"
            for path in WEIGHT_PATHS
            for reason in ("nonfinite", "layout")
        ),
    }
)
"""The counters a replica's weight-sync chain reports (``generators/weight_sync.py``),
which the buffer accepts from it."""


class WeightsRequest(_Body, tag="weights_request"):
    """A generator holding ``have_version`` asks whether newer weights exist.

    Answered with ``WeightsUpToDate`` or the newest version's ``WeightsManifest``.
    """

    have_version: int


class WeightsUpToDate(_Body, tag="weights_up_to_date"):
    latest_version: int


class TensorEntry(msgspec.Struct, array_like=True, frozen=True, forbid_unknown_fields=True):
    """One tensor of a published version: bytes ``[offset, offset + nbytes)`` of its stream.

    A version's tensors are laid end to end, in index order, as one byte stream
    (each tensor C-contiguous); the stream is cut into chunks of ``chunk_bytes``.
    """

    name: str
    dtype: str
    shape: Shape
    offset: int
    nbytes: int


class WeightsManifest(_Body, tag="weights_manifest"):
    """The tensor index of one published version, sent before any of its chunks.

    ``WeightsManifest(4, 1.7e9, chunk_bytes=64 << 20, total_bytes=24, num_chunks=1,
    tensors=[TensorEntry("w", "float32", (2, 3), 0, 24)])``. Decoding checks that
    the index is consistent (sizes match shapes, tensors tile the stream without
    gaps, the chunk count covers it), so a receiver can trust the layout it implies.
    """

    version: int
    published_at: float
    chunk_bytes: int
    total_bytes: int
    num_chunks: int
    tensors: list[TensorEntry]

    def __post_init__(self) -> None:
        if self.chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be positive, got {self.chunk_bytes}")
        offset, names = 0, set()
        for entry in self.tensors:
            if entry.name in names:
                raise ValueError(f"tensor '{entry.name}' is listed twice")
            names.add(entry.name)
            if entry.dtype not in DTYPES or any(dim < 0 for dim in entry.shape):
                raise ValueError(f"tensor '{entry.name}': unsupported {entry.dtype}{entry.shape}")
            nbytes = nbytes_of(entry.dtype, entry.shape)
            if entry.nbytes != nbytes or entry.offset != offset:
                raise ValueError(
                    f"tensor '{entry.name}' {entry.shape} must be {nbytes} bytes at offset "
                    f"{offset}, is {entry.nbytes} at {entry.offset}"
                )
            offset += nbytes
        if self.total_bytes != offset:
            raise ValueError(f"total_bytes is {self.total_bytes}, the tensors hold {offset}")
        if self.num_chunks != -(-offset // self.chunk_bytes):
            raise ValueError(f"{self.num_chunks} chunks of {self.chunk_bytes} for {offset} bytes")


class WeightsChunkRequest(_Body, tag="weights_chunk_request"):
    """Ask for chunk ``index`` of the published ``version``."""

    version: int
    index: int


class WeightsChunk(_Body, tag="weights_chunk"):
    """Bytes ``[index * chunk_bytes, ...)`` of a version's stream, at most ``chunk_bytes``.

    One uint8 frame per tensor piece, named after its tensor, in stream order: the
    tail of a tensor begun in an earlier chunk, whole tensors, the head of one that
    continues. ``crc32`` is of the chunk's bytes, in that order.
    """

    version: int
    index: int
    crc32: int


class WeightsGone(_Body, tag="weights_gone"):
    """The requested version is no longer served; start again from ``latest_version``."""

    version: int
    latest_version: int
