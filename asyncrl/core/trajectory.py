"""A trajectory's token columns, its three stages, and the one rule for its version.

The stages a trajectory goes through, each named once::

    in progress    InProgress    a generator's Rollout: Python lists that grow per chunk
    finished       Sample        one trajectory's columns, views of the message it came in
    padded batch   TrainBatch    [B, L] tensors on the learner's device (learner/batch.py)

and how it moves between them::

    Rollouts ─build_columns─▶ Columns ─to_wire─▶ frames ─from_wire─▶ split_samples ─▶ Samples
    Samples ─join_samples─▶ frames (a batch) ─▶ collate, by padded_layout ─▶ TrainBatch

The token columns (their names, dtypes and whether a trajectory has one entry
per prompt or per response token) are the fields of :class:`Columns`, declared
here and nowhere else: every stage reads them by those names, so a new
per-token field is added here, where a Rollout makes it and where the learner
uses it. Columns travel flat: every trajectory of a message (or a batch)
concatenated in order, cut by the per-sample lengths of its
:class:`~asyncrl.core.messages.TrajectoryMeta`. Splitting makes views, and joining
views that still lie side by side in one array gives that array back, so a
buffer batch of one message's samples goes out without a copy.

Versions: every model token records the weight version that made it (``>= 0``);
a token no policy made (an environment's reply) records :data:`ENV_VERSION`.
:func:`is_model_token` is the one rule for what a model token is, and
:func:`trajectory_version` the one for a trajectory's version: its oldest model
token, or :data:`UNVERSIONED` (later than any version, so never stale) when it
has none. Generators, buffer and learner all use them. The loss mask says the
same for tokens our generators make (1 with a version, 0 with ``ENV_VERSION``);
the buffer accepts an environment token with a version too (mask 0), and that
token then counts towards staleness, which errs towards fresher data.

numpy only: no torch, and nothing of asyncrl at run time, so every process can
import it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from functools import cached_property
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

if TYPE_CHECKING:
    from asyncrl.core.messages import TrajectoryMeta

ENV_VERSION = -1
"""The version recorded for a token no policy made (an environment's reply)."""
UNVERSIONED = 1 << 62
"""The version of a trajectory with no model token: later than any, so never stale."""

PROMPT = "prompt"
RESPONSE = "response"
"""Which of a trajectory's lengths a column has: ``prompt_len`` or ``response_len``."""


def _column(dtype: type, span: str) -> dict[str, Any]:
    """A column field's metadata: its dtype, and which of a trajectory's lengths it has."""
    return {"dtype": np.dtype(dtype), "span": span}


def is_model_token(token_versions):
    """Elementwise: which tokens a policy made (numpy arrays and torch tensors alike)."""
    return token_versions >= 0


def trajectory_version(token_versions: Sequence[int] | np.ndarray) -> int:
    """A trajectory's version: the oldest among its model tokens' versions.

    :data:`UNVERSIONED` when it has no model token (an episode whose prompt
    filled its token budget): such a trajectory is never stale.
    """
    versions = np.asarray(token_versions)
    made_by_model = versions[is_model_token(versions)]
    return int(made_by_model.min()) if made_by_model.size else UNVERSIONED


def is_versioned(versions):
    """Elementwise: which trajectory versions hold a model token (not :data:`UNVERSIONED`)."""
    return versions != UNVERSIONED


@dataclass(eq=False)
class Columns:
    """Token columns, each one flat 1-D array: one trajectory's, or several concatenated.

    ``prompt_ids`` has ``prompt_len`` entries per trajectory, the others
    ``response_len``. Built by :func:`build_columns` (a generator), received
    with :meth:`from_wire`, sent with :meth:`to_wire`.
    """

    prompt_ids: np.ndarray = field(metadata=_column(np.int32, PROMPT))
    response_ids: np.ndarray = field(metadata=_column(np.int32, RESPONSE))
    logprobs: np.ndarray = field(metadata=_column(np.float32, RESPONSE))
    """Behavior log-probs: what the generator's weights gave each token; 0 for env tokens."""
    token_versions: np.ndarray = field(metadata=_column(np.int32, RESPONSE))
    """The weight version that made each token; :data:`ENV_VERSION` for env tokens."""
    loss_mask: np.ndarray = field(metadata=_column(np.uint8, RESPONSE))
    """1 for the model's tokens, 0 for ones an environment added."""

    @classmethod
    def from_wire(cls, arrays: Mapping[str, Any]) -> Columns:
        """Columns from a decoded message's arrays (received frames or numpy arrays), as
        views: no copy. The decoder has checked their names and dtypes (``Trajectories``)."""
        return cls(**{name: _numpy(arrays[name]) for name in COLUMNS})

    def to_wire(self) -> dict[str, np.ndarray]:
        """The arrays a message carries: each contiguous and of its declared dtype (copied
        only where it is not already)."""
        return {
            name: np.ascontiguousarray(getattr(self, name), dtype=dtype)
            for name, dtype in COLUMNS.items()
        }

    @property
    def nbytes(self) -> int:
        """Bytes of its token arrays: what back-pressure on memory counts."""
        return sum(getattr(self, name).nbytes for name in COLUMNS)


COLUMNS: dict[str, np.dtype] = {f.name: f.metadata["dtype"] for f in fields(Columns)}
"""Column name -> dtype, in wire order."""
WIRE_DTYPES: dict[str, str] = {name: dtype.name for name, dtype in COLUMNS.items()}
"""Column name -> dtype name: the arrays a ``Trajectories`` message must carry."""
_SPANS: dict[str, str] = {f.name: f.metadata["span"] for f in fields(Columns)}


def _numpy(array: Any) -> np.ndarray:
    return array if isinstance(array, np.ndarray) else array.numpy()


class InProgress(Protocol):
    """A trajectory in progress, as :func:`build_columns` reads it: per-token Python lists
    that grow while it is generated (``asyncrl.generators.backend.Rollout``)."""

    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    token_versions: list[int]
    loss_mask: list[int]


@dataclass(eq=False)
class Sample(Columns):
    """One finished trajectory: its columns (views of the message it came in) and its meta.

    What the buffer holds and serves, and what the learner's batch is cut into.
    """

    meta: TrajectoryMeta = field(kw_only=True)

    @cached_property
    def version(self) -> int:
        """Its :func:`trajectory_version` (computed once, then kept)."""
        return trajectory_version(self.token_versions)


class ColumnLengthError(ValueError):
    """Columns whose sizes are not what the samples' lengths add up to."""


def build_columns(trajectories: Sequence[InProgress]) -> Columns:
    """Finished rollouts' token lists, concatenated in order into flat columns."""
    return Columns(**{name: _concatenate(trajectories, name, COLUMNS[name]) for name in COLUMNS})


def _concatenate(trajectories: Sequence[InProgress], name: str, dtype: np.dtype) -> np.ndarray:
    parts = [np.asarray(getattr(t, name), dtype) for t in trajectories]
    return np.concatenate(parts) if parts else np.empty(0, dtype)


def split_samples(metas: Sequence[TrajectoryMeta], columns: Columns | Mapping) -> list[Sample]:
    """Cut flat columns (or a message's arrays) into one :class:`Sample` per meta, as views.

    Raises :class:`ColumnLengthError` unless each column is as long as the
    metas' lengths add up to.
    """
    if not isinstance(columns, Columns):
        columns = Columns.from_wire(columns)
    totals = {
        PROMPT: sum(m.prompt_len for m in metas),
        RESPONSE: sum(m.response_len for m in metas),
    }
    flat = {name: getattr(columns, name) for name in COLUMNS}
    for name, array in flat.items():
        if array.size != totals[_SPANS[name]]:
            raise ColumnLengthError(
                f"{name} has {array.size} tokens, metas say {totals[_SPANS[name]]}"
            )
    samples, p, r = [], 0, 0
    for meta in metas:
        cut = {PROMPT: slice(p, p + meta.prompt_len), RESPONSE: slice(r, r + meta.response_len)}
        views = {name: array[cut[_SPANS[name]]] for name, array in flat.items()}
        samples.append(Sample(meta=meta, **views))
        p += meta.prompt_len
        r += meta.response_len
    return samples


def join_samples(samples: Sequence[Sample]) -> tuple[list[TrajectoryMeta], dict[str, np.ndarray]]:
    """Samples as one message: their metas and their columns' arrays, concatenated.

    Each column is copied once, straight into its declared dtype (no ``astype`` after).
    Detecting views that already tile one array would save that copy only for a batch
    split from one message and joined in order, and the check cost more than the copy.
    """
    columns = {
        name: np.concatenate([getattr(s, name) for s in samples] or [np.empty(0, dtype)],
                             dtype=dtype, casting="unsafe")  # as astype would cast
        for name, dtype in COLUMNS.items()
    }  # fmt: skip
    return [s.meta for s in samples], columns


@dataclass(frozen=True)
class PaddedLayout:
    """Where each flat token goes in a right-padded ``[B, width]`` batch: a row holds its
    trajectory's prompt, then its response, then padding."""

    width: int
    """The longest trajectory's prompt plus response."""
    lengths: np.ndarray  # [B] prompt plus response
    prompt_rows: np.ndarray  # [prompt tokens]
    prompt_columns: np.ndarray  # [prompt tokens]
    response_rows: np.ndarray  # [response tokens]
    response_columns: np.ndarray  # [response tokens]


def padded_layout(metas: Sequence[TrajectoryMeta]) -> PaddedLayout:
    """The padded position of every token of ``metas``' flat columns, computed at once."""
    size = len(metas)
    prompt_lens = np.fromiter((m.prompt_len for m in metas), np.int64, size)
    response_lens = np.fromiter((m.response_len for m in metas), np.int64, size)
    lengths = prompt_lens + response_lens
    rows = np.arange(size)
    response_rows = np.repeat(rows, response_lens)
    return PaddedLayout(
        width=int(lengths.max()) if size else 0,
        lengths=lengths,
        prompt_rows=np.repeat(rows, prompt_lens),
        prompt_columns=_offsets_within(prompt_lens),
        response_rows=response_rows,
        response_columns=prompt_lens[response_rows] + _offsets_within(response_lens),
    )


def _offsets_within(lengths: np.ndarray) -> np.ndarray:
    """For segments of ``lengths`` laid end to end: each element's index within its segment."""
    starts = np.cumsum(lengths) - lengths
    return np.arange(int(lengths.sum())) - np.repeat(starts, lengths)
