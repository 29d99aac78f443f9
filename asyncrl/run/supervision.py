"""The supervision policy of a run, the same under the local launcher and under Ray.

=========== ================================== =====================================
role        when it ends                       what the supervisor does
=========== ================================== =====================================
generator   any way, while the run goes        restart it after a back-off (1 s,
                                               doubling to 30 s; back to 1 s once it
                                               stayed up 60 s) with ``--restarts N``
generator   before any progress, 3 times in    stop the run with that line
            a row, with the same last log line
learner     cleanly                            the run is done
learner     any other way                      stop the run, show its log's tail
buffer      any way                            stop the run, show its log's tail
=========== ================================== =====================================

A role that stays but makes no progress for ``run.stall_timeout_s``
(:mod:`asyncrl.run.watchdog`) is killed and restarted as above if it is a
generator; a stalled learner or buffer stops the run, with what every other
role last reported. The stop goes in dependency order (:func:`stop_phases`):
generators, then the learner (its final checkpoint needs the buffer), then the
buffer.

:class:`Supervision` makes these decisions from events (a generator ended, its
back-off is over, the watchdog found a stall); a backend subclasses it and says
how its roles are described, killed and started: processes by pid
(:class:`asyncrl.run.local_run.Supervisor`) or Ray actors
(:class:`asyncrl.run.ray.run.RayRun`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from asyncrl.config import Config
from asyncrl.core.waiting import wait_with_stop
from asyncrl.run.console import ReplicaHealth
from asyncrl.run.watchdog import RESTART_MARK, Stall, StartFailures, Watchdog, failure_line

GENERATORS_STOP_S = 4.0
"""Generators finish their chunk and leave within this."""
BUFFER_STOP_S = 2.0
"""The buffer exits within this after the learner."""
BACKOFF_FIRST_S = 1.0
BACKOFF_MAX_S = 30.0
STABLE_AFTER_S = 60.0
"""A generator up this long before it ends restarts after the first back-off again."""
LOG_TAIL_LINES = 20
RESTART_TAIL_LINES = 3
"""Log lines shown with a generator's restart note (the run goes on)."""

Member = TypeVar("Member")
"""A backend's handle on a role's process or actor."""


def stop_phases(config: Config, slack_s: float = 0.0) -> tuple[tuple[str, float], ...]:
    """Seconds into the stop by which each role must have exited after its SIGTERM.

    The learner's share is ``learner.stop_timeout_s`` (its final checkpoint);
    ``slack_s`` is added to each phase (Ray sends its signals through tasks).
    """
    generators = GENERATORS_STOP_S + slack_s
    learner = generators + config.learner.stop_timeout_s + slack_s
    return (("generator", generators), ("learner", learner), ("buffer", learner + BUFFER_STOP_S))


def stop_timeout_s(config: Config, slack_s: float = 0.0) -> float:
    """Every process of the run is gone this long after the stop began."""
    return stop_phases(config, slack_s)[-1][1] + 1.0


@dataclass
class Replica:
    """A generator slot: the process in it comes and goes, the slot and its history stay."""

    name: str
    pool: str
    index: int
    restarts: int = 0
    started_at: float = 0.0
    restart_at: float | None = None
    """``time.monotonic()`` at which to start it again; None while it runs."""
    backoff_s: float = BACKOFF_FIRST_S
    """The wait before its next restart."""
    failures: StartFailures = field(default_factory=StartFailures)
    """Its exits before making any progress, in a row (the run stops at the limit)."""
    stall: Stall | None = None
    """Why the watchdog killed its process, until that exit is handled."""

    def role_args(self) -> list[str]:
        """``--index``, ``--pool`` and, once restarted, ``--restarts`` for ``asyncrl.run.roles``."""
        extra = ["--index", str(self.index), "--pool", self.pool]
        return extra + (["--restarts", str(self.restarts)] if self.restarts else [])

    def mark_restart(self, log_path: Path) -> None:
        """Separate the restarted process's output from the last one's in its log."""
        with contextlib.suppress(OSError), log_path.open("a") as log_file:
            log_file.write(f"{RESTART_MARK} {self.restarts} ----\n")

    def exited(self, made_progress: bool | None, uptime_s: float, line: str) -> bool:
        """Count an exit; True when the run should stop: the same ``line`` ended
        :data:`~asyncrl.run.watchdog.START_FAILURES` starts in a row that made no progress.

        Without a progress report (``made_progress`` None) a process that stayed up
        :data:`STABLE_AFTER_S` counts as having made progress. A process the watchdog
        killed failed with its stall (:meth:`~asyncrl.run.watchdog.Stall.reason`).
        """
        if self.stall is not None:
            made_progress, line = not self.stall.starting, self.stall.reason()
            self.stall = None
        if made_progress is None:
            made_progress = uptime_s >= STABLE_AFTER_S
        return self.failures.record(made_progress, line)

    def schedule_restart(self, now: float) -> float:
        """Set :attr:`restart_at` after the back-off; returns the wait in seconds.

        The wait doubles with each exit (up to :data:`BACKOFF_MAX_S`), so a
        replica that cannot start does not spin, and starts over once the
        replica stayed up :data:`STABLE_AFTER_S`.
        """
        if now - self.started_at >= STABLE_AFTER_S:
            self.backoff_s = BACKOFF_FIRST_S
        delay = self.backoff_s
        self.backoff_s = min(2 * delay, BACKOFF_MAX_S)
        self.restart_at = now + delay
        return delay


class Supervision:
    """The decisions of the table above, from events; a backend subclasses it.

    The backend sets :attr:`run_dir`, :attr:`watchdog`, :attr:`replicas` and
    :attr:`notify`, and implements the hooks: :meth:`describe`,
    :meth:`kill_stalled`, :meth:`is_up` and :meth:`is_stopped` (and
    :meth:`restarting` where a restart has more to wait for than its back-off).
    """

    peers = "processes"
    """What the roles are called in a failure's ``what the other ... last reported``."""
    config: Config
    run_dir: Path
    watchdog: Watchdog
    replicas: dict[str, Replica]
    notify: Callable[[str], None]

    # ---------------------------------------------------------------- hooks

    def describe(self, name: str, why: str, lines: int = LOG_TAIL_LINES) -> str:
        """``NAME WHY; last lines of LOG:`` and its tail, as this backend says it."""
        raise NotImplementedError

    def kill_stalled(self, replica: Replica) -> str:
        """Kill the stalled ``replica``'s process or actor; the words for the note."""
        raise NotImplementedError

    def is_up(self, replica: Replica) -> bool:
        """A process or actor of ``replica``'s is there to kill."""
        raise NotImplementedError

    def is_stopped(self, replica: Replica) -> bool:
        """``replica`` ended and will not be restarted (the run is stopping)."""
        raise NotImplementedError

    def restarting(self, replica: Replica) -> bool:
        """``replica`` waits out its back-off (or for its new process to be placed)."""
        return replica.restart_at is not None

    # --------------------------------------------------------------- events

    def log_path(self, name: str) -> Path:
        return self.run_dir / "logs" / f"{name}.log"

    def tail(self, name: str, lines: int = LOG_TAIL_LINES) -> str:
        """The last ``lines`` of ``name``'s log, indented; OSError if it cannot be read."""
        text = self.log_path(name).read_text(errors="replace")
        return "\n".join("    " + line for line in text.splitlines()[-lines:])

    def generator_ended(
        self, replica: Replica, ended: str, cause: str = "", fallback: str = ""
    ) -> str | None:
        """``replica``'s process ended (``ended``: ``exited with status 1``; ``cause``: a
        parenthesis after its uptime): schedule its restart after the back-off and say
        so; a failure message instead once it failed the same way at every start
        (:meth:`Replica.exited`). ``fallback`` is its failure line for an empty log."""
        now = time.monotonic()
        uptime = now - replica.started_at
        made_progress = self.watchdog.made_progress(replica.name)
        self.watchdog.forget(replica.name)
        line = failure_line(self.log_path(replica.name), fallback)
        if replica.exited(made_progress, uptime, line):
            failure = self.describe(replica.name, replica.failures.describe())
            return failure + self.watchdog.others(replica.name, self.peers)
        delay = replica.schedule_restart(now)
        what = f"{ended} after {uptime:.1f}s{cause}; restarting it in {delay:.0f}s"
        self.notify(f"asyncrl: {self.describe(replica.name, what, RESTART_TAIL_LINES)}")
        return None

    def start_failed(self, replica: Replica, why: str) -> str | None:
        """No process could be started for ``replica``: as an exit without progress."""
        if replica.exited(False, 0.0, why):
            return f"{replica.name} {replica.failures.describe()}"
        delay = replica.schedule_restart(time.monotonic())
        self.notify(f"asyncrl: {replica.name} {why}; trying again in {delay:.0f}s")
        return None

    def restart_due(self, replica: Replica, now: float) -> bool:
        """True once ``replica``'s back-off is over: counted as one more restart, which
        its log is marked with, for the backend to start."""
        if replica.restart_at is None or now < replica.restart_at:
            return False
        replica.restart_at = None
        replica.restarts += 1
        replica.mark_restart(self.log_path(replica.name))
        return True

    def check_progress(self) -> str | None:
        """Act on the watchdog: a stalled learner or buffer stops the run (the message),
        a stalled generator is killed, and restarted as any generator that ends."""
        if any(self.restarting(replica) for replica in self.replicas.values()):
            self.watchdog.generators_restarting()  # the learner's batch waits on it
        stalls = self.watchdog.check()  # the learner's or buffer's first: a generator
        for stall in sorted(stalls, key=lambda s: s.role == "generator"):  # may wait on it
            replica = self.replicas.get(stall.name)
            if replica is None:
                return stall.describe() + self.watchdog.others(stall.name, self.peers)
            if replica.stall is None and self.is_up(replica):
                replica.stall = stall
                self.notify(f"asyncrl: {stall.describe()}; {self.kill_stalled(replica)}")
        return None

    def stop_restarts(self) -> None:
        """The run is stopping: no generator is restarted from here on."""
        for replica in self.replicas.values():
            replica.restart_at = None

    def health(self) -> list[ReplicaHealth]:
        """Each generator's state for the console: alive, restarting or stopped."""

        def state(replica: Replica) -> str:
            if self.is_stopped(replica):
                return "stopped"
            return "restarting" if self.restarting(replica) else "alive"

        return [ReplicaHealth(r.pool, r.name, state(r), r.restarts) for r in self.replicas.values()]

    def stop_in_phases(
        self,
        running: Callable[[str], list[Member]],
        terminate: Callable[[list[Member]], None],
        exited: Callable[[list[Member], float], bool],
        hurry: Callable[[], bool],
        slice_s: float,
        slack_s: float = 0.0,
        begun: float | None = None,
    ) -> None:
        """Stop the roles in :func:`stop_phases`' order: ``terminate`` (SIGTERM) what is
        ``running`` of each role, then wait until they ``exited`` (``exited(members, s)``
        blocks at most ``s``) or the phase's time from ``begun`` is up; ``hurry()`` skips
        the waits. No generator restarts from here on; whatever is left afterwards is the
        backend's to kill."""
        begun = time.monotonic() if begun is None else begun
        self.stop_restarts()
        for role, by_s in stop_phases(self.config, slack_s):
            members = running(role)
            terminate(members)
            timeout_s = begun + by_s - time.monotonic()
            wait_with_stop(lambda s, m=members: exited(m, s), timeout_s, hurry, slice_s)
