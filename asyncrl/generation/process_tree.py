"""A process and everything it started, kept together and killed together (Linux).

Killing a process does not kill its children: they are handed to the nearest
*subreaper* ancestor, or to PID 1, and run on. A child that daemonises
(forks twice and calls ``setsid``) leaves both its parent's process group and
its session, so neither ``killpg`` nor a session kill reaches it. So the code
that runs user code (:mod:`asyncrl.generation.contained`, the reward workers) does three
things, each a kernel mechanism:

- the process above the user's code is a subreaper (:func:`become_subreaper`):
  an orphan anywhere below it is re-parented to it, never out of the tree;
- where the kernel lets an unprivileged user create namespaces, the user's code
  is PID 1 of a PID namespace of its own (:func:`enter_pid_namespace`): it
  cannot name (so cannot signal) any process outside, and when it dies the
  kernel kills every process in the namespace, daemons included;
- :func:`kill_tree` stops the whole tree first (a stopped process cannot fork),
  then kills it, leaves first.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys

import psutil

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
_CLONE_NEWUSER = 0x10000000
_CLONE_NEWPID = 0x20000000
_ROUNDS = 1000
"""Rounds of stopping newly found processes before the tree is taken as complete (each
round only finds processes forked before the round before stopped their parents)."""


def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    return ctypes.CDLL(None, use_errno=True)


def become_subreaper() -> bool:
    """Make orphans below this process its children, not PID 1's; False where unsupported."""
    libc = _libc()
    return libc is not None and libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0


def die_with_parent() -> bool:
    """Get SIGKILL when the thread that forked this process ends; False where unsupported."""
    libc = _libc()
    return libc is not None and libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0


def enter_pid_namespace() -> bool:
    """Put this process's next child in a new PID namespace (with a user namespace that maps
    our own uid and gid, so files and permissions stay as they were). False where the kernel
    refuses (user namespaces off, or restricted as on Ubuntu 24.04 without a profile): the
    caller then relies on the subreaper and :func:`kill_tree` alone. Single-threaded callers
    only (``unshare`` of a user namespace needs it)."""
    libc = _libc()
    if libc is None:
        return False
    uid, gid = os.getuid(), os.getgid()
    if libc.unshare(_CLONE_NEWUSER | _CLONE_NEWPID) != 0:
        return False
    maps = {"setgroups": "deny", "uid_map": f"{uid} {uid} 1", "gid_map": f"{gid} {gid} 1"}
    for name, text in maps.items():
        with contextlib.suppress(OSError), open(f"/proc/self/{name}", "w") as file:
            file.write(text)
    return True


def kill_tree(root: int | psutil.Process, *, include_root: bool = True) -> int:
    """SIGKILL every process below ``root`` (and ``root`` itself with ``include_root``); the
    number of processes killed. ``root`` is a pid only when it cannot have been reused (a
    child not yet waited for); else a :class:`psutil.Process` taken while it was known to
    run, which psutil will not signal once its pid is another process's.

    The root and then each descendant found is sent SIGSTOP, and the tree is listed again
    until no new process turns up: stopped processes cannot fork, so the list is then
    complete; only then is each one killed. Processes that left the tree before this (a
    daemon whose parent already exited, under a root that is not a subreaper) are out of
    its reach.
    """
    if not isinstance(root, psutil.Process):
        try:
            root = psutil.Process(root)
        except psutil.NoSuchProcess:
            return 0
    if include_root:
        _signal(root, signal.SIGSTOP)
    stopped: dict[int, psutil.Process] = {}
    for _ in range(_ROUNDS):
        try:
            below = root.children(recursive=True)
        except psutil.NoSuchProcess:
            break
        new = [p for p in below if p.pid not in stopped and _alive(p)]
        if not new:
            break
        for process in new:
            _signal(process, signal.SIGSTOP)
            stopped[process.pid] = process
    victims = [*reversed(stopped.values()), *([root] if include_root else [])]
    for process in victims:
        _signal(process, signal.SIGKILL)
    return len(victims)


def end_survivors(processes: list[psutil.Process], grace_s: float) -> int:
    """Wait up to ``grace_s`` for ``processes`` (taken while they ran, so a reused pid is
    never signalled) to exit, then SIGKILL those still running; the number killed."""
    _, alive = psutil.wait_procs(processes, timeout=grace_s)
    survivors = [process for process in alive if _alive(process)]
    for process in survivors:
        _signal(process, signal.SIGKILL)
    psutil.wait_procs(survivors, timeout=grace_s)
    return len(survivors)


def _alive(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _signal(process: psutil.Process, number: int) -> None:
    with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
        process.send_signal(number)
