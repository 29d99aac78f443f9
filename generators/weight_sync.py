"""A replica's weight sync: its chain of paths, each with a deadline, falling back in order.

::

    collective ──fails / misses its deadline──▶ shm ──▶ zmq ──▶ all failed: raise

:meth:`WeightSync.sync` asks each path of the chain (built by
:func:`asyncrl.weights.paths.replica_sources`) in turn, each with
``deadline = now + weights.deadline_s``. The first that loads a version, or
says there is none newer, ends the sync. A path that cannot be used now
(``PathUnavailable``: no segment on this host, not in the group yet) is passed
over silently; one that fails or misses its deadline is counted, logged with
the replica, the path and the version held, and the next one is tried at once.

A failed path that may have left part of a version in the engine
(``partial``) makes the next path reload a whole version whatever the engine
says it holds. When every path failed the sync raises, so the replica exits
(the supervisor restarts it, counted): it never generates with weights it
cannot vouch for, and a failing learner is not silently fallen behind. A
path's claim is checked against the engine: tokens carry ``backend.version``,
so it must be the version the path says it loaded.

A version a path refused (:class:`~asyncrl.weights.checks.WeightsRefused`: its
layout is not the engine's, or a value is not finite) is not a broken path: the
next path is tried for it all the same, and when none loads it and the engine
still holds a whole version, the replica keeps serving that one (it can vouch
for it) instead of exiting: a bad slot never makes it crash-loop. The path
remembers what it refused and does not check it again; a later version is
taken as usual.

Counters (in the replica's stats, so ``generators_<counter>_total`` in the
run's metrics): ``weights_transfer_failures``, ``weights_deadline_missed``,
``weights_fallbacks``, per path ``weights_failures_<path>`` and, when the
chain has more than one path, ``weights_loads_<path>``; from the shm path,
``weights_shm_overlaps`` (reads a write overlapped, read again) and
``weights_shm_followed`` (loads that followed the learner's write); per path and reason
``weights_<path>_refused_<nonfinite|layout>`` and in all ``weights_refused`` (versions
refused by the checks): every name is in :data:`asyncrl.core.weight_messages.WEIGHT_SYNC_STATS`.
"""

from __future__ import annotations

import logging
import time
from collections import Counter

from asyncrl.core.connection_guard import RateLimitedLog
from asyncrl.core.weight_messages import WEIGHT_SYNC_STATS
from asyncrl.generators.backend import Backend
from asyncrl.weights.checks import REFUSAL_LOG_INTERVAL_S, WeightsRefused, since
from asyncrl.weights.source import Loaded, PathUnavailable, WeightSource, WeightTransferError

log = logging.getLogger("asyncrl.generator")


class WeightSync:
    """Tries each path of ``sources`` in order until one loads or finds nothing newer."""

    def __init__(self, sources: list[WeightSource], deadline_s: float, replica: str):
        if not sources:
            raise ValueError("a weight-sync chain needs at least one path")
        self.sources = sources
        self.deadline_s = deadline_s
        self.replica = replica
        self.counters: Counter[str] = Counter()
        self._unavailable: set[str] = set()  # paths whose unavailability was logged
        self._kept = RateLimitedLog(REFUSAL_LOG_INTERVAL_S)

    def sync(self, backend: Backend) -> Loaded | None:
        """Load a newer version if any path has one; raise WeightTransferError when every
        path failed (``partial`` when the engine may hold a mix)."""
        have = backend.version
        partial = refused = False
        failure: WeightTransferError | None = None
        failed_path = ""
        for source in self.sources:
            if failure is not None:
                self.counters["weights_fallbacks"] += 1
                log.warning(
                    "%s: falling back from %s to %s", self.replica, failed_path, source.name
                )
            deadline = time.monotonic() + self.deadline_s
            try:
                loaded = self._try(source, backend, -1 if partial else have, deadline)
            except PathUnavailable as error:
                if source.name not in self._unavailable:
                    self._unavailable.add(source.name)
                    log.info(
                        "%s: weight path %s is not available: %s", self.replica, source.name, error
                    )
                continue
            except WeightsRefused as error:  # counted and logged by the path
                refused, partial = True, partial or error.partial
                failure, failed_path = error, source.name
                continue
            except WeightTransferError as error:
                self._count_failure(source.name, error, have)
                partial = partial or error.partial
                failure, failed_path = error, source.name
                continue
            self._unavailable.discard(source.name)
            if loaded is None and partial:  # nothing to restore the engine with
                failure = WeightTransferError(
                    f"{source.name}: no whole version to reload", partial=True
                )
                self._count_failure(source.name, failure, have)
                failed_path = source.name
                continue
            if loaded is not None and len(self.sources) > 1:
                self.counters[f"weights_loads_{loaded.path}"] += 1
            return loaded
        if failure is None:  # every path unavailable: only possible without zmq
            return None
        if refused and not partial:  # a bad version, whole weights held: serve those
            if count := self._kept.due("kept"):
                log.warning(
                    "%s: no path had a version it could load; serving v%d%s; last: %s",
                    self.replica,
                    have,
                    since(count),
                    failure,
                )
            return None
        raise WeightTransferError(
            f"{self.replica}: every weight path failed (holding v{have}"
            f"{', engine may hold a partial load' if partial else ''}); last: {failure}",
            partial=partial,
        ) from failure

    def _try(
        self, source: WeightSource, backend: Backend, have: int, deadline: float
    ) -> Loaded | None:
        loaded = source.sync_into(backend, have, deadline)
        if loaded is not None and time.monotonic() > deadline:  # whole and checked: kept
            self.counters["weights_deadline_missed"] += 1
            log.warning(
                "%s: v%d over %s loaded past its %.0fs deadline",
                self.replica,
                loaded.version,
                source.name,
                self.deadline_s,
            )
        if loaded is not None and backend.version != loaded.version:
            raise WeightTransferError(
                f"{source.name} says it loaded v{loaded.version}, the engine holds "
                f"v{backend.version}",
                partial=True,
            )
        return loaded

    def _count_failure(self, path: str, error: WeightTransferError, have: int) -> None:
        self.counters["weights_transfer_failures"] += 1
        self.counters[f"weights_failures_{path}"] += 1
        if error.deadline_missed:
            self.counters["weights_deadline_missed"] += 1
        log.warning(
            "%s: weight sync over %s failed (holding v%d, deadline %.0fs%s): %s",
            self.replica,
            path,
            have,
            self.deadline_s,
            ", missed" if error.deadline_missed else "",
            error,
        )

    def stats(self) -> dict[str, float]:
        """The counters that are not zero (nothing new in the stats until something happens),
        with the paths' own as ``weights_<path>_<counter>`` where the buffer accepts them."""
        counts = Counter(self.counters)
        for source in self.sources:
            for name, value in getattr(source, "counters", {}).items():
                key = f"weights_{source.name}_{name}"
                if key in WEIGHT_SYNC_STATS:
                    counts[key] += value
                if name.startswith("refused_"):
                    counts["weights_refused"] += value
        return {key: float(value) for key, value in counts.items() if value}

    def close(self) -> None:
        for source in self.sources:
            source.close()
