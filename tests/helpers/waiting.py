"""Waiting in tests for something another thread or process does: one poll loop.

:func:`wait_until` fails the test (AssertionError) when the wait runs out;
:func:`came_true` only says whether it came true, for a caller that decides.
"""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(
    condition: Callable[[], object],
    timeout_s: float = 30.0,
    *,
    what: str = "the condition",
    every_s: float = 0.02,
    while_waiting: Callable[[], object] | None = None,
) -> None:
    """Return once ``condition()`` is true, checking every ``every_s``; an AssertionError
    naming ``what`` once ``timeout_s`` passed without it. ``while_waiting`` runs before
    each sleep (a heartbeat that keeps a peer alive, a check that the process waited on
    still runs: its own AssertionError ends the wait at once)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if while_waiting is not None:
            while_waiting()
        assert time.monotonic() < deadline, f"timed out after {timeout_s:g}s waiting for {what}"
        time.sleep(every_s)


def came_true(predicate: Callable[[], object], within_s: float, every_s: float = 0.05) -> bool:
    """Whether ``predicate()`` came true within ``within_s``, checking every ``every_s``."""
    end = time.monotonic() + within_s
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(every_s)
    return False
