"""Threads for environment calls that may never return.

A thread cannot be killed in Python: when an environment's ``reset`` or
``step`` hangs (a tool stuck in a C call, a socket that never answers), the
driver can only stop waiting for it. :class:`StepPool` makes that safe:

- ``abandon(job)`` gives a call up. A queued one never runs. A running one
  keeps its thread, which stops counting as a worker: a new thread takes its
  place, so ``workers`` calls can still run at once, and the stuck thread ends
  by itself if the call ever returns (its result is dropped).
- At most ``workers + max_stuck`` threads exist at once, so an environment that
  always hangs cannot pile up threads without bound. Past that, calls run on
  the workers left, and :attr:`StepPool.stalled` says when there are none: the
  caller then fails the queued calls at once rather than waiting for ever.
- ``busy_s`` adds up the seconds calls ran on the threads, measured on each thread
  from the call's start to its end (a stuck call counts once it returns), so the time
  spent in environments can be set against the time spent generating.
- Its threads are daemons, so a stuck one never holds the process at exit
  (:class:`concurrent.futures.ThreadPoolExecutor` joins its threads when the
  interpreter exits: one stuck step would hang the generator's shutdown).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any


@dataclass(eq=False)
class Job:
    """One call on the pool; ``future`` gives its result."""

    fn: Callable[..., Any]
    args: tuple
    future: Future = field(default_factory=Future)
    started_at: float | None = None
    """``time.monotonic()`` when a thread began the call; None while it is queued."""
    abandoned: bool = False

    @property
    def done(self) -> bool:
        return self.future.done()


class StepPool:
    """``workers`` threads running calls in order of submission; see the module doc."""

    def __init__(self, workers: int, *, max_stuck: int = 64, name: str = "environment"):
        if workers < 1 or max_stuck < 0:
            raise ValueError(f"need workers >= 1 and max_stuck >= 0, got {workers}, {max_stuck}")
        self.workers = workers
        self.max_stuck = max_stuck
        self.name = name
        self.stuck = 0
        """Abandoned threads still inside their call."""
        self.abandoned = 0
        """Calls given up while running, in total."""
        self.busy_s = 0.0
        """Seconds the threads spent inside calls that have returned (or raised)."""
        self._cond = threading.Condition()
        self._queue: deque[Job] = deque()
        self._live = 0  # threads that are workers: not abandoned, not exited
        self._idle = 0  # of those, how many wait for a job (or are starting)
        self._numbers = itertools.count()
        self._closed = False

    def submit(self, fn: Callable[..., Any], *args: Any) -> Job:
        job = Job(fn, args)
        with self._cond:
            if self._closed:
                raise RuntimeError(f"the {self.name} thread pool is closed")
            self._queue.append(job)
            self._grow()
            self._cond.notify()
        return job

    def abandon(self, job: Job) -> bool:
        """Stop waiting for ``job``; False when it has already finished (use its result)."""
        with self._cond:
            if job.future.done():
                return False
            job.abandoned = True
            if job.started_at is None:
                self._queue.remove(job)
                job.future.cancel()
                return True
            self._live -= 1
            self.stuck += 1
            self.abandoned += 1
            self._grow()
            return True

    @property
    def stalled(self) -> bool:
        """No thread is left to run a queued call, and none may be started."""
        with self._cond:
            return self._live == 0 and self.stuck >= self.workers + self.max_stuck

    def close(self) -> None:
        """Cancel the queued calls and let idle threads exit; running ones are not waited for."""
        with self._cond:
            self._closed = True
            for job in self._queue:
                job.future.cancel()
            self._queue.clear()
            self._cond.notify_all()

    def _grow(self) -> None:
        """Start threads for queued calls no idle thread will take (the lock is held)."""
        allowed = min(self.workers, self.workers + self.max_stuck - self.stuck)
        while self._live < allowed and self._idle < len(self._queue):
            self._live += 1
            self._idle += 1
            name = f"{self.name}-{next(self._numbers)}"
            threading.Thread(target=self._run, name=name, daemon=True).start()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                self._idle -= 1
                if self._closed:
                    self._live -= 1
                    return
                job = self._queue.popleft()
                job.started_at = time.monotonic()
            if job.future.set_running_or_notify_cancel():
                self._call(job)
            with self._cond:
                if job.abandoned:  # given up while it ran: a replacement has taken this place
                    self.stuck -= 1
                    self._grow()
                    return
                self._idle += 1

    def _call(self, job: Job) -> None:
        """Run ``job`` on this thread; its time is counted before its future is done, so
        whoever sees the result sees the time too."""
        assert job.started_at is not None
        error: BaseException | None = None
        try:
            result = job.fn(*job.args)
        except BaseException as raised:  # SystemExit too: an environment must not end this
            result, error = None, raised
        spent = time.monotonic() - job.started_at
        with self._cond:
            self.busy_s += spent
        if error is None:
            job.future.set_result(result)
        else:
            job.future.set_exception(error)
