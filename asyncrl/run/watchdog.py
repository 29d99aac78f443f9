"""The launcher's watchdog: a role that stops making progress is reported, not waited on.

The launcher notices a process that exits; this notices one that is still there
but no longer moves: a learner waiting for a batch that never comes, a buffer
whose loop no longer turns, a generator stuck in its engine. Each role reports
what it is doing in ``RUN_DIR/progress/NAME.json`` (:mod:`asyncrl.core.progress`);
:meth:`Watchdog.check`, on every tick of the launcher, returns the roles whose
count of advances has not moved for ``run.stall_timeout_s`` (0: never). A role
that has not advanced yet is ``starting`` (importing, loading its model, joining
the run): its time counts from its start, and it is allowed at least
:data:`START_TIMEOUT_S`. While a generator starts (or waits to be restarted), a
role waiting on generators (the learner waiting for a batch, ``waiting_for``) is
not stalled: its time runs from the generator's first advance. A role frozen in
anything else (a training step) is stalled all the same. What the launcher does
with a stall is its business: stop the run for the learner or the buffer,
replace a generator.

Time is the launcher's own monotonic clock, read when it sees a count move, so
the roles' clocks (other machines under Ray) never enter the decision; their
wall-clock times only label the report. A report of another process under the
same name (a generator before its restart, an earlier launch) is not this
process's and is ignored. Under Ray, a role on another node whose report never
appears (the run directory is not shared there) is said once and not watched.

:func:`failure_line` and :class:`StartFailures` serve the other half of the
supervision: a generator that exits before making any progress, the same way
every time, stops the run instead of being restarted for ever.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from asyncrl.core import progress
from asyncrl.core.progress import Report

REPORT_SLACK_S = 60.0
"""A report that began this long before its process was started is an older one's
(a reused pid), even with the clocks of two machines apart."""
START_TIMEOUT_S = 300.0
"""A role that has not advanced yet (importing, loading its model, joining the run) is
stalled only after the longer of this and ``run.stall_timeout_s``."""
START_FAILURES = 3
"""A generator that exits this many times in a row before making any progress,
with the same last error line, stops the run."""
RESTART_MARK = "---- asyncrl launch: restart"
"""Begins the line the launcher writes into a generator's log before each restart."""
_LOG_PREFIX = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d[,.]\d+ \S+ ")
"""``2025-01-31 12:00:00,123 generator-0 ``: the part of a log line that differs per start."""


def clock_time(wall: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(wall))


@dataclass
class Watched:
    """One process the watchdog follows, with what it last saw of its report."""

    name: str
    role: str
    pid: int | None
    started: float
    """The launcher's ``time.monotonic()`` when it started the process."""
    started_wall: float
    alive: Callable[[], bool]
    local: bool = True
    """Its report should appear in this launcher's run directory."""
    advanced: float = 0.0
    """The launcher's monotonic time when it last saw the count of advances move."""
    seen: int | None = None
    report: Report | None = None
    noted: bool = False
    """Said once that its report never appeared (a role on another node)."""

    @property
    def starting(self) -> bool:
        """It never got past its start (no report, or no advance in it)."""
        return self.report is None or self.report.advances == 0


@dataclass
class Stall:
    """A role that made no progress for its allowance."""

    watched: Watched
    idle_s: float
    timeout_s: float
    """``run.stall_timeout_s``."""
    allowance_s: float
    """What it was allowed: longer while starting (:data:`START_TIMEOUT_S`) or when it
    asked for patience."""

    @property
    def name(self) -> str:
        return self.watched.name

    @property
    def role(self) -> str:
        return self.watched.role

    @property
    def starting(self) -> bool:
        return self.watched.starting

    def describe(self) -> str:
        """``learner (pid 12) stalled: no progress for 31s (...); since 10:00:01 it has
        been waiting for a batch for step 4``."""
        watched, report = self.watched, self.watched.report
        head = f"{watched.name} (pid {watched.pid}) stalled"
        limit = f"run.stall_timeout_s={self.timeout_s:g}"
        if self.allowance_s > self.timeout_s:
            limit += f"; {self.allowance_s:.0f}s allowed {'to start' if self.starting else 'here'}"
        if report is None:
            return f"{head}: no progress report in {self.idle_s:.0f}s since it started ({limit})"
        return (
            f"{head}: no progress for {self.idle_s:.0f}s ({limit}); since "
            f"{clock_time(report.since)} it has been {report.what()}"
        )

    def reason(self) -> str:
        """The same words at every such stall, for :class:`StartFailures` to compare."""
        report = self.watched.report
        doing = report.what() if report is not None else progress.STARTING
        return f"stalled (no progress for {self.allowance_s:.0f}s) while {doing}"


class Watchdog:
    """Which watched roles made no progress for ``timeout_s``; see the module docstring."""

    def __init__(
        self,
        run_dir: Path,
        timeout_s: float,
        notify: Callable[[str], None] = print,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ):
        self.run_dir = run_dir
        self.timeout_s = timeout_s
        self.notify = notify
        self.clock = clock
        self.wall = wall
        self.watched: dict[str, Watched] = {}

    def watch(
        self,
        name: str,
        role: str,
        pid: int | None,
        alive: Callable[[], bool] = lambda: True,
        local: bool = True,
    ) -> None:
        """Follow ``name``'s process ``pid``, started now (replacing an earlier one's entry)."""
        now = self.clock()
        self.watched[name] = Watched(name, role, pid, now, self.wall(), alive, local, now)

    def forget(self, name: str) -> None:
        self.watched.pop(name, None)

    def generators_restarting(self) -> None:
        """A generator is down until its restart: a role that waits on generators (the
        learner waiting for a batch) waits on that restart, and is not stalled meanwhile."""
        now = self.clock()
        for watched in self.watched.values():
            if watched.report is not None and watched.report.waiting_for == "generators":
                watched.advanced = max(watched.advanced, now)

    def check(self) -> list[Stall]:
        """The live roles that made no progress for their allowance (none when off).

        While a generator is starting, a role waiting on generators (the learner waiting
        for a batch) waits on it: its time runs from that generator's first advance.
        """
        if not self.timeout_s:
            return []
        now, stalls = self.clock(), []
        live = [watched for watched in list(self.watched.values()) if watched.alive()]
        waited_on = self._generator_starting(live)  # as of the last look
        for watched in live:
            self.observe(watched, now)
        if waited_on or self._generator_starting(live):  # started since, or still starting
            self.generators_restarting()
        self._excuse_waiting_on_learner(live, now)
        for watched in live:
            if watched.report is None and not watched.local:
                self._note_unwatched(watched, now)
                continue
            allowance = self.allowance_s(watched)
            if now - watched.advanced >= allowance:
                stalls.append(Stall(watched, now - watched.advanced, self.timeout_s, allowance))
        return stalls

    @staticmethod
    def _generator_starting(live: list[Watched]) -> bool:
        """A generator is starting, not merely waiting for the learner's weights."""
        return any(
            w.role == "generator" and w.starting and w.local and not _waits_on_learner(w)
            for w in live
        )

    @staticmethod
    def _excuse_waiting_on_learner(live: list[Watched], now: float) -> None:
        """A role waiting on a live learner (a generator fetching its weights) is not
        stalled: if the learner is frozen, the learner's own allowance runs out and the
        run stops naming it, instead of its waiters being blamed and restarted."""
        if any(w.role == "learner" for w in live):
            for watched in live:
                if _waits_on_learner(watched):
                    watched.advanced = max(watched.advanced, now)

    def allowance_s(self, watched: Watched) -> float:
        """``run.stall_timeout_s``; at least :data:`START_TIMEOUT_S` while starting, and at
        least the patience its report asks for."""
        allowance = self.timeout_s
        if watched.starting:
            allowance = max(allowance, START_TIMEOUT_S)
        if watched.report is not None:
            allowance = max(allowance, watched.report.patience_s)
        return allowance

    def observe(self, watched: Watched, now: float) -> None:
        """Read ``watched``'s report; a count that moved is an advance seen now."""
        report = self.report_of(watched.name, watched.pid, watched.started_wall)
        if report is None:
            return
        if report.advances != (watched.seen or 0):  # 0 until its loop runs
            watched.advanced = now
        watched.report, watched.seen = report, report.advances

    def report_of(self, name: str, pid: int | None, started_wall: float) -> Report | None:
        """``name``'s report if it is the process ``pid``'s, else None."""
        report = progress.read(self.run_dir, name)
        if report is None or report.pid != pid:
            return None
        if report.started < started_wall - REPORT_SLACK_S:
            return None
        return report

    def made_progress(self, name: str) -> bool | None:
        """Whether the watched ``name`` ever advanced; None when it wrote no report."""
        watched = self.watched.get(name)
        if watched is None:
            return None
        report = self.report_of(name, watched.pid, watched.started_wall)
        if report is None:
            report = watched.report
        return None if report is None else report.advances > 0

    def _note_unwatched(self, watched: Watched, now: float) -> None:
        if watched.noted or now - watched.started < self.timeout_s:
            return
        watched.noted = True
        self.notify(
            f"asyncrl: no progress report from {watched.name} in {now - watched.started:.0f}s "
            f"(is {self.run_dir} shared with its node?): its progress is not watched"
        )

    def summary(self, leave_out: str = "") -> str:
        """What every other watched role last reported, a line each."""
        now = self.clock()
        lines = []
        for watched in self.watched.values():
            if watched.name == leave_out:
                continue
            report = watched.report
            if report is None:
                lines.append(f"    {watched.name}: no progress report")
                continue
            lines.append(
                f"    {watched.name}: {report.what()} since {clock_time(report.since)}; "
                f"last advanced {now - watched.advanced:.0f}s ago"
            )
        return "\n".join(lines)

    def others(self, leave_out: str, what: str = "processes") -> str:
        """``\nwhat the other processes last reported:`` and :meth:`summary`; empty
        when no other process is watched. Appended to a failure, it shows the cause."""
        summary = self.summary(leave_out)
        return f"\nwhat the other {what} last reported:\n{summary}" if summary else ""


def failure_line(log_path: Path, fallback: str = "") -> str:
    """The last line of ``log_path`` that says something, without its timestamp (a
    traceback's last line: ``RuntimeError: ...``); ``fallback`` when there is none."""
    try:
        with log_path.open("rb") as log:
            log.seek(0, 2)
            log.seek(max(0, log.tell() - 8192))
            text = log.read().decode(errors="replace")
    except OSError:
        return fallback
    for line in reversed(text.splitlines()):
        if line.startswith(RESTART_MARK):  # what is above is an earlier process's
            break
        if line.strip():
            return _LOG_PREFIX.sub("", line.strip())
    return fallback


@dataclass
class StartFailures:
    """A generator's exits that came before any progress, in a row, while they look alike."""

    count: int = 0
    line: str = ""

    def record(self, made_progress: bool, line: str) -> bool:
        """Count an exit; True once :data:`START_FAILURES` in a row failed with ``line``."""
        if made_progress:
            self.count, self.line = 0, ""
            return False
        if line != self.line:
            self.count, self.line = 0, line
        self.count += 1
        return self.count >= START_FAILURES

    def describe(self) -> str:
        return (
            f"failed {self.count} times in a row before making any progress, "
            f"each time with: {self.line}"
        )


def _waits_on_learner(watched: Watched) -> bool:
    return watched.report is not None and watched.report.waiting_for == "learner"
