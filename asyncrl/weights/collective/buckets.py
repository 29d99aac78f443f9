"""How a version travels on the collective path: flat buckets, and the header that says so.

The learner sends a version's tensors in flat buckets of one dtype: each
bucket holds whole tensors, at most ``bucket_bytes`` of them, and a tensor
larger than that is a bucket of its own (a receiver that loads bucket by
bucket, as vLLM does, needs whole tensors). A bucket is one broadcast. Sent
from the shared-memory slot (:func:`plan_slot_buckets`), a bucket is a byte
range of the slot, so its tensors keep the slot's 64-byte alignment; packed
from a snapshot (:func:`plan_buckets`), they lie end to end. Before the first
bucket the learner sends an :class:`Offer`: the version and, per bucket, its
dtype, size, the names, shapes and byte offsets of its tensors, and the pieces
it goes in when it is more than one broadcast (the first bytes of a version
go in small pieces, so they leave while the learner writes the rest). The
receiver checks the offer (:func:`check_offer`) before it receives a byte:
sizes that add up, known dtypes, the names and shapes its engine expects,
nothing missing, nothing extra, so that what it receives can only land where
it belongs. After the last bucket comes one more broadcast, the verdict
(:data:`VERDICT_INTACT` or not): whether the bytes sent are all that version's,
since the learner may have rewritten the slot while it was being sent.

Replies travel through the group's store, which anyone who reaches its port
may write: each is signed (:func:`seal`, Ed25519 with the sending side's own
key, bound to the group and the request it answers) and opened only when the
other side's signature holds (:func:`unseal`). Nothing is ever unpickled: msgpack of the
structs below, decoded strictly.
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import msgspec

from asyncrl.core.messages import TensorEntry
from asyncrl.core.signing import SIGNATURE_BYTES, GroupKey
from asyncrl.core.wire import ITEMSIZE, nbytes_of
from asyncrl.weights.source import WeightTransferError

MAX_MESSAGE_BYTES = 64 << 20
"""The largest signed message a side opens (a 1000-layer model's offer is about 1 MB)."""
MAX_BUCKETS = 1 << 16
MAX_PIECES = 1 << 16
"""The most broadcasts one bucket may take (a 64 GiB tensor in 1 MiB pieces)."""
FIRST_PIECE = 4 << 20
"""The first broadcast of a version from the slot (:func:`in_pieces`)."""
MAX_DIMS = 8
ALIGN = 64
"""A tensor in a bucket starts right after the one before, or at the next multiple of this."""
VERDICT_INTACT = 1
"""The verdict broadcast (one int64) after the last bucket when every byte sent was the
offered version's; anything else: the version was rewritten meanwhile, discard it."""


class BucketTensor(msgspec.Struct, array_like=True, frozen=True, forbid_unknown_fields=True):
    """One tensor of a bucket: bytes ``[offset, offset + its size)`` of the bucket."""

    name: str
    shape: tuple[int, ...]
    offset: int


class Bucket(msgspec.Struct, array_like=True, frozen=True, forbid_unknown_fields=True):
    """``nbytes`` bytes holding ``tensors`` of one ``dtype``, end to end: one broadcast, or
    one per piece when ``pieces`` lists where each ends (:func:`in_pieces`)."""

    dtype: str
    nbytes: int
    tensors: tuple[BucketTensor, ...]
    pieces: tuple[int, ...] = ()


class Offer(msgspec.Struct, tag="offer", frozen=True, forbid_unknown_fields=True):
    """The learner sends ``version`` now, in these buckets, in this order."""

    version: int
    published_at: float
    buckets: tuple[Bucket, ...]


class UpToDate(msgspec.Struct, tag="up_to_date", frozen=True, forbid_unknown_fields=True):
    """Nothing newer than the version asked about (``latest``: -1 before the first publish)."""

    latest: int


class Ask(msgspec.Struct, tag="ask", frozen=True, forbid_unknown_fields=True):
    """A member asks for a version newer than ``have_version``."""

    have_version: int


class JoinRequest(msgspec.Struct, tag="join", frozen=True, forbid_unknown_fields=True):
    """A replica asks for a group of ``world_size`` ranks (learner + its engine's workers)."""

    replica: str
    nonce: str
    world_size: int
    device: str = "cpu"
    """Where its ranks hold the buckets: ``cuda`` makes an NCCL group, ``cpu`` a gloo one."""


class Accept(msgspec.Struct, tag="accept", frozen=True, forbid_unknown_fields=True):
    """The learner made group ``ticket`` for the join request with ``nonce``."""

    ticket: int
    nonce: str
    world_size: int


Message = Offer | UpToDate | Ask | JoinRequest | Accept
_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(Message)


class Spec(NamedTuple):
    """What the engine expects of one tensor; None where it cannot say (vLLM's dtypes)."""

    shape: tuple[int, ...] | None
    dtype: str | None


def seal(message: Message, key: GroupKey | None, context: str) -> bytes:
    """``message`` signed by this side for ``context`` (e.g. ``"reply:3:7"``): signature
    then msgpack body."""
    body = _ENCODER.encode(message)
    if key is None:
        return _UNSIGNED + body
    return key.sign(_signed(context, body)) + body


def unseal(data: bytes, key: GroupKey | None, context: str, expected: type) -> Message:
    """The message in ``data`` when the other side's signature for ``context`` holds and
    it is an ``expected`` (or, for replies, any reply type); else WeightTransferError."""
    if not SIGNATURE_BYTES <= len(data) <= MAX_MESSAGE_BYTES:
        raise WeightTransferError(f"collective: a {len(data)}-byte message for {context}")
    signature, body = data[:SIGNATURE_BYTES], data[SIGNATURE_BYTES:]
    if key is None:
        genuine = hmac.compare_digest(signature, _UNSIGNED)
    else:
        genuine = key.verify(signature, _signed(context, body))
    if not genuine:
        raise WeightTransferError(f"collective: a forged or misdirected message for {context}")
    try:
        message = _DECODER.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as error:
        raise WeightTransferError(f"collective: malformed message for {context}: {error}") from None
    if not isinstance(message, expected):
        raise WeightTransferError(f"collective: got {type(message).__name__} for {context}")
    return message


_UNSIGNED = bytes(SIGNATURE_BYTES)
"""No key (``cluster.auth`` off): a constant, so anyone may speak (said at start)."""


def _signed(context: str, body: bytes) -> bytes:
    return context.encode() + b"\0" + body


def plan_buckets(
    tensors: Sequence[TensorEntry], bucket_bytes: int
) -> list[tuple[Bucket, list[int]]]:
    """Each bucket with the indices (into ``tensors``) of the tensors it carries, in order.

    One dtype per bucket; a dtype's tensors keep their index order and fill its
    current bucket until the next would take it past ``bucket_bytes``; a tensor
    larger than that is a bucket of its own.
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    planned: list[tuple[Bucket, list[int]]] = []
    open_buckets: dict[str, tuple[list[BucketTensor], list[int], int]] = {}

    def close(dtype: str) -> None:
        members, indices, size = open_buckets.pop(dtype)
        planned.append((Bucket(dtype, size, tuple(members)), indices))

    for index, entry in enumerate(tensors):
        current = open_buckets.get(entry.dtype)
        if current is not None and current[2] + entry.nbytes > bucket_bytes:
            close(entry.dtype)
            current = None
        if current is None:
            current = open_buckets[entry.dtype] = ([], [], 0)
        members, indices, size = current
        members.append(BucketTensor(entry.name, tuple(entry.shape), size))
        indices.append(index)
        open_buckets[entry.dtype] = (members, indices, size + entry.nbytes)
    for dtype in list(open_buckets):
        close(dtype)
    return planned


def plan_slot_buckets(
    tensors: Sequence[TensorEntry], bucket_bytes: int, first_piece: int = FIRST_PIECE
) -> list[tuple[Bucket, int]]:
    """Buckets as byte ranges of a shared-memory slot whose ``tensors`` (its index, offsets
    into the slot's data) are written in order, each with the offset of its first byte
    in the slot's data, and in pieces from ``first_piece`` up (:func:`in_pieces`).

    A bucket is a run of consecutive tensors of one dtype, at most ``bucket_bytes`` from
    its first byte to its last (a tensor larger than that is a bucket of its own); the
    gaps the slot's alignment leaves between them travel too: no copy to pack them.
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    buckets: list[Bucket] = []
    starts: list[int] = []
    members: list[BucketTensor] = []
    start = end = 0
    dtype = ""
    for entry in tensors:
        if members and (entry.dtype != dtype or entry.offset + entry.nbytes - start > bucket_bytes):
            buckets.append(Bucket(dtype, end - start, tuple(members)))
            members = []
        if not members:
            start, dtype = entry.offset, entry.dtype
            starts.append(start)
        members.append(BucketTensor(entry.name, tuple(entry.shape), entry.offset - start))
        end = entry.offset + entry.nbytes
    if members:
        buckets.append(Bucket(dtype, end - start, tuple(members)))
    return list(zip(in_pieces(buckets, bucket_bytes, first_piece), starts, strict=True))


def in_pieces(buckets: Sequence[Bucket], bucket_bytes: int, first_piece: int) -> list[Bucket]:
    """``buckets`` sent in pieces that start at ``first_piece`` bytes and double with each
    broadcast up to ``bucket_bytes``, no broadcast larger: the first bytes of a version
    go while the learner writes the rest of its first tensor (an embedding: a fifth of a
    small model), and a large tensor leaves as its bytes are written, not once it all is."""
    size = max(1, min(first_piece, bucket_bytes))
    pieced = []
    for bucket in buckets:
        ends: list[int] = []
        at = 0
        while bucket.nbytes - at > size:
            at += size
            ends.append(at)
            size = min(size * 2, bucket_bytes)
        if ends:
            ends.append(bucket.nbytes)
        if bucket.nbytes:
            size = min(size * 2, bucket_bytes)  # after the bucket's last broadcast
        pieced.append(msgspec.structs.replace(bucket, pieces=tuple(ends)))
    return pieced


def piece_ranges(bucket: Bucket) -> list[tuple[int, int]]:
    """The byte ranges of ``bucket`` that go as one broadcast each, in order (none when
    it is empty)."""
    if not bucket.nbytes:
        return []
    ends = bucket.pieces or (bucket.nbytes,)
    return list(zip((0, *ends[:-1]), ends, strict=True))


def check_offer(
    offer: Offer,
    have_version: int,
    expected: Mapping[str, Spec] | None,
    optional: set[str],
    bucket_bytes: int,
) -> None:
    """Raise WeightTransferError naming the first thing wrong with ``offer``.

    ``expected``: the engine's tensors by name (None: names unknown here, the
    engine checks them); ``optional`` may be missing (a tied LM head). A bucket
    of several tensors is at most ``bucket_bytes``; its tensors tile it from
    byte 0, each right after the one before or at the next multiple of
    :data:`ALIGN`; dtypes and dimensions are sane; no name twice.
    """

    def refuse(problem: str) -> None:
        raise WeightTransferError(f"collective: refused v{offer.version}: {problem}")

    if offer.version <= have_version:
        refuse(f"not newer than v{have_version}")
    if len(offer.buckets) > MAX_BUCKETS:
        refuse(f"{len(offer.buckets)} buckets")
    seen: set[str] = set()
    for number, bucket in enumerate(offer.buckets):
        if bucket.dtype not in ITEMSIZE:
            refuse(f"bucket {number} has unknown dtype {bucket.dtype!r}")
        if len(bucket.tensors) > 1 and bucket.nbytes > bucket_bytes:
            refuse(f"bucket {number} holds {bucket.nbytes} bytes, over {bucket_bytes}")
        position = 0
        for tensor in bucket.tensors:
            if tensor.name in seen:
                refuse(f"tensor '{tensor.name}' is sent twice")
            seen.add(tensor.name)
            if len(tensor.shape) > MAX_DIMS or any(d < 0 for d in tensor.shape):
                refuse(f"tensor '{tensor.name}' has shape {tensor.shape}")
            aligned = -(-position // ALIGN) * ALIGN
            if tensor.offset not in (position, aligned):
                refuse(f"tensor '{tensor.name}' is at byte {tensor.offset}, not {position}")
            position = tensor.offset + nbytes_of(bucket.dtype, tensor.shape)
            spec = expected.get(tensor.name) if expected is not None else Spec(None, None)
            if spec is None:
                refuse(f"tensor '{tensor.name}' is not one of the engine's")
            if spec.shape is not None and tuple(spec.shape) != tensor.shape:
                refuse(f"tensor '{tensor.name}' has shape {tensor.shape}, expected {spec.shape}")
            if spec.dtype is not None and spec.dtype != bucket.dtype:
                refuse(f"tensor '{tensor.name}' is {bucket.dtype}, expected {spec.dtype}")
        if position != bucket.nbytes:
            refuse(f"bucket {number} says {bucket.nbytes} bytes, its tensors take {position}")
        ends = bucket.pieces
        if ends and (
            len(ends) > MAX_PIECES
            or ends[-1] != bucket.nbytes
            or any(end <= before for before, end in zip((0, *ends[:-1]), ends, strict=True))
        ):
            refuse(f"bucket {number}'s pieces {ends[:8]} do not tile its {bucket.nbytes} bytes")
    if expected is not None:
        missing = set(expected) - optional - seen
        if missing:
            refuse(f"missing {sorted(missing)[:8]}")
