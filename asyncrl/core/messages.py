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

The pieces every message shares (limits, array specs and frames, their checks) are in
:mod:`asyncrl.core.wire`, the weights-transfer messages in :mod:`asyncrl.core.weight_messages`;
both are re-exported here, so ``from asyncrl.core.messages import ...`` names every message.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from typing import Annotated, ClassVar

import msgspec
import numpy as np

from asyncrl.core.trajectory import WIRE_DTYPES
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


EvalRound = Annotated[int, msgspec.Meta(ge=-1)]
"""An eval round's number, or -1 (the default): training work. Anything below -1 is
rejected when decoded (``bad_header``)."""
NOT_EVAL = -1


BASE_DIGEST = "base"
"""The digest of a LoRA adapter that computes the base model (every ``B`` zero), and of no
adapter at all: what a replica serves before its first adapter, and version 0 of a run."""
AdapterDigest = Annotated[str, msgspec.Meta(pattern=rf"^({BASE_DIGEST}|[0-9a-f]{{32}})$")]
"""An adapter's digest (:func:`asyncrl.generation.lora.adapter_digest`): 32 hex digits,
or ``base``."""
MAX_ADAPTER_DIGESTS = 64
"""Versions a Trajectories message may name digests for (a sample spans a few)."""


Incarnation = Annotated[int, msgspec.Meta(ge=0)]
"""One run of a generator process (:func:`new_incarnation`); 0: not given."""


def new_incarnation() -> int:
    """A fresh random incarnation, drawn once by each generator process when it starts and
    sent with every message it sends the buffer (its heartbeat thread's too). The buffer
    accepts a generator id's messages only from the incarnation it registered, so another
    process naming a live generator cannot book, deliver, keep alive or hand back its work."""
    return 1 + secrets.randbelow((1 << 63) - 1)


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


MAX_EPISODE_COUNT = 1 << 20
"""The largest turn or tool-call count one episode may report: far above any real
episode, low enough that a peer cannot skew a batch's means without bound."""
EpisodeCount = Annotated[int, msgspec.Meta(ge=0, le=MAX_EPISODE_COUNT)]


class EpisodeCounts(msgspec.Struct, forbid_unknown_fields=True):
    """What a multi-turn episode did, so the buffer can report turns and tool use per
    batch and per eval round (the replica's own counters only add up over its life).

    ``EpisodeCounts(turns=3, tool_calls=2, tool_errors=1)``. The buffer refuses
    ``turns == 0`` and ``tool_errors > tool_calls`` (``bad_field``)."""

    turns: EpisodeCount
    """Model turns taken."""
    tool_calls: EpisodeCount
    """Tool calls attempted, malformed ones included."""
    tool_errors: EpisodeCount
    """Of those, the ones that could not be carried out."""

    @property
    def tool_succeeded(self) -> bool:
        """At least one tool call was well formed and carried out."""
        return self.tool_calls > self.tool_errors


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
    episode: EpisodeCounts | msgspec.UnsetType = msgspec.UNSET
    """From a multi-turn episode that took at least one model turn: what it did. Left
    out of the bytes when unset, so a single-turn sample encodes as it always did."""


class Trajectories(_Body, tag="trajectories"):
    """Finished samples, token columns concatenated in ``samples`` order.

    Sent by a generator (one group at a time) and, as a training batch, by the
    buffer to the learner, where ``stats`` carries the buffer's counters.
    A sample's staleness is measured from its oldest model token's version
    (:func:`asyncrl.core.trajectory.trajectory_version`).
    """

    ARRAYS: ClassVar[dict[str, str]] = WIRE_DTYPES
    """The token columns, declared in :mod:`asyncrl.core.trajectory`."""
    samples: list[TrajectoryMeta]
    stats: dict[str, float] = msgspec.field(default_factory=dict)
    pool: str = ""
    """The sending generator's pool, so the buffer can report ``stats`` per pool."""
    incarnation: Incarnation = 0
    """From a generator: its incarnation (:func:`new_incarnation`); every sample of one
    message is the same generator's."""
    adapter_digests: (
        Annotated[
            dict[Annotated[int, msgspec.Meta(ge=0)], AdapterDigest],
            msgspec.Meta(max_length=MAX_ADAPTER_DIGESTS),
        ]
        | msgspec.UnsetType
    ) = msgspec.UNSET
    """From a generator whose run publishes LoRA adapters alone: for each version its
    samples' model tokens carry, the digest of the adapter its engine held for that version
    (:func:`asyncrl.generation.lora.adapter_digest`), checked against the learner's announcement.
    Left out of the bytes when unset, so a run without LoRA sends what it always did."""


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


class AdapterPublished(_Body, tag="adapter_published"):
    """The learner is about to publish ``version``, whose LoRA adapter has ``digest``: sent
    before any replica can fetch it, answered with ``Ack(accepted=1)``. The buffer refuses
    samples whose replica reports another digest for the version."""

    version: Annotated[int, msgspec.Meta(ge=0)]
    digest: AdapterDigest


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
