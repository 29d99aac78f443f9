"""The messages between a generator and the buffer, and the types they share.

A generator asks for work (:class:`WorkRequest`, answered with a :class:`WorkGrant` of
:class:`WorkItem`), delivers samples (:class:`Trajectories` of :class:`TrajectoryMeta`),
says it is alive (:class:`Heartbeat`), joins a live run (:class:`Join`, answered with
:class:`Joined`) and leaves it (:class:`Leave`). They live apart from the learner's
(:mod:`asyncrl.core.learner_messages`) so each side's messages read on their own; the
envelope, the union of every message and the codec are in :mod:`asyncrl.core.messages`,
which re-exports all of them.
"""

from __future__ import annotations

import secrets
from typing import Annotated, ClassVar

import msgspec

from asyncrl.core.trajectory import WIRE_DTYPES
from asyncrl.core.wire import _Body

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
