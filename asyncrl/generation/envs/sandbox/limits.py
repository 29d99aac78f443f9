"""The resource limits of a sandboxed call, and the prelude that sets them.

Under bubblewrap the interpreter runs as the sandbox's PID 1 (``bwrap
--as-pid-1``): ``python -c PRELUDE RLIMITS REPORT_FD MAIN INIT``
(:func:`prelude_command`; plain strings, as importing ``json`` would cost a
call more CPU than the rest of the prelude). The prelude lowers the
rlimits of :func:`rlimits` (``RLIMIT_AS``, ``RLIMIT_CPU``, ``RLIMIT_FSIZE``, no
core dumps, ``RLIMIT_NOFILE`` and ``RLIMIT_NPROC``) for itself, makes itself
non-dumpable (``PR_SET_DUMPABLE`` 0), reports on a pipe that it did, and forks:
the child runs the code as ``__main__``; PID 1 stays behind as the sandbox's
init, reaping orphans until the code's process exits, then exits with its
status, and the kernel kills every process left in the pid namespace.

Why PID 1 is ours and not bubblewrap's: bwrap's init runs as the code's uid,
is dumpable and never gets the rlimits, so the code could open
``/proc/1/mem``, write into it and run as PID 1 with no limits and no
parent-death signal (issue 27, S1 and S4). Ours has the call's limits, and a
non-dumpable process's ``/proc/1/mem``, ``/proc/1/syscall`` and ptrace need
``CAP_SYS_PTRACE`` in its user namespace, which the code never has. Another
uid for the code is not possible without privileges in bwrap, and seccomp
cannot see which file ``open`` names.

:func:`call_limits` is what bounds the call as a whole in its cgroup
(:mod:`.cgroups`). A call whose prelude did not report never counts as run.
"""

from __future__ import annotations

import math
from typing import Any

from asyncrl.generation.envs.sandbox.cgroups import CallLimits

# Runs inside the sandbox as ``python -c PRELUDE RLIMITS REPORT_FD MAIN INIT``. Keep it stdlib
# only and free of names that leak into the user's ``__main__``. It is not a
# wall (the code runs in the same process); it only lowers limits, which no
# unprivileged process can raise again, and keeps PID 1 out of the code's reach.
PRELUDE = r"""
def _asyncrl_sandbox():
    import os, resource, sys, types
    limits, report_fd, main_path, init = sys.argv[1:5]
    report_fd, init = int(report_fd), init == "init"
    try:
        for limit in limits.split(","):
            name, soft, hard = limit.split(":")
            resource.setrlimit(getattr(resource, name), (int(soft), int(hard)))
        if init:
            # prctl through _ctypes itself: importing the ctypes package costs
            # more than the rest of the prelude.
            import _ctypes

            class _Int(_ctypes._SimpleCData):
                _type_ = "i"

            class _Function(_ctypes.CFuncPtr):
                _flags_ = _ctypes.FUNCFLAG_CDECL
                _restype_ = _Int

            class _Libc:
                _handle = _ctypes.dlopen(None, 0)

            prctl = _Function(("prctl", _Libc()))
            if prctl(4, 0, 0, 0, 0) != 0 or prctl(3, 0, 0, 0, 0) != 0:  # PR_{SET,GET}_DUMPABLE
                raise OSError("prctl(PR_SET_DUMPABLE, 0) failed")
    except Exception as exc:
        sys.stderr.write("sandbox: could not set limits: %r\n" % (exc,))
        sys.stderr.flush()
        os._exit(125)
    os.write(report_fd, b"rlimits")
    os.close(report_fd)

    if init:
        code_pid = os.fork()
        if code_pid:  # PID 1: reap until the code's process exits, then end the namespace
            import signal

            signal.signal(signal.SIGINT, signal.SIG_DFL)
            while True:
                pid, status = os.wait()
                if pid == code_pid:
                    code = os.waitstatus_to_exitcode(status)
                    os._exit(code if code >= 0 else 128 - code)
        prctl(4, 1, 0, 0, 0)  # the code's own process is an ordinary one

    with open(main_path, encoding="utf-8") as f:
        source = f.read()
    main = types.ModuleType("__main__")
    main.__file__ = "main.py"
    main.__builtins__ = __builtins__
    sys.modules["__main__"] = main
    sys.argv = ["main.py"]
    try:
        exec(compile(source, "main.py", "exec"), main.__dict__)
    except SystemExit:
        raise
    except BaseException as exc:
        import traceback

        traceback.print_exception(type(exc), exc, exc.__traceback__.tb_next)
        sys.exit(1)


_asyncrl_sandbox()
"""


def rlimits(
    *,
    timeout_s: float,
    memory_mb: int,
    max_file_mb: int,
    max_open_files: int,
    max_processes: int | None,
) -> list[tuple[str, int, int]]:
    """``(resource name, soft, hard)`` for the prelude; no ``RLIMIT_NPROC`` when
    ``max_processes`` is None (it counts every process of the user outside a user
    namespace)."""
    cpu = math.ceil(timeout_s) + 1
    memory = memory_mb * 1024 * 1024
    files = max_file_mb * 1024 * 1024
    limits = [
        ("RLIMIT_AS", memory, memory),
        ("RLIMIT_CPU", cpu, cpu + 1),
        ("RLIMIT_FSIZE", files, files),
        ("RLIMIT_CORE", 0, 0),
        ("RLIMIT_NOFILE", max_open_files, max_open_files),
    ]
    if max_processes is not None:
        limits.append(("RLIMIT_NPROC", max_processes, max_processes))
    return limits


def call_limits(
    *, memory_mb: int, tmp_mb: int, shm_mb: int, max_processes: int, cpus: float
) -> CallLimits:
    """The whole call's cgroup limits: memory for its processes and its two tmpfs
    together, ``max_processes`` tasks with the init, ``cpus`` CPUs of bandwidth."""
    return CallLimits(
        memory_bytes=(memory_mb + tmp_mb + shm_mb) * 1024 * 1024,
        pids=max_processes,
        cpus=cpus,
    )


def prelude_command(python: str, site_packages: bool, config: dict[str, Any]) -> list[str]:
    """The command line that runs the prelude with ``config``: ``rlimits`` (from
    :func:`rlimits`), ``report_fd`` (the pipe to report on), ``main`` (the path of
    the code) and ``init`` (whether it is the sandbox's PID 1); isolated mode, no
    bytecode, unbuffered, UTF-8, and without ``site`` unless ``site_packages``."""
    flags = ["-I", "-B", "-u", "-X", "utf8"] + ([] if site_packages else ["-S"])
    limits = ",".join(f"{name}:{soft}:{hard}" for name, soft, hard in config["rlimits"])
    init = "init" if config["init"] else "-"
    return [python, *flags, "-c", PRELUDE, limits, str(config["report_fd"]), config["main"], init]
