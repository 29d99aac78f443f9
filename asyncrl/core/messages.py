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

Each message is defined with the others of the peers that exchange it: a generator's
with the buffer in :mod:`asyncrl.core.generator_messages`, the learner's with the buffer in
:mod:`asyncrl.core.learner_messages`, the weights transfer in
:mod:`asyncrl.core.weight_messages`; those any peer may exchange (:class:`StatusRequest`,
:class:`Status`, :class:`Ack`, :class:`ErrorReply`) are here, with the envelope and the
codec. The pieces
every message shares (limits, array specs and frames, their checks) are in
:mod:`asyncrl.core.wire`. All are re-exported here, so ``from asyncrl.core.messages import
...`` names every message.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import numpy as np

from asyncrl.core.generator_messages import (
    BASE_DIGEST,
    MAX_ADAPTER_DIGESTS,
    MAX_EPISODE_COUNT,
    NOT_EVAL,
    AdapterDigest,
    EpisodeCounts,
    EvalRound,
    Heartbeat,
    Incarnation,
    Join,
    Joined,
    Leave,
    Trajectories,
    TrajectoryMeta,
    WorkGrant,
    WorkItem,
    WorkRequest,
    new_incarnation,
)
from asyncrl.core.learner_messages import (
    MAX_EVAL_WAIT_S,
    AdapterPublished,
    BatchRequest,
    EvalResults,
    EvalResultsRequest,
    SaveBufferState,
    StartEval,
)
from asyncrl.core.weight_messages import (
    TensorEntry,
    WeightsChunk,
    WeightsChunkRequest,
    WeightsGone,
    WeightsManifest,
    WeightsRequest,
    WeightsUpToDate,
)
from asyncrl.core.wire import (
    MAX_ARRAY_DIM,
    MAX_ARRAY_DIMS,
    MAX_HEADER_BYTES,
    MAX_MESSAGE_BYTES,
    SCHEMA_VERSION,
    ArrayFrame,
    ArraySpec,
    Dimension,
    Shape,
    WireError,
    _Body,
    array_frames,
    check_sizes,
    header_error_reason,
    received_arrays,
)

__all__ = [
    "BASE_DIGEST",
    "MAX_ADAPTER_DIGESTS",
    "MAX_ARRAY_DIM",
    "MAX_ARRAY_DIMS",
    "MAX_EPISODE_COUNT",
    "MAX_EVAL_WAIT_S",
    "MAX_HEADER_BYTES",
    "MAX_MESSAGE_BYTES",
    "NOT_EVAL",
    "SCHEMA_VERSION",
    "Ack",
    "AdapterDigest",
    "AdapterPublished",
    "ArrayFrame",
    "ArraySpec",
    "BatchRequest",
    "Dimension",
    "Envelope",
    "EpisodeCounts",
    "ErrorReply",
    "EvalResults",
    "EvalResultsRequest",
    "EvalRound",
    "Heartbeat",
    "Incarnation",
    "Join",
    "Joined",
    "Leave",
    "Message",
    "SaveBufferState",
    "Shape",
    "StartEval",
    "Status",
    "StatusRequest",
    "TensorEntry",
    "Trajectories",
    "TrajectoryMeta",
    "WeightsChunk",
    "WeightsChunkRequest",
    "WeightsGone",
    "WeightsManifest",
    "WeightsRequest",
    "WeightsUpToDate",
    "WireError",
    "WorkGrant",
    "WorkItem",
    "WorkRequest",
    "_Body",
    "decode",
    "encode",
    "encode_raw",
    "new_incarnation",
]


# --------------------------------------------------------------------------
# any peer <-> buffer


class Ack(_Body, tag="ack"):
    accepted: int
    rejected: int = 0


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


class ErrorReply(_Body, tag="error"):
    reason: str
    detail: str = ""


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
    | AdapterPublished
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


def encode(body: _Body, arrays: dict[str, np.ndarray] | None = None) -> list[bytes | memoryview]:
    """Header frame plus one frame per array (contiguous buffers, not copied)."""
    specs, frames = array_frames(arrays)
    return [_ENCODER.encode(Envelope(SCHEMA_VERSION, body, specs)), *frames]


def encode_raw(body: _Body, specs: list[ArraySpec], frames: list) -> list:
    """Like :func:`encode` for buffers that are not numpy arrays (e.g. bf16 tensors)."""
    return [_ENCODER.encode(Envelope(SCHEMA_VERSION, body, specs)), *frames]


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
    check_sizes(buffers, max_bytes, max_header_bytes)
    try:
        envelope = _DECODER.decode(buffers[0])
    except msgspec.ValidationError as error:
        raise WireError(header_error_reason(error), str(error)) from None
    except msgspec.DecodeError as error:
        raise WireError("bad_header", str(error)) from None
    if envelope.schema_version != SCHEMA_VERSION:
        raise WireError(
            "schema_version", f"got {envelope.schema_version}, this build speaks {SCHEMA_VERSION}"
        )
    body = envelope.body
    return body, received_arrays(body, envelope.arrays, buffers[1:])
