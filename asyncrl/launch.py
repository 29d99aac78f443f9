"""The local supervisor behind ``asyncrl launch``: one machine, one process per role.

It validates the config (before anything starts), creates the run directory,
writes the resolved config with the ports it picked, starts the buffer, the
learner and every generator replica with their output in ``RUN_DIR/logs/``,
shows progress from ``metrics.jsonl`` (:mod:`asyncrl.console`), and stops every
process when the learner finishes, a process fails, or on a signal.

Supervision, by role:

=========== ================================== =====================================
role        when it exits                      what the launcher does
=========== ================================== =====================================
generator   any status, while the run goes     restart it after a back-off (1 s,
                                               doubling to 30 s; back to 1 s once it
                                               stayed up 60 s) with ``--restarts N``
generator   before any progress, 3 times in    stop the run with that line
            a row, with the same last log line
learner     status 0                           the run is done
learner     any other status                   stop the run, show its log's tail
buffer      any status                         stop the run, show its log's tail
=========== ================================== =====================================

A process that stays but makes no progress for ``run.stall_timeout_s`` (its
``RUN_DIR/progress/NAME.json`` stops advancing: :mod:`asyncrl.watchdog`) is
reported: a generator is killed and restarted as above, the learner or the
buffer stops the run, with what every process last reported. A run directory
that cannot be written is refused in a line (status 2) before anything starts.

Every process gets the config the launcher validated, from the launcher's
memory (``ASYNCRL_CONFIG``, :func:`asyncrl.roles.config_env`), at its first
start and at every restart: ``RUN_DIR/config.yaml`` is written for people and
``asyncrl status``, and no process the launcher starts reads it back.

With ``learner.world_size`` N > 1 the launcher starts the N learner ranks
itself (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``), which
form their process group through a file store in a fresh directory only this
user can enter (:class:`RankGroup`): no rendezvous server listens on the
network, as torchrun's would. The ranks are supervised as one learner: it
failed as soon as any rank exits with another status than 0, and finished
once every rank exited with 0.

Stopping (completion, failure, SIGINT/SIGTERM/SIGHUP) goes in dependency
order, all within :func:`stop_timeout_s`: generators first (each finishes its
chunk), then the learner (every rank gets SIGTERM; it checkpoints its last
complete step, which needs the buffer), then the buffer; whatever is left is
killed. Every child runs in its own session, so a Ctrl-C reaches the launcher
alone and the stop stays in that order, and it gets SIGTERM if the launcher
dies (``PR_SET_PDEATHSIG``). The launcher is a child subreaper, so a process
orphaned under a role (a reward worker) is still its to kill.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import psutil

from asyncrl.config import Config, save_config
from asyncrl.console import ReplicaHealth, RunConsole, figure, open_console
from asyncrl.learner.final_eval import FINAL_EVAL
from asyncrl.paths import latest_checkpoint, replica_name
from asyncrl.progress import PROGRESS_DIR
from asyncrl.roles import LEARNER_STORE_ENV, config_env
from asyncrl.security import provision_run_secret, resolve_keys
from asyncrl.transport import free_port
from asyncrl.watchdog import RESTART_MARK, Stall, StartFailures, Watchdog, failure_line

TICK_S = 0.2
"""How often the launcher looks at its processes and at ``metrics.jsonl``."""
GENERATORS_STOP_S = 4.0
"""Generators finish their chunk and leave within this."""
BUFFER_STOP_S = 2.0
"""The buffer exits within this after the learner."""
BACKOFF_FIRST_S = 1.0
BACKOFF_MAX_S = 30.0
STABLE_AFTER_S = 60.0
"""A generator up this long before it exits restarts after the first back-off again."""
LOG_TAIL_LINES = 20


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


PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36


def _prctl(option: int, value: int) -> None:
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(option, value)


def _die_with_parent() -> None:  # runs in the child between fork and exec
    _prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def make_run_dir(config: Config, run_dir: Path | None) -> Path:
    """Create the run directory; OSError naming the directory if it cannot be written."""
    if run_dir is None:
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        run_dir = Path(config.run.output_dir) / f"{config.run.name}-{stamp}"
    run_dir.mkdir(parents=True, exist_ok=True)
    for directory in (run_dir, run_dir / "logs", run_dir / PROGRESS_DIR):
        directory.mkdir(exist_ok=True)
        _check_writable(directory)
    return run_dir


def _check_writable(directory: Path) -> None:
    """Create and remove a file in ``directory``: an existing directory may still refuse
    the logs and checkpoints (read-only, another user's), and should do so now."""
    try:
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as error:
        raise OSError(error.errno, error.strerror, str(directory)) from None


def unwritable(error: OSError) -> int:
    """Say in one line which path of the run directory cannot be written; status 2."""
    where = f" {error.filename}" if error.filename else ""
    _stderr(
        f"asyncrl: cannot write the run directory{where}: {error.strerror or error} "
        "(choose another with --run-dir or run.output_dir)"
    )
    return 2


def resolve_ports(config: Config) -> Config:
    cluster = config.cluster
    updates = {
        "buffer_port": cluster.buffer_port or free_port(cluster.bind_address),
        "weights_port": cluster.weights_port or free_port(cluster.bind_address),
    }
    return config.model_copy(update={"cluster": cluster.model_copy(update=updates)})


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


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
        """``--index``, ``--pool`` and, once restarted, ``--restarts`` for ``asyncrl.roles``."""
        extra = ["--index", str(self.index), "--pool", self.pool]
        return extra + (["--restarts", str(self.restarts)] if self.restarts else [])

    def mark_restart(self, log_path: Path) -> None:
        """Separate the restarted process's output from the last one's in its log."""
        with contextlib.suppress(OSError), log_path.open("a") as log_file:
            log_file.write(f"{RESTART_MARK} {self.restarts} ----\n")

    def exited(self, made_progress: bool | None, uptime_s: float, line: str) -> bool:
        """Count an exit; True when the run should stop: the same ``line`` ended
        :data:`~asyncrl.watchdog.START_FAILURES` starts in a row that made no progress.

        Without a progress report (``made_progress`` None) a process that stayed up
        :data:`STABLE_AFTER_S` counts as having made progress. A process the watchdog
        killed failed with its stall (:meth:`~asyncrl.watchdog.Stall.reason`).
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


class RankGroup:
    """The learner's rank processes, supervised as one process (as torchrun's agent was).

    :meth:`poll` is the status of the first rank that exited with another status
    than 0 (the learner failed: the launcher stops every rank), 0 once every rank
    exited with 0, else None.
    """

    def __init__(self, ranks: list[subprocess.Popen]):
        self.ranks = ranks

    @property
    def pid(self) -> int:
        return self.ranks[0].pid

    def poll(self) -> int | None:
        codes = [rank.poll() for rank in self.ranks]
        if (rank := self.failed_rank()) is not None:
            return codes[rank]
        return None if None in codes else 0

    def failed_rank(self) -> int | None:
        """The first rank that exited with another status than 0."""
        for rank, process in enumerate(self.ranks):
            if process.poll() not in (None, 0):
                return rank
        return None


def members(process: subprocess.Popen | RankGroup) -> list[subprocess.Popen]:
    """The processes behind an entry of :attr:`Supervisor.processes`."""
    return process.ranks if isinstance(process, RankGroup) else [process]


class Supervisor:
    """The run's process table: starts, restarts and stops its processes."""

    def __init__(self, config: Config, run_dir: Path, notify: Callable[[str], None] = _stderr):
        self.config = config
        self.run_dir = run_dir
        self.notify = notify
        """Where events (a generator exited, restarted) are reported."""
        self.processes: dict[str, subprocess.Popen | RankGroup] = {}
        self.replicas: dict[str, Replica] = {}
        self.handed = config_env(config)
        """Added to every child's environment: the config from memory (``ASYNCRL_CONFIG``)."""
        self.store_dir: Path | None = None
        """The private directory of the learner ranks' file store (more than one rank)."""
        self.watchdog = Watchdog(run_dir, config.run.stall_timeout_s, notify)
        """Which process made no progress for ``run.stall_timeout_s`` (:mod:`asyncrl.watchdog`)."""

    # ------------------------------------------------------------------ start

    def start(self, name: str, role: str, *extra: str, ranks: int = 1) -> None:
        """Start ``python -m asyncrl.roles ROLE RUN_DIR``; with ``ranks`` > 1, one such
        process per learner rank, held together as a :class:`RankGroup`."""
        command = [sys.executable, "-m", "asyncrl.roles", role, str(self.run_dir), *extra]
        if ranks == 1:
            self.processes[name] = self._spawn(name, command)
            self._watch(name, role)
            return
        group = {
            "WORLD_SIZE": str(ranks),
            "LOCAL_WORLD_SIZE": str(ranks),
            LEARNER_STORE_ENV: str(self._fresh_store()),
        }
        if "OMP_NUM_THREADS" not in os.environ:
            group["OMP_NUM_THREADS"] = "1"  # as torchrun sets it for several ranks
        self.processes[name] = RankGroup(
            [
                self._spawn(name, command, {**group, "RANK": str(rank), "LOCAL_RANK": str(rank)})
                for rank in range(ranks)
            ]
        )
        self._watch(name, role)

    def _watch(self, name: str, role: str) -> None:
        """Have the watchdog follow ``name``'s process, or each rank (``learner-R``)."""
        processes = members(self.processes[name])
        for rank, process in enumerate(processes):
            label = name if len(processes) == 1 else f"{name}-{rank}"
            alive = process.poll  # None while it runs
            self.watchdog.watch(label, role, process.pid, alive=lambda poll=alive: poll() is None)

    def _spawn(
        self, name: str, command: list[str], env: dict[str, str] | None = None
    ) -> subprocess.Popen:
        with self.log_path(name).open("a") as log_file:
            return subprocess.Popen(
                command,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=_die_with_parent,
                env={**os.environ, **self.handed, **(env or {})},
            )

    def _fresh_store(self) -> Path:
        """A path for the ranks' FileStore, in a directory of mode 0700 (``mkdtemp``), with
        nothing at it: a store left by an earlier group would mislead the new one."""
        if self.store_dir is None:
            self.store_dir = Path(tempfile.mkdtemp(prefix="asyncrl-learner-"))
        store = self.store_dir / "store"
        store.unlink(missing_ok=True)
        return store

    def start_all(self, resume_from: Path | None = None) -> None:
        resume = ("--resume-from", str(resume_from)) if resume_from else ()
        self.start("buffer", "buffer", *resume)
        self.start("learner", "learner", *resume, ranks=self.config.learner.world_size)
        for pool in self.config.generators.resolved_pools():
            for index in range(pool.replicas):
                replica = Replica(replica_name(pool.name, index), pool.name, index)
                self.replicas[replica.name] = replica
                self._start_generator(replica)

    def _start_generator(self, replica: Replica) -> str | None:
        """Start ``replica``'s process; a failure message if the run should stop."""
        replica.started_at = time.monotonic()
        replica.restart_at = None
        if not replica.restarts:
            self.start(replica.name, "generator", *replica.role_args())
            return None
        replica.mark_restart(self.log_path(replica.name))
        try:
            self.start(replica.name, "generator", *replica.role_args())
        except OSError as error:  # no log file, no process: a start that failed
            return self._failed_start(replica, f"could not be started: {error}")
        self.notify(f"asyncrl: {replica.name} started again (restart {replica.restarts})")
        return None

    def _failed_start(self, replica: Replica, why: str) -> str | None:
        if replica.exited(False, 0.0, why):
            return f"{replica.name} {replica.failures.describe()}"
        delay = replica.schedule_restart(time.monotonic())
        self.notify(f"asyncrl: {replica.name} {why}; trying again in {delay:.0f}s")
        return None

    # -------------------------------------------------------------- supervise

    def learner_finished(self) -> bool:
        return self.processes["learner"].poll() == 0

    def failure(self) -> str | None:
        """A message naming the learner or buffer if it exited when it should not have."""
        for name, process in self.processes.items():
            code = process.poll()
            if name in self.replicas or code is None or (name == "learner" and code == 0):
                continue
            who = name
            if isinstance(process, RankGroup):
                who = f"{name} rank {process.failed_rank()} of {len(process.ranks)}"
            return (
                f"{who} exited with status {code}; last lines of {self.log_path(name)}:\n"
                f"{self.log_tail(name)}"
            )
        return None

    def restart_generators(self) -> str | None:
        """Schedule a restart for each generator that exited; start those whose wait is over.
        A failure message once one failed the same way at every start (:meth:`Replica.exited`)."""
        now = time.monotonic()
        for replica in self.replicas.values():
            code = self.processes[replica.name].poll()
            failure = None
            if replica.restart_at is None and code is not None:
                failure = self._schedule_restart(replica, code, now)
            elif replica.restart_at is not None and now >= replica.restart_at:
                replica.restarts += 1
                failure = self._start_generator(replica)
            if failure is not None:
                return failure
        return None

    def _schedule_restart(self, replica: Replica, code: int, now: float) -> str | None:
        uptime = now - replica.started_at
        made_progress = self.watchdog.made_progress(replica.name)
        self.watchdog.forget(replica.name)
        line = failure_line(self.log_path(replica.name), f"exit status {code}")
        if replica.exited(made_progress, uptime, line):
            return (
                f"{replica.name} {replica.failures.describe()}; last lines of "
                f"{self.log_path(replica.name)}:\n{self.log_tail(replica.name)}"
                + self.watchdog.others(replica.name)
            )
        delay = replica.schedule_restart(now)
        self.notify(
            f"asyncrl: {replica.name} exited with status {code} after {uptime:.1f}s; "
            f"restarting it in {delay:.0f}s; last lines of {self.log_path(replica.name)}:\n"
            f"{self.log_tail(replica.name, 3)}"
        )
        return None

    def check_progress(self) -> str | None:
        """Act on the watchdog: a stalled learner or buffer stops the run (the message),
        a stalled generator is killed, and restarted as any generator that exits."""
        if any(replica.restart_at is not None for replica in self.replicas.values()):
            self.watchdog.generators_restarting()  # the learner's batch waits on it
        stalls = self.watchdog.check()  # the learner's or buffer's first: a generator
        for stall in sorted(stalls, key=lambda s: s.role == "generator"):  # may wait on it
            replica = self.replicas.get(stall.name)
            if replica is None:
                return stall.describe() + self.watchdog.others(stall.name)
            if replica.stall is None and replica.restart_at is None:
                replica.stall = stall
                process = self.processes[replica.name]
                self.notify(f"asyncrl: {stall.describe()}; killing it (pid {process.pid})")
                _kill_tree(process)
        return None

    def health(self) -> list[ReplicaHealth]:
        def state(replica: Replica) -> str:
            if replica.restart_at is not None:
                return "restarting"
            return "alive" if self.processes[replica.name].poll() is None else "stopped"

        return [ReplicaHealth(r.pool, r.name, state(r), r.restarts) for r in self.replicas.values()]

    def log_path(self, name: str) -> Path:
        return self.run_dir / "logs" / f"{name}.log"

    def log_tail(self, name: str, lines: int = LOG_TAIL_LINES) -> str:
        try:
            text = self.log_path(name).read_text(errors="replace")
        except OSError as error:  # removed under the run: say so, go on supervising
            return f"    (cannot read it: {error.strerror or error})"
        return "\n".join("    " + line for line in text.splitlines()[-lines:])

    # ------------------------------------------------------------------- stop

    def stop_all(self, hurry: Callable[[], bool] = lambda: False) -> None:
        """Stop every process in dependency order, all within :func:`stop_timeout_s`.

        ``hurry`` returning True (a second Ctrl-C) skips the waits: what is
        left is killed at once.
        """
        started = time.monotonic()
        for replica in self.replicas.values():
            replica.restart_at = None  # no restarts from here on
        descendants = self._descendants()  # reward workers, engines: killed last
        roles = {
            "generator": [name for name in self.processes if name in self.replicas],
            "learner": ["learner"],
            "buffer": ["buffer"],
        }
        for role, by_s in stop_phases(self.config):
            running = [
                process
                for name in roles[role]
                if name in self.processes
                for process in members(self.processes[name])
                if process.poll() is None
            ]
            for process in running:
                process.send_signal(signal.SIGTERM)
                process.send_signal(signal.SIGCONT)  # a stopped one (SIGSTOP) handles it too
            _wait_all(running, started + by_s, hurry)
        for process in self.all_processes():
            if process.poll() is None:
                process.kill()
                process.wait()
        _kill_all(descendants)
        if self.store_dir is not None:
            shutil.rmtree(self.store_dir, ignore_errors=True)

    def all_processes(self) -> list[subprocess.Popen]:
        """Every process started, each learner rank on its own."""
        return [process for entry in self.processes.values() for process in members(entry)]

    def _descendants(self) -> list[psutil.Process]:
        found = []
        for process in self.all_processes():
            if process.poll() is None:
                with contextlib.suppress(psutil.NoSuchProcess):
                    found += psutil.Process(process.pid).children(recursive=True)
        return found


def _wait_all(processes: list[subprocess.Popen], deadline: float, hurry: Callable[[], bool]):
    while any(p.poll() is None for p in processes) and time.monotonic() < deadline:
        if hurry():
            return
        time.sleep(0.05)


def _kill_all(processes: list[psutil.Process]) -> None:
    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()  # psutil checks that the pid still names the same process
    psutil.wait_procs(processes, timeout=2)


def _kill_tree(process: subprocess.Popen) -> None:
    """SIGKILL ``process`` (a child not yet reaped: its pid is still its own) and every
    process under it (psutil checks each pid still names the same process)."""
    descendants: list[psutil.Process] = []
    with contextlib.suppress(psutil.Error):
        descendants = psutil.Process(process.pid).children(recursive=True)
    with contextlib.suppress(OSError):
        process.kill()
    _kill_all(descendants)


def _kill_orphans() -> None:
    """Kill descendants left to the launcher as subreaper (none when every stop went well)."""
    _kill_all(psutil.Process().children(recursive=True))


class Interrupted(Exception):
    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class StopSignals:
    """SIGINT, SIGTERM and SIGHUP stop the run: the first one raises :class:`Interrupted`
    in the main loop; once stopping, further ones only ask the stop to hurry."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self) -> None:
        self.stopping = False
        self.hurried = False
        self.previous: dict[int, object] = {}

    def __enter__(self) -> StopSignals:
        for sig in self.SIGNALS:
            self.previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *_) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, _frame) -> None:
        if self.stopping:
            self.hurried = True
            return
        self.stopping = True
        raise Interrupted(signum)

    def hurry(self) -> bool:
        """True once a signal came after the stop began."""
        return self.hurried


def supervise(supervisor: Supervisor, console: RunConsole) -> str | None:
    """Watch the run until the learner is done; the failure message if a process failed."""
    while not supervisor.learner_finished():
        failure = (
            supervisor.failure() or supervisor.restart_generators() or supervisor.check_progress()
        )
        if failure is not None:
            return failure
        console.update(supervisor.health())
        time.sleep(TICK_S)
    return supervisor.failure()


def launch(
    config: Config, run_dir: Path | None = None, resume: bool = False, quiet: bool = False
) -> int:
    """Run to completion; returns the exit status for the command line.

    With ``resume``, ``run_dir`` is an earlier run: it continues from its newest
    complete checkpoint, with fresh ports. ``quiet`` prints one line per step
    instead of the live panel.
    """
    resume_from = None
    if resume:
        resume_from = latest_checkpoint(run_dir)
        if resume_from is None:
            print(f"asyncrl: {run_dir} has no complete checkpoint to resume from", file=sys.stderr)
            return 2
    config = resolve_keys(config, run_dir)  # CURVE keys missing: refused before anything starts
    if config.environment is not None:  # model code would run unisolated: refused likewise
        from asyncrl.envs.sandbox import check_isolation_for

        check_isolation_for(config)
    from asyncrl.preflight import preflight

    preflight(config)  # data, reward function, environment, machine: PreflightError
    try:  # an unwritable run directory is said in a line, before anything starts
        run_dir = make_run_dir(config, run_dir)
        config = provision_run_secret(config, run_dir)
    except OSError as error:
        return unwritable(error)
    if config.cluster.backend == "ray":  # the roles as Ray actors (docs/ray.md)
        from asyncrl.ray_cluster import launch_ray

        return launch_ray(config, run_dir, resume_from, quiet)
    config = resolve_ports(config)
    try:
        save_config(config, run_dir / "config.yaml")
    except OSError as error:
        return unwritable(error)
    _prctl(PR_SET_CHILD_SUBREAPER, 1)
    started = time.time()
    steps_done = int(resume_from.name.removeprefix("step-")) if resume_from else 0
    with open_console(config, run_dir, quiet, steps_done) as console:
        console.note(f"run dir: {run_dir}")
        if resume_from is not None:
            console.note(f"resuming from {resume_from}")
        supervisor = Supervisor(config, run_dir, notify=lambda text: console.note(text, True))
        with StopSignals() as signals:
            try:
                supervisor.start_all(resume_from)
                failure = supervise(supervisor, console)
                status = 0 if failure is None else 1
            except Interrupted as interrupt:
                console.note(
                    f"asyncrl: {interrupt}: stopping every process "
                    "(the learner first checkpoints its last complete step)",
                    error=True,
                )
                failure, status = None, 128 + interrupt.signum
            except Exception as error:  # the launcher's own fault: stop every process, say so
                console.note(traceback.format_exc().rstrip(), error=True)
                failure, status = f"the launcher failed while supervising: {error!r}", 1
            finally:
                signals.stopping = True  # from here a signal only hurries the stop
                supervisor.stop_all(hurry=signals.hurry)
                _kill_orphans()
        console.update(supervisor.health())  # the steps logged while stopping
        if status == 0 and not wrote_final_policy(run_dir, started):
            failure, status = "the learner exited before run.total_steps without an error", 1
        message = closing_message(run_dir, status, failure, time.time() - started)
        console.note(message, error=status != 0)
    return status


def wrote_final_policy(run_dir: Path, since: float) -> bool:
    """Whether the learner saved the final policy during this launch (a clean finish)."""
    final = run_dir / "final" / "config.json"
    return final.exists() and final.stat().st_mtime >= since


def closing_message(run_dir: Path, status: int, failure: str | None, elapsed_s: float) -> str:
    """The last words of a launch (local or Ray): done, or why not and how to resume."""
    if status == 0:
        evaluated = final_eval_text(run_dir)
        return f"done in {elapsed_s:.1f}s{evaluated}; final policy in {run_dir / 'final'}"
    lines = [f"asyncrl: run failed: {failure}" if failure else "asyncrl: stopped"]
    if (full := disk_full_note(run_dir)) is not None:
        lines.append(full)
    if wrote_final_policy(run_dir, time.time() - elapsed_s):  # stopped while evaluating it
        lines.append(f"asyncrl: training had finished; the final policy is in {run_dir / 'final'}")
        return "\n".join(lines)
    checkpoint = latest_checkpoint(run_dir)
    if checkpoint is None:
        lines.append("asyncrl: no complete checkpoint was written, so the run cannot be resumed")
    else:
        lines.append(
            f"asyncrl: continue the run from {checkpoint.name} with: "
            f"asyncrl launch --resume {run_dir}"
        )
    return "\n".join(lines)


DISK_NEARLY_FULL_BYTES = 16 * 2**20
"""A run that failed with less free space than this beside its run directory is told so:
the failing role's own last line may not have fit into its log."""


def disk_full_note(run_dir: Path) -> str | None:
    """One line saying the run directory's filesystem is (nearly) full, or None."""
    try:
        free = shutil.disk_usage(run_dir).free
    except OSError:
        return None
    if free >= DISK_NEARLY_FULL_BYTES:
        return None
    return (
        f"asyncrl: the filesystem of {run_dir} is full ({free / 2**20:.1f} MiB free): writes "
        "fail with 'No space left on device'; free space there before resuming"
    )


def final_eval_text(run_dir: Path) -> str:
    """``; final eval reward 0.930 over 128 held-out samples`` from ``final/eval.json``
    (``eval.at_end``), or why there is none; empty when the run wrote no such file."""
    try:
        record = json.loads((run_dir / "final" / FINAL_EVAL).read_text())
    except (OSError, ValueError):
        return ""
    if not isinstance(record, dict):
        return ""
    if record.get("eval_reward_mean") is not None:
        return (
            f"; final eval reward {figure(record, 'eval_reward_mean', '.3f')} "
            f"over {figure(record, 'eval_samples', '.0f')} held-out samples"
        )
    return f"; no final eval ({record.get('skipped') or 'no reward'})"
