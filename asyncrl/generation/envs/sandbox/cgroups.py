"""Whole-call limits: one cgroup per sandboxed call, holding every process of it.

rlimits bound each process on its own: a call that forks 21 processes of 64 MB
holds 1.3 GB. A cgroup of its own bounds the call as a whole, the sandbox's
init included (:class:`CallLimits`):

- memory: ``memory_mb + tmp_mb + shm_mb`` for its processes, the files in its
  ``/tmp`` and ``/dev/shm`` (tmpfs pages are charged to the cgroup that wrote
  them) and the kernel memory it uses; no swap. Past it the kernel's OOM killer
  ends a process of the call (counted in the result's ``notes``);
- processes: ``max_processes`` tasks (threads count);
- CPU: ``cpus`` CPUs of bandwidth, so that with the wall-clock limit a call's
  CPU time is at most ``cpus * timeout_s`` seconds.

:class:`CgroupV2Call` and :class:`CgroupV1Call` are one call's cgroup (made
before its code runs, the sandbox's PID 1 moved in while bubblewrap holds it,
:mod:`.launch`; killed whole and removed once empty); :class:`CallGroup` is the
call without one. Which of them a machine gives is :mod:`.cgroup_detect`'s.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import signal
import time
from dataclasses import dataclass

log = logging.getLogger("asyncrl.envs.sandbox")

CPU_PERIOD_US = 100_000
EMPTY_WAIT_S = 5.0
"""How long a killed call's cgroup may take to empty before it is reported."""

_NAMES = itertools.count()


def cgroup_name() -> str:
    """A new cgroup name, unique on this machine (this process's pid, a counter)."""
    return f"asyncrl-sandbox-{os.getpid()}-{next(_NAMES)}"


@dataclass(frozen=True)
class CallLimits:
    """What bounds one call, all its processes together."""

    memory_bytes: int
    pids: int
    cpus: float


def write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _counter(text: str, key: str) -> int:
    """The value of ``key`` in a ``key value`` per line file (``memory.events``)."""
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name == key and value.strip().isdigit():
            return int(value)
    return 0


def _pids(path: str) -> list[int]:
    try:
        return [int(line) for line in read(path).split()]
    except FileNotFoundError:
        return []


def _kill_each(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _wait_for(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    delay = 0.0005
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(delay)
        delay = min(delay * 2, 0.02)
    return True


def _limit_notes(oom_kills: int, pids_refused: int, limits: CallLimits) -> tuple[str, ...]:
    notes = []
    if oom_kills:
        notes.append(
            f"the call's memory limit ({limits.memory_bytes >> 20} MB for all its processes "
            f"and files) was reached: {oom_kills} process(es) killed"
        )
    if pids_refused:
        notes.append(f"the call's process limit ({limits.pids}) refused {pids_refused} fork(s)")
    return tuple(notes)


# -- one call's cgroup -------------------------------------------------------------


class CallGroup:
    """A call without a cgroup (mode ``none``): nothing to add, kill or remove."""

    mode = "none"

    def add(self, pid: int) -> None:
        """Move ``pid`` (the sandbox's PID 1, before it runs anything) into the call."""

    def close(self) -> tuple[str, ...]:
        """After the call: kill what is left, wait until it is empty, remove it;
        notes on the limits the call reached."""
        return ()


class CgroupV2Call(CallGroup):
    mode = "cgroup-v2"

    def __init__(self, parent: str, limits: CallLimits, controllers: list[str]) -> None:
        """A child of ``parent`` with the limits of the ``controllers`` enabled there."""
        self.path = os.path.join(parent, cgroup_name())
        self.limits = limits
        self.controllers = controllers
        os.mkdir(self.path)
        try:
            if "memory" in controllers:
                write(self._file("memory.max"), str(limits.memory_bytes))
                if os.path.exists(self._file("memory.swap.max")):
                    write(self._file("memory.swap.max"), "0")
            if "pids" in controllers:
                write(self._file("pids.max"), str(limits.pids))
            if "cpu" in controllers:
                quota = round(limits.cpus * CPU_PERIOD_US)
                write(self._file("cpu.max"), f"{quota} {CPU_PERIOD_US}")
        except OSError:
            os.rmdir(self.path)
            raise

    def _file(self, name: str) -> str:
        return os.path.join(self.path, name)

    def _events(self, controller: str, name: str, key: str) -> int:
        return _counter(read(self._file(name)), key) if controller in self.controllers else 0

    def add(self, pid: int) -> None:
        write(self._file("cgroup.procs"), str(pid))

    def _empty(self) -> bool:
        return _counter(read(self._file("cgroup.events")), "populated") == 0

    def _kill(self) -> None:
        if os.path.exists(self._file("cgroup.kill")):  # Linux 5.14+
            write(self._file("cgroup.kill"), "1")
            return
        write(self._file("cgroup.freeze"), "1")
        _wait_for(lambda: _counter(read(self._file("cgroup.events")), "frozen") == 1, 1.0)
        _kill_each(_pids(self._file("cgroup.procs")))
        write(self._file("cgroup.freeze"), "0")

    def close(self) -> tuple[str, ...]:
        if not self._empty():
            self._kill()
            if not _wait_for(self._empty, EMPTY_WAIT_S):
                return _left_behind(self.path)
        notes = _limit_notes(
            self._events("memory", "memory.events", "oom_kill"),
            self._events("pids", "pids.events", "max"),
            self.limits,
        )
        os.rmdir(self.path)
        return notes


class CgroupV1Call(CallGroup):
    mode = "cgroup-v1"

    def __init__(self, parents: dict[str, str], limits: CallLimits) -> None:
        name = cgroup_name()
        self.paths = {
            controller: os.path.join(parent, name) for controller, parent in parents.items()
        }
        self.limits = limits
        made: list[str] = []
        try:
            for path in dict.fromkeys(self.paths.values()):  # co-mounted: one directory
                os.mkdir(path)
                made.append(path)
            memory = self.paths["memory"]
            write(os.path.join(memory, "memory.limit_in_bytes"), str(limits.memory_bytes))
            if os.path.exists(os.path.join(memory, "memory.memsw.limit_in_bytes")):
                write(os.path.join(memory, "memory.memsw.limit_in_bytes"), str(limits.memory_bytes))
            write(os.path.join(self.paths["pids"], "pids.max"), str(limits.pids))
            if "cpu" in self.paths:
                write(os.path.join(self.paths["cpu"], "cpu.cfs_period_us"), str(CPU_PERIOD_US))
                quota = round(limits.cpus * CPU_PERIOD_US)
                write(os.path.join(self.paths["cpu"], "cpu.cfs_quota_us"), str(quota))
        except OSError:
            for path in reversed(made):
                with contextlib.suppress(OSError):
                    os.rmdir(path)
            raise

    def add(self, pid: int) -> None:
        for path in dict.fromkeys(self.paths.values()):
            write(os.path.join(path, "cgroup.procs"), str(pid))

    def _members(self) -> list[int]:
        return _pids(os.path.join(self.paths["pids"], "cgroup.procs"))

    def _kill(self) -> None:
        freezer = self.paths.get("freezer")
        if freezer is None:  # no freezer: kill until empty; pids.max bounds the forks
            for _ in range(100):
                members = self._members()
                if not members:
                    return
                _kill_each(members)
            return
        state = os.path.join(freezer, "freezer.state")
        write(state, "FROZEN")
        _wait_for(lambda: read(state).strip() == "FROZEN", 1.0)
        _kill_each(self._members())
        write(state, "THAWED")

    def close(self) -> tuple[str, ...]:
        if self._members():
            self._kill()
            if not _wait_for(lambda: not self._members(), EMPTY_WAIT_S):
                return _left_behind(self.paths["pids"])
        memory = self.paths["memory"]
        pids_events = os.path.join(self.paths["pids"], "pids.events")
        notes = _limit_notes(
            _counter(read(os.path.join(memory, "memory.oom_control")), "oom_kill"),
            _counter(read(pids_events), "max") if os.path.exists(pids_events) else 0,
            self.limits,
        )
        for path in dict.fromkeys(self.paths.values()):
            os.rmdir(path)
        return notes


def _left_behind(path: str) -> tuple[str, ...]:
    log.error(
        "python sandbox: processes of a call are still in %s %.0fs after it was killed "
        "(stuck in the kernel?); the cgroup is left in place",
        path,
        EMPTY_WAIT_S,
    )
    return (f"processes of the call were still running {EMPTY_WAIT_S:g}s after the kill",)
