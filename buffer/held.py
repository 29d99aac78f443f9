"""Requests the buffer holds instead of answering at once, and their deadlines.

A ``WorkRequest`` with ``wait_s > 0`` that finds nothing to hand out is held
(one per generator id, a newer one replacing it): after each turn of the loop
in which dispatch could have changed its answer (the store's
:meth:`~asyncrl.buffer.store.BufferStore.dispatch_state` moved) the held
requests are tried again in arrival order, and one still empty at its deadline
is answered with an empty grant. The learner's ``EvalResultsRequest`` is held
the same way until the running round completes or its deadline passes.

This module only keeps them; the service tries and answers them.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass
class HeldRequest:
    """A WorkRequest waiting for work: whom to answer, what it asked for, until when."""

    identity: bytes
    generator_id: str
    max_samples: int
    deadline: float
    """``time.monotonic()`` after which it is answered with an empty grant."""


@dataclass
class HeldResultsRequest:
    """An EvalResultsRequest waiting for the running round to complete."""

    identity: bytes
    deadline: float
    """``time.monotonic()`` after which it is answered with what there is (maybe nothing)."""


class HeldRequests:
    """Work requests waiting for work, by generator id, oldest first; and the learner's
    request for eval results, if one waits."""

    def __init__(self) -> None:
        self.work: dict[str, HeldRequest] = {}
        self.results: HeldResultsRequest | None = None
        self.tried_at: tuple | None = None
        """The store's dispatch state when the held work requests were last tried."""

    def __contains__(self, generator_id: str) -> bool:
        return generator_id in self.work

    def __len__(self) -> int:
        return len(self.work)

    def __iter__(self) -> Iterator[HeldRequest]:
        """The held work requests in arrival order (a copy: answering removes them)."""
        return iter(list(self.work.values()))

    def hold(self, request: HeldRequest) -> None:
        self.work[request.generator_id] = request

    def pop(self, generator_id: str) -> HeldRequest | None:
        """Stop holding ``generator_id``'s request (to answer it now), if one is held."""
        return self.work.pop(generator_id, None)

    def release(self, request: HeldRequest) -> None:
        """``request`` is being answered: no longer held (a newer one of its id stays)."""
        if self.work.get(request.generator_id) is request:
            del self.work[request.generator_id]

    def worth_trying(self, dispatch_state: tuple) -> bool:
        """Work requests are held and dispatch may answer differently since last tried."""
        return bool(self.work) and dispatch_state != self.tried_at

    def tried(self, dispatch_state: tuple) -> None:
        self.tried_at = dispatch_state

    def expired(self, now: float) -> list[HeldRequest]:
        """The held work requests whose deadline has come."""
        return [held for held in self.work.values() if held.deadline <= now]

    def hold_results(self, request: HeldResultsRequest) -> None:
        self.results = request

    def take_results(self, now: float, ready: bool) -> HeldResultsRequest | None:
        """The held results request, released, once it can be answered: the results are
        ``ready`` or its deadline has come (``now = math.inf``: answer it regardless)."""
        held = self.results
        if held is None or (now < held.deadline and not ready):
            return None
        self.results = None
        return held

    def poll_timeout_ms(self, longest_ms: int, now: float) -> int:
        """``longest_ms``, or less when a held request's deadline comes first."""
        deadlines = [held.deadline for held in self.work.values()]
        if self.results is not None:
            deadlines.append(self.results.deadline)
        if not deadlines:
            return longest_ms
        return max(0, min(longest_ms, math.ceil((min(deadlines) - now) * 1000)))
