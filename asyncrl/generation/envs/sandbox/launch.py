"""One call under bubblewrap, from start to result, every process of it ended.

::

    Popen(bwrap ...)            namespaces and mounts; bwrap's child, the future
         |                      PID 1, then waits on --block-fd
    child-pid  <-- --json-status-fd
    pidfd_open(child-pid), move it into the call's cgroup
         |                      nothing of the call runs yet, so every later
         |                      process of it is born inside the cgroup
    write --block-fd  -->  PID 1 execs the prelude: rlimits, non-dumpable,
         |                 forks the code (:mod:`.limits`)
    collect output until EOF and exit, or the deadline
    CallTree.stop()             SIGKILL PID 1 through its pidfd: the kernel kills
                                every process of the pid namespace, whatever they
                                did to their signals, session or parent; wait
                                until PID 1 has exited (the namespace is empty
                                then), kill bwrap's process group
    CallTree.close()            the cgroup: kill what is left, wait until it is
                                empty, remove it; notes on limits reached

No process of a call survives :func:`run_bubblewrap`: a process cannot leave
its pid namespace, and the namespace ends with its PID 1, which the code cannot
take over (it is non-dumpable, :mod:`.limits`). The cgroup is the second
guarantee, and the one that bounds the call's memory, processes and CPU.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import time
from typing import TYPE_CHECKING, Any

from asyncrl.generation.envs.sandbox.bwrap import (
    SANDBOX_PATH,
    StatusReader,
    applied_layers,
    bwrap_command,
    child_returncode,
    setup_failure,
    started,
)
from asyncrl.generation.envs.sandbox.cgroup_detect import CgroupSupport
from asyncrl.generation.envs.sandbox.cgroups import CallGroup
from asyncrl.generation.envs.sandbox.limits import (
    CallLimits,
    call_limits,
    prelude_command,
    rlimits,
)
from asyncrl.generation.envs.sandbox.process import (
    collect_output,
    kill_group,
    memfd,
    read_all,
    readable,
)
from asyncrl.generation.envs.sandbox.result import INSTALL_HINT, SandboxResult, not_run
from asyncrl.generation.envs.sandbox.seccomp import seccomp_program

if TYPE_CHECKING:
    from asyncrl.generation.envs.sandbox.runner import Sandbox

log = logging.getLogger("asyncrl.envs.sandbox")

SETUP_WAIT_S = 10.0
"""How long bwrap may take to report its child even when the call's time limit
is shorter (a loaded machine); the code's own time starts counting at launch."""
INIT_EXIT_WAIT_S = 5.0
"""How long a killed PID 1 may take to exit (its namespace emptied first)."""


class CallTree:
    """Every process of one call: bwrap (``proc``), the sandbox's PID 1 and what it
    started, and the call's cgroup."""

    def __init__(self, proc: subprocess.Popen, group: CallGroup) -> None:
        self.proc = proc
        self.group = group
        self.init_fd: int | None = None

    def adopt(self, init_pid: int) -> None:
        """Hold the sandbox's PID 1 (host pid ``init_pid``, waiting on ``--block-fd``)
        by a pidfd and move it into the call's cgroup; raises OSError."""
        self.init_fd = os.pidfd_open(init_pid)
        self.group.add(init_pid)

    def stop(self) -> None:
        """SIGKILL every process of the call and wait until the namespace is gone
        (cheap once done: collect_output calls it again while draining)."""
        if self.init_fd is not None:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self.init_fd, signal.SIGKILL)
            # A pidfd reads ready once its process has exited; PID 1 exits only
            # after the kernel has killed and reaped the rest of its namespace.
            if not readable(self.init_fd, INIT_EXIT_WAIT_S):
                log.error(
                    "python sandbox: a killed sandbox's PID 1 did not exit in %gs", INIT_EXIT_WAIT_S
                )
        kill_group(self.proc.pid)

    def close(self) -> tuple[str, ...]:
        """After the call: stop it, reap bwrap, empty and remove the cgroup."""
        self.stop()
        self.proc.wait()
        if self.init_fd is not None:
            os.close(self.init_fd)
            self.init_fd = None
        try:
            return self.group.close()
        except OSError as exc:
            log.error("python sandbox: could not remove a call's cgroup: %s", exc)
            return (f"the call's cgroup could not be removed: {exc}",)


def run_bubblewrap(
    sandbox: Sandbox, code: str, *, uid: int | None, gid: int | None, cgroups: CgroupSupport
) -> SandboxResult:
    """Run ``code`` in ``sandbox`` under bubblewrap (as host ``uid``/``gid`` when
    given), in a cgroup of ``cgroups`` when it has one."""
    program = seccomp_program()
    try:
        group = cgroups.create(_call_limits(sandbox))
    except OSError as exc:
        log.error("python sandbox: could not create a call's cgroup: %s", exc)
        return not_run(f"could not create the call's cgroup ({cgroups.mode}): {exc}")
    fds: list[int] = []
    tree: CallTree | None = None
    try:
        status_r, status_w = os.pipe()
        report_r, report_w = os.pipe()
        block_r, block_w = os.pipe()
        fds += [status_r, status_w, report_r, report_w, block_r, block_w]
        code_fd = memfd("main.py", code.encode("utf-8", "replace"))
        fds.append(code_fd)
        filter_fd = memfd("seccomp", program)
        fds.append(filter_fd)
        config = _prelude_config(sandbox, report_fd=report_w)
        command = prelude_command(sandbox.python, sandbox.site_packages, config)
        args = bwrap_command(
            sandbox,
            command,
            code_fd=code_fd,
            filter_fd=filter_fd,
            status_fd=status_w,
            block_fd=block_r,
        )
        start = time.monotonic()
        passed = (status_w, report_w, code_fd, filter_fd, block_r)
        try:
            proc = _start_bubblewrap(args, passed, uid=uid, gid=gid)
        except OSError as exc:
            group.close()
            as_user = f" as uid {uid} (Sandbox.user)" if uid is not None else ""
            return not_run(f"could not start bubblewrap{as_user}: {exc}; {INSTALL_HINT}")
        for fd in passed:
            os.close(fd)
            fds.remove(fd)
        tree = CallTree(proc, group)
        deadline = start + sandbox.timeout_s
        status = StatusReader(status_r)
        placement = _hold_until_placed(tree, status, block_w, max(deadline, start + SETUP_WAIT_S))
        fds.remove(block_w)  # closed by _hold_until_placed
        out, err, truncated, timed_out = collect_output(
            proc, deadline, sandbox.max_output_bytes, stop=tree.stop
        )
        duration = time.monotonic() - start
        notes = tree.close()
        tree = None
        reported = read_all(report_r)
        bwrap_status = status.finish()
    finally:
        if tree is not None:  # an error above: nothing of the call may outlive it
            tree.close()
        for fd in fds:
            os.close(fd)

    if not started(bwrap_status) or reported != b"rlimits":
        if timed_out and placement is None:
            return SandboxResult(out, err, proc.returncode, True, truncated, duration)
        if placement is not None and not err.strip():
            return not_run(placement)
        return not_run(setup_failure(bwrap_status, err, proc.returncode))
    layers = applied_layers(bwrap_status, separate_user=uid is not None, call_cgroup=group.mode)
    returncode = child_returncode(proc.returncode)  # PID 1 killed at the time limit: -9
    return SandboxResult(out, err, returncode, timed_out, truncated, duration, layers, notes)


def _start_bubblewrap(
    args: list[str], passed: tuple[int, ...], *, uid: int | None, gid: int | None
) -> subprocess.Popen:
    """bwrap in a session of its own, with only ``passed`` open, a bare environment, and
    as host ``uid``/``gid`` (no supplementary groups) when given."""
    user_args: dict[str, Any] = {}
    if uid is not None:
        user_args = {"user": uid, "group": gid, "extra_groups": []}
    return subprocess.Popen(
        args,
        cwd="/",
        env={"PATH": SANDBOX_PATH, "LANG": "C.UTF-8"},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        pass_fds=passed,
        start_new_session=True,
        **user_args,
    )


def _call_limits(sandbox: Sandbox) -> CallLimits:
    """What the call's cgroup bounds: memory (with the tmpfs), processes, CPUs."""
    return call_limits(
        memory_mb=sandbox.memory_mb,
        tmp_mb=sandbox.tmp_mb,
        shm_mb=sandbox.shm_mb,
        max_processes=sandbox.max_processes,
        cpus=sandbox.cpus,
    )


def _prelude_config(sandbox: Sandbox, *, report_fd: int) -> dict[str, Any]:
    """What the prelude applies inside the sandbox before the code runs: its rlimits,
    then it reports on ``report_fd`` and runs ``/tmp/main.py`` under an init."""
    return {
        "rlimits": rlimits(
            timeout_s=sandbox.timeout_s,
            memory_mb=sandbox.memory_mb,
            max_file_mb=sandbox.max_file_mb,
            max_open_files=sandbox.max_open_files,
            max_processes=sandbox.max_processes,
        ),
        "report_fd": report_fd,
        "main": "/tmp/main.py",
        "init": True,
    }


def _hold_until_placed(
    tree: CallTree, status: StatusReader, block_w: int, deadline: float
) -> str | None:
    """Let the sandbox's PID 1 run once it is held by a pidfd and inside the call's
    cgroup; otherwise kill it while it still waits. Closes ``block_w`` (the child
    reads EOF as a go, so never before it is placed or dead). None when placed,
    else why not."""
    try:
        init_pid = status.child_pid(deadline)
        if init_pid is None:
            tree.stop()  # bwrap exited, or is stuck before its child
            init_pid = status.finish().get("child-pid")  # reported meanwhile?
            if isinstance(init_pid, int) and init_pid > 0:
                with contextlib.suppress(OSError):
                    init_fd = os.pidfd_open(init_pid)
                    try:
                        signal.pidfd_send_signal(init_fd, signal.SIGKILL)
                    finally:
                        os.close(init_fd)
            return "bubblewrap did not report the sandbox's PID 1"
        try:
            tree.adopt(init_pid)
        except OSError as exc:
            tree.stop()
            return f"could not place the sandbox in the call's cgroup ({tree.group.mode}): {exc}"
        os.write(block_w, b"1")
        return None
    finally:
        os.close(block_w)
