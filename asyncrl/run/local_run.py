"""The local backend of ``asyncrl launch``: one machine, one process per role, by pid.

It starts the buffer, the learner and every generator replica as
``python -m asyncrl.run.roles ROLE RUN_DIR`` with their output in
``RUN_DIR/logs/``, and supervises them by the policy of
:mod:`asyncrl.run.supervision` (restart a generator after a back-off, stop the run
when the learner or the buffer fails or stalls).

Every process gets the config the launcher validated, from the launcher's
memory (``ASYNCRL_CONFIG``, :func:`asyncrl.run.roles.config_env`), at its first
start and at every restart: ``RUN_DIR/config.yaml`` is written for people and
``asyncrl status``, and no process the launcher starts reads it back. It also
gets its own role's credentials and no other's, over a pipe it inherits
(:func:`asyncrl.core.credentials.handed_over`): the learner's are in no file.

With ``learner.world_size`` N > 1 the launcher starts the N learner ranks
itself (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``), which
form their process group through a file store in a fresh directory only this
user can enter (:class:`RankGroup`): no rendezvous server listens on the
network, as torchrun's would. The ranks are supervised as one learner: it
failed as soon as any rank exits with another status than 0, and finished
once every rank exited with 0.

Stopping goes in the policy's order, all within
:func:`~asyncrl.run.supervision.stop_timeout_s`; whatever is left is killed.
Every child runs in its own session, so a Ctrl-C reaches the launcher alone
and the stop stays in that order, and it gets SIGTERM if the launcher dies
(``PR_SET_PDEATHSIG``). The launcher is a child subreaper, so a process
orphaned under a role (a reward worker) is still its to kill.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import psutil

from asyncrl.config import Config
from asyncrl.core.cores import CORES_ENV, CorePlan
from asyncrl.core.credentials import Credentials, handed_over, held
from asyncrl.core.paths import LEARNER_STORE_ENV, WEIGHTS_SHM_POINTER, replica_name
from asyncrl.core.stop_signals import StopSignals, raise_interrupted
from asyncrl.run.closing import see_through
from asyncrl.run.console import RunConsole, open_console
from asyncrl.run.roles import config_env
from asyncrl.run.supervision import LOG_TAIL_LINES, Replica, Supervision
from asyncrl.run.watchdog import Watchdog

TICK_S = 0.2
"""How often the launcher looks at its processes and at ``metrics.jsonl``."""
STOP_POLL_S = 0.05
"""How often a stop looks whether the processes it signalled have exited."""
PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36


def _prctl(option: int, value: int) -> None:
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(option, value)


def _die_with_parent() -> None:  # runs in the child between fork and exec
    _prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


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


class Supervisor(Supervision):
    """The run's process table: starts, restarts and stops its processes."""

    def __init__(
        self,
        config: Config,
        run_dir: Path,
        notify: Callable[[str], None] = _stderr,
        credentials: Credentials | None = None,
        cores: CorePlan | None = None,
    ):
        self.config = config
        self.run_dir = run_dir
        self.notify = notify
        """Where events (a generator exited, restarted) are reported."""
        self.credentials = credentials or held(config.cluster)
        """The run's credentials (:func:`asyncrl.core.security.provision_run`); each process is
        handed its role's share. None: ``cluster.auth`` off, or none held here."""
        self.roles: dict[str, str] = {}
        """Each started process's role, by name."""
        self.processes: dict[str, subprocess.Popen | RankGroup] = {}
        self.replicas: dict[str, Replica] = {}
        self.handed = config_env(config)
        """Added to every child's environment: the config from memory (``ASYNCRL_CONFIG``)."""
        self.store_dir: Path | None = None
        """The private directory of the learner ranks' file store (more than one rank)."""
        self.watchdog = Watchdog(run_dir, config.run.stall_timeout_s, notify)
        """Which process made no progress for ``run.stall_timeout_s``
        (:mod:`asyncrl.run.watchdog`)."""
        self.cores = cores or CorePlan(reason="no plan given")
        """Who computes on which cores (:mod:`asyncrl.core.cores`); empty: nobody is pinned."""

    # ------------------------------------------------------------------ start

    def start(self, name: str, role: str, *extra: str, ranks: int = 1) -> None:
        """Start ``python -m asyncrl.run.roles ROLE RUN_DIR``; with ``ranks`` > 1, one such
        process per learner rank, held together as a :class:`RankGroup`."""
        command = [sys.executable, "-m", "asyncrl.run.roles", role, str(self.run_dir), *extra]
        self.roles[name] = role
        if ranks == 1:
            self.processes[name] = self._spawn(name, command, self._cores_env(name))
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
                self._spawn(
                    name,
                    command,
                    {
                        **group,
                        "RANK": str(rank),
                        "LOCAL_RANK": str(rank),
                        **self._cores_env(name, rank),
                    },
                )
                for rank in range(ranks)
            ]
        )
        self._watch(name, role)

    def _cores_env(self, name: str, rank: int = 0) -> dict[str, str]:
        """``ASYNCRL_CORES`` for ``name`` (rank ``rank``), if the plan pins it."""
        cores = self.cores.of(name, rank)
        return {} if cores is None else {CORES_ENV: ",".join(map(str, cores))}

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
        """Start ``command`` for ``name``, handing it its role's credentials."""
        given = None
        if self.credentials is not None and name in self.roles:
            given = self.credentials.for_role(self.roles[name])
        with self.log_path(name).open("a") as log_file, handed_over(given) as handover:
            return subprocess.Popen(
                command,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=_die_with_parent,
                pass_fds=handover.fds,
                env={**os.environ, **self.handed, **(env or {}), **handover.env},
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
        try:
            self.start(replica.name, "generator", *replica.role_args())
        except OSError as error:  # no log file, no process: a start that failed
            return self.start_failed(replica, f"could not be started: {error}")
        self.notify(f"asyncrl: {replica.name} started again (restart {replica.restarts})")
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
                failure = self.generator_ended(
                    replica, f"exited with status {code}", fallback=f"exit status {code}"
                )
            elif self.restart_due(replica, now):
                failure = self._start_generator(replica)
            if failure is not None:
                return failure
        return None

    # the policy's hooks (asyncrl.run.supervision.Supervision)

    def describe(self, name: str, why: str, lines: int = LOG_TAIL_LINES) -> str:
        return f"{name} {why}; last lines of {self.log_path(name)}:\n{self.log_tail(name, lines)}"

    def kill_stalled(self, replica: Replica) -> str:
        process = self.processes[replica.name]
        _kill_tree(process)
        return f"killing it (pid {process.pid})"

    def is_up(self, replica: Replica) -> bool:
        return replica.restart_at is None

    def is_stopped(self, replica: Replica) -> bool:
        return replica.restart_at is None and self.processes[replica.name].poll() is not None

    def log_tail(self, name: str, lines: int = LOG_TAIL_LINES) -> str:
        try:
            return self.tail(name, lines)
        except OSError as error:  # removed under the run: say so, go on supervising
            return f"    (cannot read it: {error.strerror or error})"

    # ------------------------------------------------------------------- stop

    def stop_all(self, hurry: Callable[[], bool] = lambda: False) -> None:
        """Stop every process in dependency order, all within
        :func:`~asyncrl.run.supervision.stop_timeout_s`.

        ``hurry`` returning True (a second Ctrl-C) skips the waits: what is
        left is killed at once.
        """
        started = time.monotonic()
        descendants = self._descendants()  # reward workers, engines: killed last
        roles = {
            "generator": [name for name in self.processes if name in self.replicas],
            "learner": ["learner"],
            "buffer": ["buffer"],
        }

        def running(role: str) -> list[subprocess.Popen]:
            entries = [self.processes[name] for name in roles[role] if name in self.processes]
            return [p for entry in entries for p in members(entry) if p.poll() is None]

        self.stop_in_phases(running, _terminate, _exited, hurry, STOP_POLL_S, begun=started)
        for process in self.all_processes():
            if process.poll() is None:
                process.kill()
                process.wait()
        _kill_all(descendants)
        if self.store_dir is not None:
            shutil.rmtree(self.store_dir, ignore_errors=True)
        # a learner that died (or was killed) left its weights segment in /dev/shm:
        # memory the size of two policies, held until someone removes the file. Its
        # record says so (a clean learner removes both); only then is the writer, and
        # torch with it, imported: a second of every launch's end otherwise.
        if (self.run_dir / WEIGHTS_SHM_POINTER).exists():
            from asyncrl.weights.shm.writer import remove_leftover

            with contextlib.suppress(OSError):  # a run dir gone or read-only: nothing to do
                remove_leftover(self.run_dir)

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


def _terminate(processes: list[subprocess.Popen]) -> None:
    for process in processes:
        process.send_signal(signal.SIGTERM)
        process.send_signal(signal.SIGCONT)  # a stopped one (SIGSTOP) handles it too


def _exited(processes: list[subprocess.Popen], wait_s: float) -> bool:
    """Whether every one of ``processes`` has exited, looking again after ``wait_s``."""
    if all(process.poll() is not None for process in processes):
        return True
    time.sleep(wait_s)
    return all(process.poll() is not None for process in processes)


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


def launch_local(
    config: Config,
    run_dir: Path,
    resume_from: Path | None,
    quiet: bool,
    credentials: Credentials | None = None,
    cores: CorePlan | None = None,
) -> int:
    """Run ``config`` (ports resolved, config saved) to completion on this machine, each
    process handed its share of ``credentials`` and pinned to its ``cores``."""
    _prctl(PR_SET_CHILD_SUBREAPER, 1)
    steps_done = int(resume_from.name.removeprefix("step-")) if resume_from else 0
    with open_console(config, run_dir, quiet, steps_done) as console:
        console.note(f"run dir: {run_dir}")
        if resume_from is not None:
            console.note(f"resuming from {resume_from}")
        if cores is not None:
            console.note(cores.summary())
        supervisor = Supervisor(
            config,
            run_dir,
            notify=lambda text: console.note(text, True),
            credentials=credentials,
            cores=cores,
        )

        def stop() -> None:
            supervisor.stop_all(hurry=signals.hurry)
            _kill_orphans()

        with StopSignals(on_stop=raise_interrupted) as signals:
            return see_through(
                console,
                signals,
                run_dir,
                start=lambda: supervisor.start_all(resume_from),
                supervise=lambda: supervise(supervisor, console),
                stop=stop,
                health=supervisor.health,
                stopping="every process (the learner first checkpoints its last complete step)",
            )
