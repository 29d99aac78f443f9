"""Every message that crosses a socket, and how it is encoded.

A message is a ZeroMQ multipart message::

    frame 0      msgpack header: Envelope(schema_version, body, arrays)
    frame 1..n   raw bytes of each array named in ``arrays``, sent zero-copy

``body`` is one of the tagged structs below; its ``type`` field picks it. The
header is decoded by msgspec against these types, so a wrongly typed field, an
unknown type or a missing field is rejected with the path of the bad field.
Array frames are checked against the body's declared arrays (names, dtypes,
byte sizes). Nothing here unpickles: a peer can send data, never code.

Decoding raises :class:`WireError` with a short ``reason`` that receivers count
(``rejected/<reason>``) before they carry on serving.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Sequence
from typing import Annotated, ClassVar

import msgspec
import numpy as np

from asyncrl.trajectory import WIRE_DTYPES

SCHEMA_VERSION = 1
MAX_MESSAGE_BYTES = 1 << 31
"""Default ceiling on one message (header plus frames); receivers may lower it."""
MAX_HEADER_BYTES = 64 << 20
"""Default ceiling on the header frame, checked before it is decoded; receivers may lower
it (the buffer takes 1 MiB: ``asyncrl.buffer.service.MAX_HEADER_BYTES``). A learner's
batch of thousands of samples, or a grant of many long prompts, stays far below it."""
MAX_ARRAY_DIMS = 8
"""An array (or a published tensor) has at most this many dimensions: checked while the
header is decoded, before any size is computed from its shape (a product over 100,000
dimensions would cost seconds of big-integer arithmetic)."""
MAX_ARRAY_DIM = 1 << 40
"""The largest size of one dimension: a product over ``MAX_ARRAY_DIMS`` of them stays a
small integer."""


EvalRound = Annotated[int, msgspec.Meta(ge=-1)]
"""An eval round's number, or -1 (the default): training work. Anything below -1 is
rejected when decoded (``bad_header``)."""
NOT_EVAL = -1


Dimension = Annotated[int, msgspec.Meta(ge=0, le=MAX_ARRAY_DIM)]
Shape = Annotated[tuple[Dimension, ...], msgspec.Meta(max_length=MAX_ARRAY_DIMS)]
"""An array's shape: at most ``MAX_ARRAY_DIMS`` sizes, each in ``[0, MAX_ARRAY_DIM]``."""
Incarnation = Annotated[int, msgspec.Meta(ge=0)]
"""One run of a generator process (:func:`new_incarnation`); 0: not given."""


def new_incarnation() -> int:
    """A fresh random incarnation, drawn once by each generator process when it starts and
    sent with every message it sends the buffer (its heartbeat thread's too). The buffer
    accepts a generator id's messages only from the incarnation it registered, so another
    process naming a live generator cannot book, deliver, keep alive or hand back its work."""
    return 1 + secrets.randbelow((1 << 63) - 1)


class WireError(ValueError):
    """A malformed message. ``reason`` is a short label for counting."""

    def __init__(self, reason: str, detail: str):
        self.reason = reason
        super().__init__(f"{reason}: {detail}")


class ArraySpec(msgspec.Struct, array_like=True, frozen=True):
    name: str
    dtype: str
    shape: Shape


class _Body(msgspec.Struct, tag_field="type", forbid_unknown_fields=True):
    ARRAYS: ClassVar[dict[str, str]] = {}
    """Arrays this message carries, name -> dtype; empty for header-only messages."""


# --------------------------------------------------------------------------
# generator <-> buffer


class WorkRequest(_Body, tag="work_request"):
    """A generator asks for prompts. ``WorkRequest("gen-0", max_samples=16)``.

    With ``wait_s > 0`` (a replica with nothing else to do) the buffer may hold
    the request for up to ``wait_s`` seconds when it has nothing to give, and
    answers as soon as work is admitted: no poll interval between the learner's
    step and the next prompts. The buffer caps it below its heartbeat timeout.
    """

    generator_id: str
    max_samples: int
    wait_s: float = 0.0
    """How long the buffer may hold this request for work; 0 (the default): answer now."""
    incarnation: Incarnation = 0
    """The sending process's incarnation (:func:`new_incarnation`)."""


class WorkItem(msgspec.Struct, forbid_unknown_fields=True):
    """One prompt to sample ``num_samples`` times; the samples form group ``group_id``."""

    group_id: int
    num_samples: int
    prompt_ids: list[int]
    ground_truth: str
    data_source: str = ""
    extra_info: dict = msgspec.field(default_factory=dict)
    """The row's ``extra_info``, passed to its reward function."""
    messages: list[dict] = msgspec.field(default_factory=list)
    """The row's prompt as chat messages; sent only when an environment renders its
    own prompt from them (``environment`` set), else empty."""
    eval_round: EvalRound = NOT_EVAL
    """The held-out evaluation round this prompt belongs to (its samples are measured,
    never trained on), or -1: a training prompt. Eval prompts have negative group ids."""


class WorkGrant(_Body, tag="work_grant"):
    """The buffer's answer: items to generate (maybe none), and its view of the version.

    ``WorkGrant(items=[WorkItem(7, 8, [3, 4, 5], "456")], policy_version=3)``;
    with no items the generator waits ``retry_after_s`` before asking again.
    """

    items: list[WorkItem]
    policy_version: int
    retry_after_s: float = 0.0


class TrajectoryMeta(msgspec.Struct, forbid_unknown_fields=True):
    """Per-sample fields of a trajectory; its tokens travel in the array frames."""

    group_id: int
    sample_index: int
    prompt_len: int
    response_len: int
    reward: float
    finish_reason: str
    generator_id: str
    generate_time_s: float = 0.0
    reward_error: str = ""
    """Why the reward is 0 when scoring failed (``error:timeout``, ...); empty if it did not."""
    eval_round: EvalRound = NOT_EVAL
    """The eval round of the WorkItem it was generated for; -1: a training sample."""


class Trajectories(_Body, tag="trajectories"):
    """Finished samples, token columns concatenated in ``samples`` order.

    Sent by a generator (one group at a time) and, as a training batch, by the
    buffer to the learner, where ``stats`` carries the buffer's counters.
    A sample's staleness is measured from its oldest model token's version
    (:func:`asyncrl.trajectory.trajectory_version`).
    """

    ARRAYS: ClassVar[dict[str, str]] = WIRE_DTYPES
    """The token columns, declared in :mod:`asyncrl.trajectory`."""
    samples: list[TrajectoryMeta]
    stats: dict[str, float] = {}
    pool: str = ""
    """The sending generator's pool, so the buffer can report ``stats`` per pool."""
    incarnation: Incarnation = 0
    """From a generator: its incarnation (:func:`new_incarnation`); every sample of one
    message is the same generator's."""


class Heartbeat(_Body, tag="heartbeat"):
    """A generator says it is alive (answered with an Ack). ``Heartbeat("gen-0")``.

    Sent at least every ``buffer.heartbeat_interval_s`` when nothing else is;
    any message from a generator counts as one. A generator silent for
    ``buffer.heartbeat_timeout_s`` is presumed dead and its unfinished groups
    are handed out again.
    """

    generator_id: str
    incarnation: Incarnation = 0


class Ack(_Body, tag="ack"):
    accepted: int
    rejected: int = 0


class Join(_Body, tag="join"):
    """A generator started outside the launcher (``asyncrl generator``) joins a live run.

    Answered with :class:`Joined`: where the weights are published, so the
    joining replica needs nothing but the buffer's address.
    """

    generator_id: str
    pool: str = "default"
    incarnation: Incarnation = 0
    """A live generator id joining with a new incarnation is a restarted process: it
    replaces the old one, whose unfinished groups are handed out again at once."""


class Joined(_Body, tag="joined"):
    weights_port: int
    """The learner's weight endpoint listens on this port, at the buffer's host."""
    policy_version: int
    run_name: str = ""


class Leave(_Body, tag="leave"):
    """A generator stops: its unfinished groups go back to the queue now rather than
    after ``buffer.heartbeat_timeout_s`` of silence (answered with an Ack)."""

    generator_id: str
    incarnation: Incarnation = 0


class StatusRequest(_Body, tag="status_request"):
    """``asyncrl status`` asks a live buffer for its state (answered with :class:`Status`)."""


class Status(_Body, tag="status"):
    policy_version: int
    stats: dict[str, float]
    """The buffer's counters (``buffer_*``) and the generators' summaries."""
    generators: dict[str, dict[str, float]]
    """Per generator id: ``seen_s_ago``, and its latest counters."""
    pools: dict[str, str]
    """Generator id -> pool."""


# --------------------------------------------------------------------------
# learner <-> buffer


class BatchRequest(_Body, tag="batch_request"):
    """The learner at ``policy_version`` asks for its next batch (answered when ready)."""

    policy_version: int


class StartEval(_Body, tag="start_eval"):
    """The learner published ``policy_version``: evaluate it on the held-out prompts.

    ``StartEval(round=3, policy_version=30)``. The buffer hands the round's prompts out
    before new training prompts, and its results ride along with a later batch's
    ``stats`` (``eval_*``) or answer an :class:`EvalResultsRequest`. Answered with
    ``Ack(accepted=1)``, or ``Ack(accepted=0)`` when the round is not started: an
    earlier round is still running (counted as skipped), or this round was started
    already.
    """

    round: Annotated[int, msgspec.Meta(ge=0)]
    policy_version: Annotated[int, msgspec.Meta(ge=0)]


MAX_EVAL_WAIT_S = 3600.0
"""The longest an EvalResultsRequest may ask the buffer to hold it."""


class EvalResultsRequest(_Body, tag="eval_results_request"):
    """The learner, done training, asks for the eval results no batch will carry.

    ``EvalResultsRequest(wait_s=30.0)``. Answered with :class:`EvalResults`: every
    finished round's results not handed over yet (each is handed over once, with a
    batch or here). With none waiting while a round runs, the buffer holds the request
    up to ``wait_s`` seconds and answers the moment that round completes; with no round
    running it answers at once, so ``running_round == -1`` says no more results will
    come. A ``wait_s`` that is negative, not finite or above ``MAX_EVAL_WAIT_S`` is
    rejected (``bad_header``).
    """

    wait_s: Annotated[float, msgspec.Meta(ge=0.0, le=MAX_EVAL_WAIT_S)] = 0.0


class EvalResults(_Body, tag="eval_results"):
    results: list[dict[str, float]]
    """Finished rounds' ``eval_*`` results, oldest first; empty if none finished since."""
    running_round: EvalRound = NOT_EVAL
    """The round still running (its results come later), or -1: none is."""


class SaveBufferState(_Body, tag="save_buffer_state"):
    """The learner checkpoints step ``step``: the buffer writes its dataset cursor and
    unfinished groups into that checkpoint's directory, then answers with an Ack.

    The buffer derives the path from its own run directory; a peer never names a file.
    ``abandoned_batch_request``: the learner stopped waiting for its last BatchRequest
    (it is stopping), so that request is cancelled or, if the buffer answered it
    already, the batch it served goes back among the groups not yet trained on.
    """

    step: int
    abandoned_batch_request: bool = False


class ErrorReply(_Body, tag="error"):
    reason: str
    detail: str = ""


# --------------------------------------------------------------------------
# learner -> generators: weights


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
            if entry.dtype not in _DTYPES or any(dim < 0 for dim in entry.shape):
                raise ValueError(f"tensor '{entry.name}': unsupported {entry.dtype}{entry.shape}")
            nbytes = math.prod(entry.shape) * _ITEMSIZE[entry.dtype]
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


Message = (
    WorkRequest
    | WorkGrant
    | Trajectories
    | Heartbeat
    | Ack
    | Join
    | Joined
    | Leave
    | StatusRequest
    | Status
    | BatchRequest
    | StartEval
    | EvalResultsRequest
    | EvalResults
    | SaveBufferState
    | ErrorReply
    | WeightsRequest
    | WeightsUpToDate
    | WeightsManifest
    | WeightsChunkRequest
    | WeightsChunk
    | WeightsGone
)


class Envelope(msgspec.Struct, forbid_unknown_fields=True):
    schema_version: int
    body: Message
    arrays: list[ArraySpec] = []


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(Envelope)
_DTYPES = {"int32", "int64", "float32", "float16", "bfloat16", "uint8", "bool"}
_ITEMSIZE = {
    "int32": 4,
    "int64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "uint8": 1,
    "bool": 1,
}


def encode(body: _Body, arrays: dict[str, np.ndarray] | None = None) -> list[bytes | memoryview]:
    """Header frame plus one frame per array (contiguous buffers, not copied)."""
    arrays = arrays or {}
    specs, frames = [], []
    for name, array in arrays.items():
        array = np.ascontiguousarray(array)
        specs.append(ArraySpec(name, str(array.dtype), tuple(array.shape)))
        frames.append(memoryview(array).cast("B"))
    return [_ENCODER.encode(Envelope(SCHEMA_VERSION, body, specs)), *frames]


def encode_raw(body: _Body, specs: list[ArraySpec], frames: list) -> list:
    """Like :func:`encode` for buffers that are not numpy arrays (e.g. bf16 tensors)."""
    return [_ENCODER.encode(Envelope(SCHEMA_VERSION, body, specs)), *frames]


class ArrayFrame(msgspec.Struct, frozen=True):
    """A received array: its spec and a view of the frame's bytes (no copy)."""

    spec: ArraySpec
    buffer: memoryview

    def numpy(self) -> np.ndarray:
        """Read-only numpy view; bfloat16 has no numpy dtype (use torch.frombuffer)."""
        return np.frombuffer(self.buffer, dtype=np.dtype(self.spec.dtype)).reshape(self.spec.shape)


def decode(
    frames: Sequence,
    max_bytes: int = MAX_MESSAGE_BYTES,
    *,
    max_header_bytes: int = MAX_HEADER_BYTES,
) -> tuple[_Body, dict[str, ArrayFrame]]:
    """Validate and decode a multipart message into its body and its arrays.

    Sizes are checked before anything is decoded: the whole message against
    ``max_bytes``, the header frame against ``max_header_bytes`` (``oversized``);
    array shapes are bounded while the header is decoded (``MAX_ARRAY_DIMS``,
    ``MAX_ARRAY_DIM``: ``bad_array``), before a byte count is computed from them.
    Arrays are views of the received frames (no copy). Raises WireError.
    """
    if not frames:
        raise WireError("empty", "no frames")
    buffers = [memoryview(frame.buffer if hasattr(frame, "buffer") else frame) for frame in frames]
    total = sum(b.nbytes for b in buffers)
    if total > max_bytes:
        raise WireError("oversized", f"{total} bytes exceeds the limit of {max_bytes}")
    if buffers[0].nbytes > max_header_bytes:
        raise WireError(
            "oversized",
            f"a header of {buffers[0].nbytes} bytes exceeds the limit of {max_header_bytes}",
        )
    try:
        envelope = _DECODER.decode(buffers[0])
    except msgspec.ValidationError as error:
        where = str(error)
        if "`$.body.type`" in where:
            reason = "unknown_type"
        elif "`$.arrays" in where:
            reason = "bad_array"
        else:
            reason = "bad_header"
        raise WireError(reason, where) from None
    except msgspec.DecodeError as error:
        raise WireError("bad_header", str(error)) from None
    if envelope.schema_version != SCHEMA_VERSION:
        raise WireError(
            "schema_version", f"got {envelope.schema_version}, this build speaks {SCHEMA_VERSION}"
        )
    body, specs = envelope.body, envelope.arrays
    if len(specs) != len(buffers) - 1:
        raise WireError(
            "frame_count", f"header names {len(specs)} arrays, got {len(buffers) - 1} frames"
        )
    arrays: dict[str, ArrayFrame] = {}
    for spec, buffer in zip(specs, buffers[1:], strict=True):
        if spec.name in arrays:
            raise WireError("bad_array", f"array '{spec.name}' appears twice")
        expected = body.ARRAYS.get(spec.name)
        if body.ARRAYS and expected is None:
            raise WireError("bad_array", f"{body.__class__.__name__} has no array '{spec.name}'")
        if expected is not None and spec.dtype != expected:
            raise WireError(
                "bad_array", f"array '{spec.name}' must be {expected}, got {spec.dtype}"
            )
        if spec.dtype not in _DTYPES or any(dim < 0 for dim in spec.shape):
            raise WireError(
                "bad_array", f"array '{spec.name}': unsupported {spec.dtype}{spec.shape}"
            )
        nbytes = math.prod(spec.shape) * _ITEMSIZE[spec.dtype]  # Python ints: no overflow
        if nbytes != buffer.nbytes:
            raise WireError(
                "truncated",
                f"array '{spec.name}' {spec.shape} needs {nbytes} bytes, frame has {buffer.nbytes}",
            )
        arrays[spec.name] = ArrayFrame(spec, buffer)
    missing = set(body.ARRAYS) - set(arrays)
    if missing:
        raise WireError(
            "bad_array", f"{body.__class__.__name__} is missing arrays {sorted(missing)}"
        )
    return body, arrays
