"""Run model-written Python in a disposable sandbox: bubblewrap, seccomp, rlimits.

``Sandbox(timeout_s=2, memory_mb=256).run("print(1 + 1)")`` returns a
:class:`SandboxResult` with the captured output. The model's code is treated as
hostile. With ``isolation="bubblewrap"`` (the default) each call runs under
`bubblewrap <https://github.com/containers/bubblewrap>`_ (``bwrap``):

- **a separate user**: when this process is root, ``bwrap`` is started as an
  unprivileged host user (``user``/``group``, default 65534 "nobody", no
  supplementary groups) and builds its namespaces as that user; when this
  process is not root (or ``user=None``) the kernel user stays this process's
  own and the namespaces below are the walls;
- **namespaces**: new user (uid/gid 65534 inside, no capabilities, no nested user
  namespaces), pid (the code sees only its own processes and cannot signal
  anything outside; every process it starts dies with the call), network
  (no interfaces, not even loopback), ipc, uts and cgroup namespaces;
- **a minimal read-only filesystem**: ``/usr`` read-only (``/bin``, ``/lib``,
  ``/lib64`` link into it, as on the host; where the host has directories there
  they are bound read-only), ``/etc/ld.so.cache`` and nothing else of ``/etc``;
  the interpreter's own install tree read-only when it is outside ``/usr``;
  every ``site-packages``/``dist-packages`` directory hidden under an empty
  read-only tmpfs; a fresh ``/proc`` and a minimal ``/dev``; the root (so
  ``/etc``) and ``/dev`` remounted read-only once set up; a private ``/tmp``
  (the working directory and ``HOME``, ``tmp_mb`` in size) and ``/dev/shm``
  (``shm_mb``), the only writable places, gone when the call ends. No host
  directory is visible to it: not ``/home``, ``/root``, the run directory, the
  venv;
- **seccomp**: a BPF filter (built once per process with libseccomp through
  ``pyseccomp``) refusing with ``EPERM`` the system calls a program here never
  needs (``ptrace``, ``mount``, ``unshare``/``setns``/``clone`` with namespace
  flags, ``bpf``, ``keyctl``, ``io_uring``, ``perf_event_open``, module and
  ``kexec`` calls, sockets of any family but ``AF_UNIX``, ...) and killing
  calls through a foreign syscall ABI;
- **its own PID 1**: the interpreter is the sandbox's init (``--as-pid-1``);
  a stdlib-only prelude sets the rlimits, makes that process non-dumpable
  (so the code can neither open ``/proc/1/mem`` nor ptrace it) and forks the
  code, then reaps orphans until the code's process exits (:mod:`.limits`);
- **rlimits** on every process, PID 1 included: ``RLIMIT_AS``
  (``memory_mb``), ``RLIMIT_CPU``, ``RLIMIT_FSIZE`` (``max_file_mb``), no core
  dumps, ``RLIMIT_NPROC`` (``max_processes``) and ``RLIMIT_NOFILE``
  (``max_open_files``);
- **a cgroup per call** (:mod:`.cgroups`, :mod:`.cgroup_detect`; v2 or v1 where this machine allows,
  ``cgroup``): memory (``memory_mb + tmp_mb + shm_mb``), processes
  (``max_processes``) and CPU (``cpus``) bound all the call's processes
  together; where no cgroup is writable these limits are per process only,
  which is logged and said by :func:`check_isolation`;
- ``--die-with-parent``, ``--new-session``, an empty environment plus ``PATH``,
  ``HOME``, ``TMPDIR`` and ``LANG``; the code comes in through a memfd copied
  to ``/tmp/main.py``.

At the end of a call, or at its wall-clock limit, PID 1 is killed through a
pidfd: the kernel then kills every process of the pid namespace, whatever it
did to its signals, session or parent, and :meth:`Sandbox.run` returns only
once they are gone and the call's cgroup is empty and removed
(:mod:`.launch`). stdout and stderr are each truncated to ``max_output_bytes``
(the rest is read and discarded, so a flood of output neither blocks nor
fills memory). ``SandboxResult.layers`` lists what was applied, ``notes`` the
whole-call limits a call reached.

Never weaker than configured: when ``bwrap`` is missing, cannot build its
namespaces, the seccomp filter cannot be built, or whole-call limits are
required (``cgroup="required"``, ``ASYNCRL_SANDBOX_CGROUP``) and no cgroup can
be used, :meth:`Sandbox.run` does not run the code; it returns a result with
``returncode=None`` whose ``stderr`` says why. :func:`check_isolation` and
:func:`check_isolation_for` raise :class:`SandboxUnavailable` with that reason,
for a launcher to refuse to start.

``isolation="none"`` is the opt-out for trusted code only: a plain subprocess
of this process's user with the rlimits above (not ``RLIMIT_NPROC``) and a
scratch directory as its working directory, no other wall. Building such a
sandbox logs a warning every time.

Everything runs without ``preexec_fn``, so :meth:`Sandbox.run` is safe to call
from several threads at once.

One job per module: :mod:`.runner` (:class:`Sandbox`, its settings),
:mod:`.launch` (a bubblewrap call from start to result, and its end),
:mod:`.bwrap` (the command line and bwrap's status), :mod:`.seccomp` (the
filter), :mod:`.limits` (the rlimits and the prelude, PID 1), :mod:`.cgroups`
(a call's cgroup), :mod:`.cgroup_detect` (which cgroups this machine gives),
:mod:`.interpreter` (which interpreter, what of the host it sees),
:mod:`.process` (output capping), :mod:`.result`, :mod:`.checks`.
"""

from asyncrl.generation.envs.sandbox.bwrap import NAMESPACE_KEYS, SANDBOX_PATH, SANDBOX_UID
from asyncrl.generation.envs.sandbox.cgroup_detect import CGROUP_ENV, CgroupSupport, cgroup_support
from asyncrl.generation.envs.sandbox.checks import (
    check_isolation,
    check_isolation_for,
    limits_in_force,
)
from asyncrl.generation.envs.sandbox.interpreter import (
    FALLBACK_PYTHON,
    default_python,
    interpreter_layout,
    root_links,
)
from asyncrl.generation.envs.sandbox.limits import PRELUDE
from asyncrl.generation.envs.sandbox.result import INSTALL_HINT, SandboxResult, SandboxUnavailable
from asyncrl.generation.envs.sandbox.runner import (
    CGROUP_POLICIES,
    ISOLATIONS,
    Isolation,
    Sandbox,
    run_python,
)
from asyncrl.generation.envs.sandbox.seccomp import DENIED_SYSCALLS, seccomp_program

__all__ = [
    "CGROUP_ENV",
    "CGROUP_POLICIES",
    "DENIED_SYSCALLS",
    "FALLBACK_PYTHON",
    "INSTALL_HINT",
    "ISOLATIONS",
    "NAMESPACE_KEYS",
    "PRELUDE",
    "SANDBOX_PATH",
    "SANDBOX_UID",
    "CgroupSupport",
    "Isolation",
    "Sandbox",
    "SandboxResult",
    "SandboxUnavailable",
    "cgroup_support",
    "check_isolation",
    "check_isolation_for",
    "default_python",
    "interpreter_layout",
    "limits_in_force",
    "root_links",
    "run_python",
    "seccomp_program",
]
