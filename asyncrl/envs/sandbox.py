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
  read-only tmpfs; a fresh ``/proc`` and a minimal ``/dev``; a private
  ``/tmp`` (the working directory and ``HOME``, ``tmp_mb`` in size) and
  ``/dev/shm`` (``shm_mb``), gone when the call ends. No host directory is
  visible to it: not ``/home``, ``/root``, the run directory, the venv;
- **seccomp**: a BPF filter (built once per process with libseccomp through
  ``pyseccomp``) refusing with ``EPERM`` the system calls a program here never
  needs (``ptrace``, ``mount``, ``unshare``/``setns``/``clone`` with namespace
  flags, ``bpf``, ``keyctl``, ``io_uring``, ``perf_event_open``, module and
  ``kexec`` calls, sockets of any family but ``AF_UNIX``, ...) and killing
  calls through a foreign syscall ABI;
- **rlimits** set by a stdlib-only prelude before the code runs:
  ``RLIMIT_AS`` (``memory_mb``), ``RLIMIT_CPU``, ``RLIMIT_FSIZE``
  (``max_file_mb``), no core dumps, ``RLIMIT_NPROC`` (``max_processes``) and
  ``RLIMIT_NOFILE`` (``max_open_files``);
- ``--die-with-parent``, ``--new-session``, an empty environment plus ``PATH``,
  ``HOME``, ``TMPDIR`` and ``LANG``; the code comes in through a memfd copied
  to ``/tmp/main.py``.

The wall-clock limit kills ``bwrap``'s process group, which takes the pid
namespace, and so everything the code started, with it. stdout and stderr
are each truncated to ``max_output_bytes`` (the rest is read and discarded,
so a flood of output neither blocks nor fills memory). ``SandboxResult.layers``
lists what was applied.

Never weaker than configured: when ``bwrap`` is missing, cannot build its
namespaces, or the seccomp filter cannot be built, :meth:`Sandbox.run` does not
run the code; it returns a result with ``returncode=None`` whose ``stderr`` says
why. :func:`check_isolation` and :func:`check_isolation_for` raise
:class:`SandboxUnavailable` with that reason, for a launcher to refuse to start.

``isolation="none"`` is the opt-out for trusted code only: a plain subprocess
of this process's user with the rlimits above (not ``RLIMIT_NPROC``) and a
scratch directory as its working directory, no other wall. Building such a
sandbox logs a warning every time.

Everything runs without ``preexec_fn``, so :meth:`Sandbox.run` is safe to call
from several threads at once.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import json
import logging
import math
import os
import selectors
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any, Literal

log = logging.getLogger("asyncrl.envs.sandbox")

Isolation = Literal["bubblewrap", "none"]
ISOLATIONS: tuple[str, ...] = ("bubblewrap", "none")

SANDBOX_UID = 65534
"""The host user ``bwrap`` runs as when this process is root ("nobody"), and the
uid/gid the code sees inside the sandbox."""
FALLBACK_PYTHON = "/usr/bin/python3"
"""The sandbox's interpreter when this process's own cannot be reached by the
sandbox user (e.g. a pyenv build under ``/root``, mode 0700)."""

INSTALL_HINT = (
    "install bubblewrap (`apt-get install bubblewrap`, or `bash scripts/setup.sh` as root) "
    "and make sure unprivileged user namespaces are enabled "
    "(`sysctl user.max_user_namespaces` > 0, `kernel.unprivileged_userns_clone=1` "
    "where it exists; Docker's default seccomp profile blocks them: run the container "
    "with a profile that allows them); or, for trusted code only, set "
    "`environment.python_isolation: none`"
)

SANDBOX_PATH = "/usr/local/bin:/usr/bin:/bin"


class SandboxUnavailable(RuntimeError):
    """The configured isolation cannot be applied here. The message is one line
    saying what is wrong and how to fix it."""


# Runs inside the sandbox as ``python -c PRELUDE CONFIG_JSON``. Keep it stdlib
# only and free of names that leak into the user's ``__main__``. It is not a
# wall (the code runs in the same process); it only lowers limits, which no
# unprivileged process can raise again.
PRELUDE = r"""
def _asyncrl_sandbox():
    import json, os, resource, sys, types
    cfg = json.loads(sys.argv[1])
    try:
        for name, soft, hard in cfg["rlimits"]:
            resource.setrlimit(getattr(resource, name), (soft, hard))
    except Exception as exc:
        sys.stderr.write("sandbox: could not set limits: %r\n" % (exc,))
        sys.stderr.flush()
        os._exit(125)
    os.write(cfg["report_fd"], b"rlimits")
    os.close(cfg["report_fd"])

    with open(cfg["main"], encoding="utf-8") as f:
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


@dataclass(frozen=True)
class SandboxResult:
    stdout: str
    stderr: str
    returncode: int | None
    """Exit status; negative: killed by that signal; None: the code never ran
    (``stderr`` says why)."""
    timed_out: bool
    truncated: bool
    """stdout or stderr went over ``max_output_bytes`` and was cut."""
    duration_s: float
    layers: tuple[str, ...] = ()
    """What was applied: with bubblewrap ``bubblewrap``, ``separate-user`` (bwrap
    ran as ``Sandbox.user``), the namespaces ``user``, ``pid``, ``net``,
    ``mount``, ``ipc``, ``uts``, ``cgroup``, then ``seccomp`` and ``rlimits``;
    with ``isolation="none"`` only ``rlimits``."""
    notes: tuple[str, ...] = field(default=())
    """Why the code did not run, or a layer could not be applied."""

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out


@dataclass(frozen=True)
class Sandbox:
    """Limits and isolation for one call; :meth:`run` is safe to call from several
    threads."""

    timeout_s: float = 5.0
    memory_mb: int = 512
    max_output_bytes: int = 16_384
    max_file_mb: int = 16
    """Largest file the code may write (``RLIMIT_FSIZE``)."""
    tmp_mb: int = 64
    """Size of the private ``/tmp`` (bubblewrap): all files written there together."""
    shm_mb: int = 16
    """Size of the private ``/dev/shm`` (bubblewrap)."""
    max_processes: int = 64
    """``RLIMIT_NPROC`` inside the sandbox's user namespace (threads count; bubblewrap only)."""
    max_open_files: int = 256
    """``RLIMIT_NOFILE``."""
    isolation: Isolation = "bubblewrap"
    """``bubblewrap`` (the default): the walls above; ``none``: a plain subprocess
    with rlimits, for trusted code only (logs a warning whenever built)."""
    site_packages: bool = False
    """Let the code import the sandbox interpreter's own installed packages
    (drops ``-S``; with bubblewrap they are shown read-only instead of hidden).
    Never this process's venv."""
    python: str = ""
    """The interpreter run in the sandbox. Empty: this process's own (resolved,
    not a venv's link) when the sandbox user can reach it, else ``/usr/bin/python3``;
    with ``isolation="none"`` always ``sys.executable``."""
    bwrap: str = "bwrap"
    """The bubblewrap executable, a name on ``PATH`` or a path."""
    user: int | None = SANDBOX_UID
    """Host uid ``bwrap`` runs as when this process is root. None: as this process's
    own user even then (where root cannot change user, e.g. a rootless container:
    the namespaces are then the only walls)."""
    group: int = SANDBOX_UID
    """Host gid ``bwrap`` runs as when this process is root."""

    def __post_init__(self) -> None:
        if self.timeout_s <= 0 or self.memory_mb < 16 or self.max_output_bytes < 0:
            raise ValueError("sandbox: timeout_s > 0, memory_mb >= 16, max_output_bytes >= 0")
        if min(self.max_file_mb, self.tmp_mb, self.shm_mb) < 1:
            raise ValueError("sandbox: max_file_mb, tmp_mb and shm_mb must be >= 1")
        if self.max_processes < 1 or self.max_open_files < 16:
            raise ValueError("sandbox: max_processes >= 1, max_open_files >= 16")
        if self.isolation not in ISOLATIONS:
            raise ValueError(
                f"sandbox: isolation must be 'bubblewrap' or 'none' (trusted code only), "
                f"got {self.isolation!r}"
            )
        if not self.python:
            python = (
                sys.executable
                if self.isolation == "none"
                else default_python(*self._sandbox_user())
            )
            object.__setattr__(self, "python", python)
        if self.isolation == "none":
            log.warning(
                "SANDBOX ISOLATION IS OFF (isolation=none): model-written Python runs as "
                "this process's user (uid %d) with its filesystem, network and processes "
                "in reach; only rlimits apply. Use this for trusted code only.",
                os.geteuid(),
            )

    # -- running -----------------------------------------------------------------

    def run(self, code: str) -> SandboxResult:
        if self.isolation == "none":
            return self._run_plain(code)
        return self._run_bubblewrap(code)

    def unavailable(self) -> str | None:
        """Why :meth:`run` cannot apply the configured isolation without trying it
        (bwrap not found, no seccomp, no interpreter); None when nothing is known
        to be wrong. :func:`check_isolation` also runs a probe."""
        if self.isolation == "none":
            return None
        if _which(self.bwrap) is None:
            return f"bubblewrap ({self.bwrap!r}) is not installed or not on PATH; {INSTALL_HINT}"
        try:
            seccomp_program()
        except SandboxUnavailable as exc:
            return str(exc)
        if not os.access(self.python, os.X_OK):
            return (
                f"the sandbox interpreter {self.python} does not exist or is not executable; "
                f"install python3 (`apt-get install python3`) or set Sandbox.python"
            )
        return None

    def _sandbox_user(self) -> tuple[int, int] | tuple[None, None]:
        """The host user bwrap runs as: ``(user, group)`` when this process is root,
        else ``(None, None)`` (this process's own)."""
        if os.geteuid() == 0 and self.user is not None:
            return (self.user, self.group)
        return (None, None)

    def _rlimits(self, *, nproc: bool) -> list[tuple[str, int, int]]:
        cpu = math.ceil(self.timeout_s) + 1
        memory = self.memory_mb * 1024 * 1024
        files = self.max_file_mb * 1024 * 1024
        limits = [
            ("RLIMIT_AS", memory, memory),
            ("RLIMIT_CPU", cpu, cpu + 1),
            ("RLIMIT_FSIZE", files, files),
            ("RLIMIT_CORE", 0, 0),
            ("RLIMIT_NOFILE", self.max_open_files, self.max_open_files),
        ]
        if nproc:
            limits.append(("RLIMIT_NPROC", self.max_processes, self.max_processes))
        return limits

    def _python_flags(self) -> list[str]:
        return ["-I", "-B", "-u", "-X", "utf8"] + ([] if self.site_packages else ["-S"])

    def _run_bubblewrap(self, code: str) -> SandboxResult:
        problem = self.unavailable()
        if problem is not None:
            return _not_run(problem)
        program = seccomp_program()
        uid, gid = self._sandbox_user()
        binds, hidden = interpreter_layout(self.python)
        fds: list[int] = []
        try:
            status_r, status_w = os.pipe()
            report_r, report_w = os.pipe()
            fds += [status_r, status_w, report_r, report_w]
            code_fd = _memfd("main.py", code.encode("utf-8", "replace"))
            fds.append(code_fd)
            filter_fd = _memfd("seccomp", program)
            fds.append(filter_fd)
            config = {
                "rlimits": self._rlimits(nproc=True),
                "report_fd": report_w,
                "main": "/tmp/main.py",
            }
            # fmt: off
            args = [
                _which(self.bwrap) or self.bwrap,
                "--unshare-all", "--unshare-user", "--disable-userns",
                "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID),
                "--hostname", "sandbox",
                "--die-with-parent", "--new-session",
                "--ro-bind", "/usr", "/usr",
                *root_links(),
                "--ro-bind-try", "/etc/ld.so.cache", "/etc/ld.so.cache",
            ]
            for path in binds:
                args += ["--ro-bind", path, path]
            if not self.site_packages:
                for path in hidden:
                    args += ["--size", "4096", "--tmpfs", path, "--remount-ro", path]
            args += [
                "--proc", "/proc",
                "--dev", "/dev",
                "--size", str(self.tmp_mb * 1024 * 1024), "--tmpfs", "/tmp",
                "--size", str(self.shm_mb * 1024 * 1024), "--tmpfs", "/dev/shm",
                "--file", str(code_fd), "/tmp/main.py",
                "--chdir", "/tmp",
                "--clearenv",
                "--setenv", "PATH", SANDBOX_PATH,
                "--setenv", "HOME", "/tmp",
                "--setenv", "TMPDIR", "/tmp",
                "--setenv", "LANG", "C.UTF-8",
                "--seccomp", str(filter_fd),
                "--json-status-fd", str(status_w),
                "--",
                self.python, *self._python_flags(), "-c", PRELUDE, json.dumps(config),
            ]
            # fmt: on
            user_args: dict[str, Any] = {}
            if uid is not None:
                user_args = {"user": uid, "group": gid, "extra_groups": []}
            start = time.monotonic()
            try:
                proc = subprocess.Popen(
                    args,
                    cwd="/",
                    env={"PATH": SANDBOX_PATH, "LANG": "C.UTF-8"},
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    pass_fds=(status_w, report_w, code_fd, filter_fd),
                    start_new_session=True,
                    **user_args,
                )
            except OSError as exc:
                as_user = f" as uid {uid} (Sandbox.user)" if uid is not None else ""
                return _not_run(f"could not start bubblewrap{as_user}: {exc}; {INSTALL_HINT}")
            for fd in (status_w, report_w, code_fd, filter_fd):
                os.close(fd)
                fds.remove(fd)
            out, err, truncated, timed_out = self._collect(proc, start + self.timeout_s)
            duration = time.monotonic() - start
            status = _read_status(status_r)
            reported = _read_all(report_r)
        finally:
            for fd in fds:
                os.close(fd)

        if "child-pid" not in status or reported != b"rlimits":
            if timed_out:
                return SandboxResult(out, err, proc.returncode, True, truncated, duration)
            reason = err.strip().splitlines()[-1] if err.strip() else f"exit {proc.returncode}"
            reason = reason.rstrip(". ")
            if "child-pid" not in status:  # no namespaces: bwrap never cloned its child
                _log_setup_failure(reason)
                return _not_run(
                    f"bubblewrap could not set up the sandbox: {reason}; {INSTALL_HINT}"
                )
            if reason.startswith("bwrap:"):  # a mount or exec step inside failed
                _log_setup_failure(reason)
                return _not_run(f"bubblewrap could not set up the sandbox: {reason}")
            return _not_run(f"the sandbox's interpreter did not start: {reason}")
        layers = ["bubblewrap"]
        if uid is not None:
            layers.append("separate-user")
        layers.append("user")
        for key, name in NAMESPACE_KEYS:
            if key in status:
                layers.append(name)
        layers += ["seccomp", "rlimits"]
        returncode = proc.returncode
        if not timed_out and returncode is not None and 128 < returncode <= 128 + 64:
            # bwrap's reaper reports a child killed by signal N as 128 + N.
            returncode = 128 - returncode
        return SandboxResult(out, err, returncode, timed_out, truncated, duration, tuple(layers))

    def _run_plain(self, code: str) -> SandboxResult:
        root = tempfile.mkdtemp(prefix="asyncrl-sandbox-")
        report_r, report_w = os.pipe()
        try:
            main = os.path.join(root, "main.py")
            with open(main, "w", encoding="utf-8", errors="replace") as f:
                f.write(code)
            config = {
                "rlimits": self._rlimits(nproc=False),
                "report_fd": report_w,
                "main": main,
            }
            env = {"PATH": SANDBOX_PATH, "HOME": root, "TMPDIR": root, "LANG": "C.UTF-8"}
            start = time.monotonic()
            try:
                proc = subprocess.Popen(
                    [self.python, *self._python_flags(), "-c", PRELUDE, json.dumps(config)],
                    cwd=root,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    pass_fds=(report_w,),
                    start_new_session=True,
                )
            except OSError as exc:
                return _not_run(f"could not start {self.python}: {exc}")
            os.close(report_w)
            report_w = -1
            out, err, truncated, timed_out = self._collect(proc, start + self.timeout_s)
            duration = time.monotonic() - start
            layers = ("rlimits",) if _read_all(report_r) == b"rlimits" else ()
            return SandboxResult(out, err, proc.returncode, timed_out, truncated, duration, layers)
        finally:
            for fd in (report_r, report_w):
                if fd >= 0:
                    os.close(fd)
            shutil.rmtree(root, ignore_errors=True)

    def _collect(self, proc: subprocess.Popen, deadline: float) -> tuple[str, str, bool, bool]:
        """Read both pipes up to the output limit until EOF or the deadline."""
        kept = {"stdout": bytearray(), "stderr": bytearray()}
        truncated = timed_out = False
        selector = selectors.DefaultSelector()
        selector.register(proc.stdout, selectors.EVENT_READ, "stdout")
        selector.register(proc.stderr, selectors.EVENT_READ, "stderr")
        try:
            while selector.get_map():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    timed_out = True
                    break
                for key, _ in selector.select(timeout=min(remaining, 0.5)):
                    chunk = os.read(key.fd, 65536)
                    if not chunk:
                        selector.unregister(key.fileobj)
                        continue
                    buffer = kept[key.data]
                    room = self.max_output_bytes - len(buffer)
                    if len(chunk) > room:
                        truncated = True
                    buffer += chunk[: max(room, 0)]
                if proc.poll() is not None:
                    # Exited: stop anything it left behind, then drain what is left.
                    _kill_group(proc.pid)
            if not timed_out:
                try:  # it may have closed its output and still be running
                    proc.wait(timeout=max(deadline - time.monotonic(), 0.001))
                except subprocess.TimeoutExpired:
                    timed_out = True
        finally:
            selector.close()
            _kill_group(proc.pid)
            proc.wait()
            proc.stdout.close()
            proc.stderr.close()
        return (
            kept["stdout"].decode("utf-8", "replace"),
            kept["stderr"].decode("utf-8", "replace"),
            truncated,
            timed_out,
        )


NAMESPACE_KEYS: tuple[tuple[str, str], ...] = (
    ("pid-namespace", "pid"),
    ("net-namespace", "net"),
    ("mnt-namespace", "mount"),
    ("ipc-namespace", "ipc"),
    ("uts-namespace", "uts"),
    ("cgroup-namespace", "cgroup"),
)
"""bwrap's ``--json-status-fd`` keys and the names they get in ``layers``."""


# -- the interpreter -------------------------------------------------------------


def _can_reach(path: str, uid: int | None, gid: int | None, mode: int) -> bool:
    """Whether ``uid``/``gid`` (no supplementary groups) can search every directory
    above ``path`` and has ``mode`` (``os.R_OK | os.X_OK`` ...) on ``path`` itself;
    ``uid`` None: this process, by ``os.access``."""
    if uid is None:
        return os.access(path, mode)
    parts = os.path.abspath(path).split(os.sep)
    checks = [(os.sep.join(parts[:i]) or os.sep, os.X_OK) for i in range(1, len(parts))]
    for where, want in [*checks, (path, mode)]:
        try:
            st = os.stat(where)
        except OSError:
            return False
        if uid == 0:
            continue
        if st.st_uid == uid:
            bits = (st.st_mode >> 6) & 7
        elif st.st_gid == gid:
            bits = (st.st_mode >> 3) & 7
        else:
            bits = st.st_mode & 7
        if (want & os.R_OK and not bits & 4) or (want & os.X_OK and not bits & 1):
            return False
    return True


_DEFAULT_PYTHON: dict[tuple[int | None, int | None], str] = {}


def default_python(uid: int | None = None, gid: int | None = None) -> str:
    """This process's interpreter, resolved (a venv's ``python`` is a link to its
    base), when ``uid``/``gid`` (None: this process's user) can run it and read
    its standard library; else :data:`FALLBACK_PYTHON`."""
    key = (uid, gid)
    if key not in _DEFAULT_PYTHON:
        own = os.path.realpath(sys.executable)
        stdlib = os.path.realpath(sysconfig.get_paths()["stdlib"])
        reachable = _can_reach(own, uid, gid, os.R_OK | os.X_OK) and _can_reach(
            stdlib, uid, gid, os.R_OK | os.X_OK
        )
        _DEFAULT_PYTHON[key] = own if reachable else FALLBACK_PYTHON
    return _DEFAULT_PYTHON[key]


_LAYOUTS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {}


def interpreter_layout(python: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``(trees to bind read-only, package directories to hide)`` for running
    ``python`` in the sandbox. The tree is the interpreter's install prefix when it
    is outside ``/usr``; the hidden directories are every ``site-packages`` and
    ``dist-packages`` of ``/usr``, ``/usr/local`` and that prefix."""
    if python in _LAYOUTS:
        return _LAYOUTS[python]
    real = os.path.realpath(python)
    if real == os.path.realpath(sys.executable):
        prefix = os.path.realpath(sys.base_prefix)
    else:
        prefix = os.path.dirname(os.path.dirname(real))
    binds: tuple[str, ...] = ()
    if not _under(real, "/usr"):
        binds = (prefix,)
    hidden: list[str] = []
    for root in dict.fromkeys(["/usr", "/usr/local", *binds]):
        for pattern in (
            "lib*/python3*/site-packages",
            "lib*/python3*/dist-packages",
            "lib*/python3/dist-packages",
        ):
            for path in sorted(glob.glob(os.path.join(root, pattern))):
                path = os.path.realpath(path)
                if (
                    os.path.isdir(path)
                    and path not in hidden
                    and any(_under(path, tree) for tree in ("/usr", *binds))
                ):
                    hidden.append(path)
    _LAYOUTS[python] = (binds, tuple(hidden))
    return _LAYOUTS[python]


_ROOT_LINKS: list[str] = []


def root_links() -> list[str]:
    """bwrap arguments for ``/bin``, ``/lib``, ``/lib64``, ...: the host's links into
    ``/usr`` (a merged-``/usr`` system: ``--symlink usr/lib /lib``), or the host's
    directories read-only where they are not links."""
    if not _ROOT_LINKS:
        links: list[str] = []
        for path in ("/bin", "/sbin", "/lib", "/lib64", "/lib32", "/libx32"):
            if os.path.islink(path):
                links += ["--symlink", os.readlink(path), path]
            elif os.path.isdir(path):
                links += ["--ro-bind", path, path]
        _ROOT_LINKS[:] = links
    return list(_ROOT_LINKS)


def _under(path: str, tree: str) -> bool:
    return path == tree or path.startswith(tree.rstrip("/") + "/")


# -- seccomp -----------------------------------------------------------------------

DENIED_SYSCALLS: tuple[str, ...] = (
    # other processes' memory
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd",
    # mounts and namespaces (bwrap has set them up already)
    "mount", "umount2", "pivot_root", "chroot", "fsopen", "fsconfig", "fsmount",
    "fspick", "move_mount", "open_tree", "mount_setattr", "unshare", "setns",
    # the kernel's larger attack surfaces
    "bpf", "perf_event_open", "userfaultfd", "io_uring_setup", "io_uring_enter",
    "io_uring_register", "keyctl", "add_key", "request_key",
    # the machine
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module",
    "reboot", "swapon", "swapoff", "acct", "quotactl", "quotactl_fd", "syslog",
    "settimeofday", "clock_settime", "clock_adjtime", "adjtimex", "sethostname",
    "setdomainname", "iopl", "ioperm", "vhangup", "uselib", "nfsservctl",
    # files by handle, around the mount namespace
    "open_by_handle_at", "name_to_handle_at",
    "personality", "lookup_dcookie",
)  # fmt: skip
"""Refused with ``EPERM`` by the sandbox's seccomp filter (those this
architecture lacks are skipped)."""

CLONE_NAMESPACE_FLAGS = (
    0x00000080,  # CLONE_NEWTIME
    0x00020000,  # CLONE_NEWNS
    0x02000000,  # CLONE_NEWCGROUP
    0x04000000,  # CLONE_NEWUTS
    0x08000000,  # CLONE_NEWIPC
    0x10000000,  # CLONE_NEWUSER
    0x20000000,  # CLONE_NEWPID
    0x40000000,  # CLONE_NEWNET
)
AF_UNIX = 1
TIOCSTI, TIOCLINUX = 0x5412, 0x541C

_SECCOMP_LOCK = threading.Lock()
_SECCOMP: bytes | SandboxUnavailable | None = None


def seccomp_program() -> bytes:
    """The sandbox's seccomp filter as a BPF program for ``bwrap --seccomp``;
    built on the first call and kept. Raises :class:`SandboxUnavailable` when it
    cannot be built."""
    global _SECCOMP
    with _SECCOMP_LOCK:
        if _SECCOMP is None:
            try:
                _SECCOMP = _build_seccomp_program()
            except SandboxUnavailable as exc:
                _SECCOMP = exc
        if isinstance(_SECCOMP, SandboxUnavailable):
            raise SandboxUnavailable(str(_SECCOMP))
        return _SECCOMP


def _build_seccomp_program() -> bytes:
    if not sys.platform.startswith("linux"):
        raise SandboxUnavailable(f"the sandbox needs Linux (seccomp, namespaces): {sys.platform}")
    try:
        import pyseccomp as seccomp
    except ImportError:
        raise SandboxUnavailable(
            "seccomp: the pyseccomp package is missing: pip install 'pyseccomp>=0.1.2'"
        ) from None
    except (RuntimeError, OSError) as exc:  # pyseccomp raises RuntimeError without libseccomp
        raise SandboxUnavailable(
            f"seccomp: libseccomp cannot be loaded ({exc}): apt-get install libseccomp2"
        ) from None
    deny = seccomp.ERRNO(errno.EPERM)
    try:
        program = seccomp.SyscallFilter(seccomp.ALLOW)
        for name in DENIED_SYSCALLS:
            with contextlib.suppress(OSError):  # not a system call on this architecture
                program.add_rule(deny, name)
        for flag in CLONE_NAMESPACE_FLAGS:
            program.add_rule(deny, "clone", seccomp.Arg(0, seccomp.MASKED_EQ, flag, flag))
        # clone3 passes its flags in memory a filter cannot read: ENOSYS makes libc
        # fall back to clone, whose flags the rules above see.
        with contextlib.suppress(OSError):
            program.add_rule(seccomp.ERRNO(errno.ENOSYS), "clone3")
        for call in ("socket", "socketpair"):
            program.add_rule(deny, call, seccomp.Arg(0, seccomp.NE, AF_UNIX))
        for request in (TIOCSTI, TIOCLINUX):
            program.add_rule(deny, "ioctl", seccomp.Arg(1, seccomp.MASKED_EQ, 0xFFFFFFFF, request))
        with tempfile.TemporaryFile() as f:
            program.export_bpf(f)
            f.seek(0)
            return f.read()
    except OSError as exc:
        raise SandboxUnavailable(f"seccomp: could not build the filter: {exc}") from None


# -- helpers -------------------------------------------------------------------


def _which(name: str) -> str | None:
    if os.sep in name:
        return name if os.access(name, os.X_OK) else None
    return shutil.which(name, path=os.environ.get("PATH", "") + os.pathsep + SANDBOX_PATH)


def _memfd(name: str, data: bytes) -> int:
    fd = os.memfd_create(name)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.lseek(fd, 0, os.SEEK_SET)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _not_run(reason: str) -> SandboxResult:
    return SandboxResult(
        "", f"sandbox: the code was not run: {reason}\n", None, False, False, 0.0, (), (reason,)
    )


_SETUP_FAILURE_LOGGED = False


def _log_setup_failure(reason: str) -> None:
    global _SETUP_FAILURE_LOGGED
    if not _SETUP_FAILURE_LOGGED:
        _SETUP_FAILURE_LOGGED = True
        log.error("python sandbox: bubblewrap could not set up the sandbox: %s", reason)


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def _read_all(fd: int) -> bytes:
    """What is in a pipe now, without waiting for writers that may linger."""
    data = b""
    os.set_blocking(fd, False)
    with contextlib.suppress(BlockingIOError):
        while chunk := os.read(fd, 65536):
            data += chunk
    return data


def _read_status(fd: int) -> dict[str, Any]:
    """bwrap's ``--json-status-fd`` documents, merged."""
    status: dict[str, Any] = {}
    decoder = json.JSONDecoder()
    text = _read_all(fd).decode("utf-8", "replace")
    index = 0
    while True:
        while index < len(text) and text[index].isspace():
            index += 1
        if index >= len(text):
            break
        try:
            document, index = decoder.raw_decode(text, index)
        except ValueError:
            break
        if isinstance(document, dict):
            status.update(document)
    return status


# -- checks for a launcher ---------------------------------------------------------

_CHECKED: set[Sandbox] = set()
_CHECKED_LOCK = threading.Lock()


def check_isolation(sandbox: Sandbox | None = None) -> None:
    """Raise :class:`SandboxUnavailable` (one line: what is wrong, how to fix it)
    unless ``sandbox`` (default ``Sandbox()``) can run code with the isolation it
    is configured for: the static checks of :meth:`Sandbox.unavailable`, then
    ``print(1)`` run in it once. Nothing to check for ``isolation="none"``. A
    sandbox that passed is not probed again in this process."""
    sandbox = sandbox if sandbox is not None else Sandbox()
    if sandbox.isolation == "none":
        return
    with _CHECKED_LOCK:
        if sandbox in _CHECKED:
            return
    problem = sandbox.unavailable()
    if problem is not None:
        raise SandboxUnavailable(f"the python tool's sandbox cannot run: {problem}")
    probe = replace(
        sandbox, timeout_s=max(sandbox.timeout_s, 10.0), memory_mb=max(sandbox.memory_mb, 64)
    )
    result = probe.run("print(1)")
    if result.stdout != "1\n" or result.returncode != 0:
        why = " ".join(result.notes) or " ".join(
            (result.stderr.strip() or f"exit code {result.returncode}").split()
        )
        if result.timed_out:
            why = f"the probe print(1) timed out after {probe.timeout_s:g}s"
        raise SandboxUnavailable(f"the python tool's sandbox cannot run: {why}")
    with _CHECKED_LOCK:
        _CHECKED.add(sandbox)


def check_isolation_for(config: Any) -> None:
    """:func:`check_isolation` for the sandbox a run's config gives the built-in
    ``python`` tool (``Config.environment``, or an ``EnvironmentConfig``). Returns
    None without probing when no environment uses that tool or its isolation is
    ``none`` (the tool logs its warning when built); raises
    :class:`SandboxUnavailable` otherwise, when the probe fails."""
    from asyncrl.envs.config import EnvironmentConfig, python_sandbox

    environment = config if isinstance(config, EnvironmentConfig) else config.environment
    if environment is None:
        return None
    sandbox = python_sandbox(environment)
    if sandbox is None or sandbox.isolation == "none":
        return None
    check_isolation(sandbox)
    return None


def run_python(code: str, **limits) -> SandboxResult:
    """``Sandbox(**limits).run(code)``."""
    return Sandbox(**limits).run(code)
