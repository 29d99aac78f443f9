"""The one way a process of a run hears that it should stop: SIGTERM, SIGINT (and SIGHUP).

Every process that stops on a signal (the launcher, the Ray driver, a role in
a Ray actor, the learner, a generator) installs :class:`StopSignals` instead of
writing its own handlers. It records the first stop signal (:attr:`signum`,
``stop_signals()`` is then True, so it can be handed on as a ``stop`` callable),
calls ``on_stop`` once with it (a callback, or :func:`raise_interrupted` to end
the main loop at once), and counts any later one as a request to hurry
(:attr:`hurried`): a second Ctrl-C skips the waits of a stop already under way.
Used as a context manager it puts the previous handlers back on the way out.

A child that ignores Ctrl-C so that its parent decides when it stops (a reward
worker) is another job: it sets ``SIG_IGN`` itself.
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterable
from types import FrameType
from typing import Any

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
"""What stops a launch (SIGHUP: its terminal went away)."""
ROLE_SIGNALS = (signal.SIGTERM, signal.SIGINT)
"""What stops a role: its launcher's SIGTERM, or Ctrl-C when it was started by hand."""


class Interrupted(Exception):
    """A stop signal came: raised in the main loop, by the handler (:func:`raise_interrupted`)
    or by :meth:`StopSignals.check`."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def raise_interrupted(signum: int) -> None:
    """An ``on_stop`` that ends whatever the main thread is doing with :class:`Interrupted`."""
    raise Interrupted(signum)


class StopSignals:
    """Handlers for ``signals``: the first one is a stop, later ones ask it to hurry."""

    def __init__(
        self,
        signals: Iterable[int] = STOP_SIGNALS,
        on_stop: Callable[[int], None] | None = None,
    ) -> None:
        self.signals = tuple(signals)
        self.on_stop = on_stop
        """Called once, in the handler, with the first stop signal."""
        self.signum: int | None = None
        """The first stop signal, once one came."""
        self.stopping = False
        """Set by the first signal, or by the caller when its stop begins: from then on a
        signal only hurries the stop."""
        self.hurried = False
        self.previous: dict[int, Any] = {}

    def install(self) -> StopSignals:
        """Install the handlers (for the rest of the process, unless :meth:`restore` runs)."""
        for sig in self.signals:
            self.previous[sig] = signal.signal(sig, self._handle)
        return self

    def restore(self) -> None:
        """Put back the handlers that were there before :meth:`install`."""
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        self.previous.clear()

    def __enter__(self) -> StopSignals:
        return self.install()

    def __exit__(self, *_: object) -> None:
        self.restore()

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        if self.stopping:
            self.hurried = True
            return
        self.signum, self.stopping = signum, True
        if self.on_stop is not None:
            self.on_stop(signum)

    def __call__(self) -> bool:
        """True once a stop signal came (a ``stop`` callable for loops and waits)."""
        return self.signum is not None

    def check(self) -> None:
        """Raise :class:`Interrupted` once a stop signal has come (for loops that poll)."""
        if self.signum is not None:
            raise Interrupted(self.signum)

    def hurry(self) -> bool:
        """True once a signal came after the stop began."""
        return self.hurried
