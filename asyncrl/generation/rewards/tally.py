"""What the scorer counts and logs: each sample's outcome, and what its workers print.

A misbehaving reward function must not flood the generator's log: the first
``LOGGED_PER_TAG`` errors of each tag are logged with their details and the rest only
counted, and what workers print is counted in full but logged as one short excerpt a
minute at most. Kept apart from :mod:`asyncrl.generation.rewards.scorer`, which runs the
workers, so that one reads as the pool it is.
"""

from __future__ import annotations

import collections
import logging
import math
import time

from asyncrl.generation.rewards.outcome import Score
from asyncrl.generation.rewards.processes import WorkerProcess

log = logging.getLogger("asyncrl.rewards")  # the name operators filter on, as the scorer's

LOGGED_PER_TAG = 5
"""Errors of one tag logged with their details; later ones are counted only."""
OUTPUT_LOG_INTERVAL_S = 60.0
"""At most one excerpt of the workers' output is logged per interval; the rest is counted."""


class Tally:
    """Counts into ``counters`` (the scorer's): ``scored``, ``errors``, one entry per error
    tag, and ``worker_output_bytes``; logs within the bounds above."""

    def __init__(self, counters: collections.Counter[str]):
        self.counters = counters
        self._output_logged_at = -math.inf

    def outcome(self, score: Score, data_source: str) -> None:
        """Count one sample's score; log the first few errors of each tag."""
        if score.error is None:
            self.counters["scored"] += 1
            return
        self.counters["errors"] += 1
        self.counters[score.error] += 1
        if self.counters[score.error] <= LOGGED_PER_TAG:
            log.warning("reward %s (data_source %r): %s", score.error, data_source, score.detail)
            if self.counters[score.error] == LOGGED_PER_TAG:
                log.warning("further %s errors are counted, not logged", score.error)

    def output(self, worker: WorkerProcess) -> None:
        """Count what the worker printed, and log the start of it if no excerpt was logged
        in the last minute: a chatty function cannot flood the generator's log."""
        if not worker.output_bytes:
            return
        self.counters["worker_output_bytes"] += worker.output_bytes
        now = time.monotonic()
        if now - self._output_logged_at >= OUTPUT_LOG_INTERVAL_S:
            self._output_logged_at = now
            shown = worker.output.decode(errors="replace")
            more = worker.output_bytes - len(worker.output)
            log.info(
                "reward worker %d printed %d bytes%s (one excerpt a minute is logged):\n%s",
                worker.process.pid,
                worker.output_bytes,
                f", {more} not shown" if more else "",
                shown,
            )
        worker.output.clear()
        worker.output_bytes = 0
