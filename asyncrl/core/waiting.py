"""The one wait that a stop can end: for a reply, for processes to exit, for Ray tasks.

A wait that blocks for its whole timeout would hold a stopping process (a
learner whose buffer died, a launcher asked to hurry) for that long, so every
such wait runs in slices: :func:`wait_with_stop` asks ``ready(slice_s)`` (which
blocks at most that long: a socket's ``poll``, ``ray.wait``, a short sleep),
checks ``stop()`` between slices, and says how the wait ended (:class:`Waited`).
Once ``stop()`` is true the wait ends at once, or goes on ``grace_s`` more where
the answer is still worth having (a final checkpoint's reply).
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable


class Waited(enum.Enum):
    """How :func:`wait_with_stop` ended."""

    READY = "ready"
    """``ready`` said yes."""
    STOPPED = "stopped"
    """``stop()`` came first (and its ``grace_s``, if any, ran out)."""
    TIMED_OUT = "timed out"
    """``timeout_s`` passed, with no stop."""


def never() -> bool:
    return False


def wait_with_stop(
    ready: Callable[[float], bool],
    timeout_s: float,
    stop: Callable[[], bool] = never,
    slice_s: float = 0.1,
    grace_s: float = 0.0,
    clock: Callable[[], float] = time.monotonic,
) -> Waited:
    """Call ``ready(s)`` (blocking at most ``s`` seconds) until it returns True, for at
    most ``timeout_s``, checking ``stop()`` between slices of ``slice_s``.

    ``ready`` is asked at least once, also when ``timeout_s`` is 0 or less (with 0:
    a look without waiting). A ``stop()`` that turns true cuts the wait to ``grace_s``
    from then on (0: it ends now); it ends as :attr:`Waited.STOPPED`.
    """
    deadline = clock() + timeout_s
    stopped = False
    while True:
        if ready(max(0.0, min(slice_s, deadline - clock()))):
            return Waited.READY
        if not stopped and stop():
            stopped = True
            deadline = min(deadline, clock() + grace_s)
        if clock() >= deadline:
            return Waited.STOPPED if stopped else Waited.TIMED_OUT
