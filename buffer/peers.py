"""Which peer may say what to the buffer: roles, generator incarnations, rejections logged.

With ``cluster.auth`` on, every message carries the role its sender
authenticated as, and each role is served only its own requests
(:data:`ROLES_SERVED`, else ``forbidden``). A generator id belongs to one
process at a time, its *incarnation* (:class:`Incarnations`). A refused message
is counted and logged, at most once per reason every few seconds
(:class:`RejectionLog`).
"""

from __future__ import annotations

import logging
from collections import Counter

from asyncrl.buffer.validation import check_generator_id
from asyncrl.core.messages import (
    AdapterPublished,
    BatchRequest,
    EvalResultsRequest,
    Heartbeat,
    Join,
    Leave,
    SaveBufferState,
    StartEval,
    StatusRequest,
    Trajectories,
    WireError,
    WorkRequest,
    _Body,
)
from asyncrl.core.security import GENERATOR, LEARNER, OBSERVER

log = logging.getLogger("asyncrl.buffer")

REJECTION_LOG_EVERY_S = 10.0
"""At most one log line per rejection reason this often; the count of the others rides
along with the next line (every rejection is counted in ``buffer_rejected_<reason>``)."""
ROLES_SERVED: dict[type, frozenset[str]] = {
    BatchRequest: frozenset({LEARNER}),
    AdapterPublished: frozenset({LEARNER}),
    StartEval: frozenset({LEARNER}),
    EvalResultsRequest: frozenset({LEARNER}),
    SaveBufferState: frozenset({LEARNER}),
    WorkRequest: frozenset({GENERATOR}),
    Trajectories: frozenset({GENERATOR}),
    Heartbeat: frozenset({GENERATOR}),
    Join: frozenset({GENERATOR}),
    Leave: frozenset({GENERATOR}),
    StatusRequest: frozenset({LEARNER, GENERATOR, OBSERVER}),
}
"""Which authenticated roles may send each message the buffer serves."""


def authorize(auth: bool, role: str | None, body: _Body) -> None:
    """Refuse (``forbidden``) a message its sender's role may not send; with ``auth``
    off every role is taken at its word."""
    allowed = ROLES_SERVED.get(type(body))
    if auth and allowed is not None and role not in allowed:
        raise WireError(
            "forbidden",
            f"{type(body).__name__} is served to the {' or '.join(sorted(allowed))} only, "
            f"not to a {role}",
        )


class Incarnations:
    """Generator id -> the incarnation it registered while alive.

    The first message of an id not alive registers its incarnation; while it is
    alive, a message naming it with another incarnation is refused
    (``wrong_incarnation``). Only a ``Join`` replaces it (:meth:`register`).
    """

    def __init__(self, alive: dict[str, float]):
        self.alive = alive
        """The store's ``last_seen``: the generator ids alive now."""
        self.by_id: dict[str, int] = {}

    def live(self, generator_id: str) -> int | None:
        """The incarnation ``generator_id`` registered, while it is alive; else None."""
        if generator_id not in self.alive:
            return None
        return self.by_id.get(generator_id)

    def claim(self, generator_id: str, incarnation: int) -> None:
        """The sender of a generator message is ``generator_id``'s live process, or the id
        is free and becomes its (else ``wrong_incarnation``, and nothing is done)."""
        check_generator_id(generator_id)
        live = self.live(generator_id)
        if live is None:
            self.by_id[generator_id] = incarnation
        elif live != incarnation:
            raise WireError(
                "wrong_incarnation",
                f"generator {generator_id} is alive as another process; a restarted process "
                "replaces it with Join",
            )

    def register(self, generator_id: str, incarnation: int) -> None:
        self.by_id[generator_id] = incarnation

    def drop(self, generator_id: str) -> None:
        self.by_id.pop(generator_id, None)


class RejectionLog:
    """Logs a rejection at most once per reason every ``every_s`` seconds, with the count
    of those left out since: a peer sending junk must not flood the buffer's log."""

    def __init__(self, every_s: float = REJECTION_LOG_EVERY_S):
        self.every_s = every_s
        self.last: dict[str, float] = {}
        self.unlogged: Counter[str] = Counter()

    def __call__(self, reason: str, detail: str, now: float) -> None:
        last = self.last.get(reason)
        if last is not None and now - last < self.every_s:
            self.unlogged[reason] += 1
            return
        more = self.unlogged.pop(reason, 0)
        since = f" (and {more} more since the last such line)" if more else ""
        log.warning("rejected a message: %s%s", detail[:300], since)
        self.last[reason] = now
