"""One way for a replica to get newer weights, behind one interface.

A replica holds an ordered chain of sources (collective, shm, zmq; see
``generators/weight_sync.py``) and asks each in turn, with a deadline, to load
a version newer than the one it has. A source either loads one whole version
(and says which, and how), finds none newer, or raises
:class:`WeightTransferError`; the chain then falls back to the next source at
once. Nothing here knows a transport: the sources live beside it
(``shm/reader.py``, ``collective/groups.py``, ``zmq/source.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple, Protocol, runtime_checkable

if TYPE_CHECKING:  # the backend contract lives with the generators, a layer above
    from asyncrl.generators.backend import Backend


class WeightTransferError(RuntimeError):
    """A path failed or missed its deadline; the chain falls back to the next path.

    ``partial``: the engine may hold part of the new version (a load began and did not
    finish), so it must not generate until a later load succeeds. ``deadline_missed``:
    the failure was the deadline, counted apart from other failures. ``overwritten``: the
    learner rewrote the version while it was read; the path itself is sound.
    """

    def __init__(
        self,
        message: str,
        *,
        partial: bool = False,
        deadline_missed: bool = False,
        overwritten: bool = False,
    ):
        super().__init__(message)
        self.partial = partial
        self.deadline_missed = deadline_missed
        self.overwritten = overwritten


class PathUnavailable(WeightTransferError):
    """This path cannot be used now (not set up yet, the learner on another host, the
    replica not in the group): the chain goes on to the next path without counting a
    failure or a fallback."""


class Loaded(NamedTuple):
    """What a source loaded: the version, when the learner published it, and how long
    loading took (the metrics of one swap)."""

    version: int
    published_at: float
    """``time.time()`` of the learner's publish."""
    path: str
    """``"collective"`` | ``"shm"`` | ``"zmq"``."""
    load_s: float
    """Seconds spent loading into the engine."""


@runtime_checkable
class WeightSource(Protocol):
    """One weight-sync path as a replica sees it."""

    name: str

    def sync_into(self, backend: Backend, have_version: int, deadline: float) -> Loaded | None:
        """Load a version newer than ``have_version`` into ``backend``, or return None
        when there is none.

        Loads with ``backend.load_weights`` or the path's own in-place route.
        ``deadline`` is a ``time.monotonic()`` instant; past it, cancel and raise
        :class:`WeightTransferError` (``deadline_missed=True``). On any failure raise
        :class:`WeightTransferError`; never leave the backend serving a mix silently:
        if the engine may hold a partial load, say so (``partial=True``).
        """
        ...

    def close(self) -> None:
        """Release what the source holds (sockets, mappings, groups); idempotent."""
        ...
