"""A real ``asyncrl launch`` run of the fault scenarios: starting and resuming it on the
quickstart config (shortened), waiting on its steps, its processes and its logs.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil

from asyncrl.run.status import read_metrics

REPO = Path(__file__).resolve().parents[3]


QUICKSTART = REPO / "configs" / "quickstart.yaml"


HEARTBEAT_S = 3


STALL_S = 10
"""run.stall_timeout_s of these runs: the smallest the config allows (the default is 900 s;
a role still starting gets the watchdog's START_TIMEOUT_S)."""


FAST = (
    "tracking.aim=false",
    f"buffer.heartbeat_timeout_s={HEARTBEAT_S}",
    f"run.stall_timeout_s={STALL_S}",
)


LONG = "run.total_steps=100000"
"""Runs that go on after their faults end with SIGTERM once the effects are seen: their
length then depends on what was measured, not on how fast this machine trains."""


POLL_S = 0.1


WAIT_S = 240.0
"""The longest any one wait of a scenario lasts (generous: the machine may be loaded)."""


class Launch:
    """`asyncrl launch --quiet ...` in the background, watched from outside.

    Its output goes to files beside the run directory (never inside it: the disk-full
    scenario fills the run directory's disk). Every wait records when each learner step
    first showed in ``metrics.jsonl`` and which processes the launcher had, so the time a
    fault held the learner up and the processes left after the launcher can be told.
    """

    def __init__(
        self, run_dir: Path, *args: str, env: dict[str, str] | None = None, logs: Path | None = None
    ):
        self.run_dir = run_dir
        logs = logs or run_dir.parent / "launches"
        logs.mkdir(parents=True, exist_ok=True)
        index = len(list(logs.glob(f"{run_dir.name}-*.out")))
        self.out = logs / f"{run_dir.name}-{index}.out"
        self.err = logs / f"{run_dir.name}-{index}.err"
        self.first_step = len(read_metrics(run_dir)) if run_dir.exists() else 0
        self.step_times: list[float] = []
        """``time.time()`` when each step of this launch was first seen."""
        self.seen: dict[int, psutil.Process] = {}
        self.roles: dict[int, str] = {}
        """The role (``learner``, ``generator``, ...) of each process seen, by pid."""
        self.exits: dict[int, float] = {}
        """``time.time()`` by which each process seen had exited, by pid."""
        self._looked_at = 0.0
        self._metrics: list[dict] = []
        self._metrics_size = -1
        command = [sys.executable, "-m", "asyncrl", "launch", "--quiet", *args]
        with self.out.open("w") as out, self.err.open("w") as err:
            self.process = subprocess.Popen(
                command, stdout=out, stderr=err, cwd=REPO, start_new_session=True,
                env={**os.environ, **(env or {})},
            )  # fmt: skip
        self.started = time.time()
        self.ended: float | None = None

    # -------------------------------------------------------------- watching

    def observe(self) -> None:
        """Note new steps (with the time they were seen) and the launcher's processes."""
        steps = self.steps() - self.first_step
        now = time.time()
        self.step_times += [now] * max(0, steps - len(self.step_times))
        if now - self._looked_at >= 1.0 and self.process.poll() is None:
            self._looked_at = now
            for process in self.tree():
                self.note(process)
        for pid, process in self.seen.items():
            if pid not in self.exits and not alive(process):
                self.exits[pid] = now
        if self.ended is None and self.process.poll() is not None:
            self.ended = now

    def note(self, process: psutil.Process) -> None:
        """Follow ``process`` (to tell when it exits, and whether it is left)."""
        if process.pid not in self.seen:
            self.seen[process.pid] = process
            self.roles[process.pid] = role_of(process)

    def until(self, what: str, done: Callable[[], bool], timeout_s: float = WAIT_S) -> float:
        """Wait until ``done()``; the ``time.time()`` it became true. Fails if the launcher
        exits first (use :meth:`wait` for that) or after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.observe()
            if done():
                return time.time()
            assert self.process.poll() is None, f"the run ended before {what}:\n{self.stderr()}"
            late = f"no {what} within {timeout_s:.0f}s:\n{self.stderr()}"
            assert time.monotonic() < deadline, late
            time.sleep(POLL_S)

    def wait_for_step(self, steps: int) -> float:
        """Until this launch's learner logged ``steps`` steps in all (every attempt counted)."""
        return self.until(f"step {steps}", lambda: self.steps() >= steps)

    def wait(self, timeout_s: float = WAIT_S) -> int:
        """The launcher's exit status, once it exited."""
        deadline = time.monotonic() + timeout_s
        while self.process.poll() is None:
            self.observe()
            assert time.monotonic() < deadline, f"still running after {timeout_s:.0f}s"
            time.sleep(POLL_S)
        self.observe()
        return self.process.returncode

    def wait_for_new_steps(self, steps: int) -> float:
        """Until this launch's learner logged ``steps`` more steps than when it started."""
        return self.until(f"{steps} steps", lambda: self.new_steps() >= steps)

    def steps(self) -> int:
        """Steps in ``metrics.jsonl``, every attempt counted."""
        return len(self.metrics())

    def new_steps(self) -> int:
        """Steps this launch logged."""
        return self.steps() - self.first_step

    def trained_to(self) -> int:
        """The learner's step count after its last logged step (0 before any)."""
        records = self.metrics()
        return records[-1]["step"] + 1 if records else 0

    def metrics(self) -> list[dict]:
        """The records of ``metrics.jsonl`` (read again only when the file grew)."""
        size = file_size(self.run_dir / "metrics.jsonl")
        if size != self._metrics_size:
            self._metrics, self._metrics_size = read_metrics(self.run_dir), size
        return self._metrics

    def held_up_s(self, since: float, until: float | None = None) -> float:
        """The longest the learner went without a step between ``since`` and ``until``
        (its last step seen, by default)."""
        end = until or float("inf")
        times = [since, *(t for t in self.step_times if since < t <= end)]
        return max((b - a for a, b in itertools.pairwise(times)), default=0.0)

    # ------------------------------------------------------------- processes

    def tree(self) -> list[psutil.Process]:
        """The launcher and every process under it."""
        with contextlib.suppress(psutil.NoSuchProcess):
            launcher = psutil.Process(self.process.pid)
            return [launcher, *launcher.children(recursive=True)]
        return []

    def leftovers(self) -> list[str]:
        """Processes of this launch (seen under the launcher, or naming the run directory)
        still alive: ``pid name`` each."""
        self.observe()
        found = {p.pid: p for p in self.seen.values() if alive(p)}
        found |= {p.pid: p for p in processes_of(self.run_dir) if alive(p)}
        return [f"{pid} {describe(process)}" for pid, process in sorted(found.items())]

    def role(self, role: str, index: int | None = None, rank: int | None = None) -> psutil.Process:
        """The live process of ``role`` (a generator by ``index``, a learner by ``rank``)."""
        for process in processes_of(self.run_dir):
            command = process.cmdline()
            if command[2:4] != ["asyncrl.run.roles", role]:
                continue
            if index is not None and command[command.index("--index") + 1] != str(index):
                continue
            if rank is not None and process.environ().get("RANK", "0") != str(rank):
                continue
            return process
        raise AssertionError(f"no live {role} process (index {index}, rank {rank})")

    def kill(self) -> None:
        """Whatever of this launch is left, after a failed assertion or a killed launcher."""
        for process in [*self.tree(), *self.seen.values(), *processes_of(self.run_dir)]:
            with contextlib.suppress(psutil.NoSuchProcess):
                if process.is_running():
                    process.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=10)

    def stop(self, signum: int = signal.SIGTERM) -> int:
        """Signal the launcher and wait for it: the run's clean stop."""
        self.process.send_signal(signum)
        return self.wait()

    def stderr(self) -> str:
        return self.err.read_text(errors="replace")

    def stdout(self) -> str:
        return self.out.read_text(errors="replace")


def processes_of(run_dir: Path) -> list[psutil.Process]:
    """Every live process whose command line names ``run_dir`` (as run_processes.py
    finds them, zombies left out: a killed child not yet reaped is gone)."""
    found = []
    for process in psutil.process_iter(["cmdline"]):
        if str(run_dir) in " ".join(process.info["cmdline"] or []) and alive(process):
            found.append(process)
    return found


def alive(process: psutil.Process) -> bool:
    """Running and not a zombie (a killed child not reaped yet is gone for our purposes)."""
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def role_of(process: psutil.Process) -> str:
    """``buffer``, ``learner``, ``generator`` (``python -m asyncrl.run.roles ROLE``),
    ``launcher``, ``reward worker``, else the process's name."""
    try:
        command = process.cmdline()
        if command[2:3] == ["asyncrl.run.roles"]:
            return command[3]
        if command[2:4] == ["asyncrl", "launch"]:
            return "launcher"
        return "reward worker" if "_worker_main" in " ".join(command) else process.name()
    except (psutil.Error, IndexError):
        return "?"


def describe(process: psutil.Process) -> str:
    try:
        return " ".join(process.cmdline()[:5]) or process.name()
    except psutil.Error:
        return "?"


def start(
    run_dir: Path, *overrides: str, env: dict[str, str] | None = None, logs: Path | None = None
) -> Launch:
    """A new run of the quickstart config with the FAST settings and ``overrides``."""
    args = (str(QUICKSTART), *FAST, *overrides, "--run-dir", str(run_dir))
    return Launch(run_dir, *args, env=env, logs=logs)


def resume(run_dir: Path, *overrides: str, logs: Path | None = None) -> Launch:
    """``asyncrl launch --resume RUN_DIR`` with ``overrides``."""
    return Launch(run_dir, "--resume", str(run_dir), *overrides, logs=logs)


def resumed_from(launch: Launch) -> int | None:
    """The checkpoint step a ``--resume`` launch said it resumed from."""
    for line in launch.stdout().splitlines():
        if line.startswith("resuming from "):
            return int(line.rsplit("step-", 1)[1])
    return None


def gone(launch: Launch, timeout_s: float = WAIT_S) -> float:
    """Wait until no process of ``launch`` is alive; the ``time.time()`` it was so."""
    deadline = time.monotonic() + timeout_s
    while launch.leftovers():
        assert time.monotonic() < deadline, f"left after {timeout_s:.0f}s: {launch.leftovers()}"
        time.sleep(POLL_S)
    return time.time()


def file_size(path: Path) -> int:
    with contextlib.suppress(OSError):
        return path.stat().st_size
    return 0


def log(run_dir: Path, name: str) -> str:
    path = run_dir / "logs" / f"{name}.log"
    return path.read_text(errors="replace") if path.exists() else ""


def generator_logs_bytes(run_dir: Path) -> int:
    return sum(file_size(path) for path in (run_dir / "logs").glob("generator-*.log"))


def generator_logs(run_dir: Path) -> str:
    return "\n".join(p.read_text(errors="replace") for p in (run_dir / "logs").glob("generator-*"))
