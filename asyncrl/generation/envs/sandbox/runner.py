"""The sandbox a caller configures and runs code in: :class:`Sandbox`.

``Sandbox(timeout_s=2, memory_mb=256).run("print(1 + 1)")`` returns a
:class:`~asyncrl.generation.envs.sandbox.result.SandboxResult`. With
``isolation="bubblewrap"`` each call runs under ``bwrap`` (:mod:`.launch`,
:mod:`.bwrap`) with the seccomp filter (:mod:`.seccomp`), as an unprivileged
host user when this process is root, the prelude as its PID 1 (:mod:`.limits`)
and, where the machine allows, in a cgroup of its own (:mod:`.cgroups`); every
process of the call is gone when :meth:`Sandbox.run` returns. When bwrap is
missing, cannot build its namespaces, the filter cannot be built or a required
cgroup cannot be made, the code is not run and the result says why: never
weaker than configured. ``isolation="none"`` runs a plain subprocess with the
rlimits, for trusted code only.

Everything runs without ``preexec_fn``, so :meth:`Sandbox.run` is safe to call
from several threads at once.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Literal

from asyncrl.generation.envs.sandbox.bwrap import SANDBOX_PATH, SANDBOX_UID, bwrap_path
from asyncrl.generation.envs.sandbox.cgroup_detect import CGROUP_ENV, CgroupSupport, cgroup_support
from asyncrl.generation.envs.sandbox.interpreter import default_python
from asyncrl.generation.envs.sandbox.launch import run_bubblewrap
from asyncrl.generation.envs.sandbox.limits import prelude_command, rlimits
from asyncrl.generation.envs.sandbox.process import collect_output, read_all
from asyncrl.generation.envs.sandbox.result import (
    INSTALL_HINT,
    SandboxResult,
    SandboxUnavailable,
    not_run,
)
from asyncrl.generation.envs.sandbox.seccomp import seccomp_program

log = logging.getLogger("asyncrl.envs.sandbox")

Isolation = Literal["bubblewrap", "none"]
ISOLATIONS: tuple[str, ...] = ("bubblewrap", "none")
CgroupPolicy = Literal["auto", "required", "off"]
CGROUP_POLICIES: tuple[str, ...] = ("auto", "required", "off")


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
    cpus: float = 1.0
    """CPUs of bandwidth for a whole call (bubblewrap, in its cgroup): its CPU time
    is at most ``cpus * timeout_s``."""
    cgroup: CgroupPolicy = "auto"
    """Whole-call limits (bubblewrap): ``auto`` puts each call in a cgroup of its own
    where this machine allows (v2, else v1; else per-process limits only, logged);
    ``required`` does not run code without one; ``off`` never uses one."""

    def __post_init__(self) -> None:
        if self.timeout_s <= 0 or self.memory_mb < 16 or self.max_output_bytes < 0:
            raise ValueError("sandbox: timeout_s > 0, memory_mb >= 16, max_output_bytes >= 0")
        if min(self.max_file_mb, self.tmp_mb, self.shm_mb) < 1:
            raise ValueError("sandbox: max_file_mb, tmp_mb and shm_mb must be >= 1")
        if self.max_processes < 2 or self.max_open_files < 16:
            raise ValueError(
                "sandbox: max_processes >= 2 (the init and the code), max_open_files >= 16"
            )
        if self.cpus <= 0:
            raise ValueError(f"sandbox: cpus must be > 0, got {self.cpus!r}")
        if self.cgroup not in CGROUP_POLICIES:
            raise ValueError(
                f"sandbox: cgroup must be one of {', '.join(CGROUP_POLICIES)}, got {self.cgroup!r}"
            )
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
        if bwrap_path(self.bwrap) is None:
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
        return rlimits(
            timeout_s=self.timeout_s,
            memory_mb=self.memory_mb,
            max_file_mb=self.max_file_mb,
            max_open_files=self.max_open_files,
            max_processes=self.max_processes if nproc else None,
        )

    def _run_bubblewrap(self, code: str) -> SandboxResult:
        problem = self.unavailable()
        if problem is not None:
            return not_run(problem)
        cgroups = cgroup_support() if self.cgroup != "off" else CgroupSupport("none")
        if cgroups.mode == "none" and (self.cgroup == "required" or os.environ.get(CGROUP_ENV)):
            return not_run(
                f"whole-call limits are required (Sandbox.cgroup={self.cgroup!r}, "
                f"{CGROUP_ENV}={os.environ.get(CGROUP_ENV, '')!r}) but {cgroups.describe()}"
            )
        uid, gid = self._sandbox_user()
        return run_bubblewrap(self, code, uid=uid, gid=gid, cgroups=cgroups)

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
                "init": False,
            }
            env = {"PATH": SANDBOX_PATH, "HOME": root, "TMPDIR": root, "LANG": "C.UTF-8"}
            start = time.monotonic()
            try:
                proc = subprocess.Popen(
                    prelude_command(self.python, self.site_packages, config),
                    cwd=root,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    pass_fds=(report_w,),
                    start_new_session=True,
                )
            except OSError as exc:
                return not_run(f"could not start {self.python}: {exc}")
            os.close(report_w)
            report_w = -1
            out, err, truncated, timed_out = collect_output(
                proc, start + self.timeout_s, self.max_output_bytes
            )
            duration = time.monotonic() - start
            layers = ("rlimits",) if read_all(report_r) == b"rlimits" else ()
            return SandboxResult(out, err, proc.returncode, timed_out, truncated, duration, layers)
        finally:
            for fd in (report_r, report_w):
                if fd >= 0:
                    os.close(fd)
            shutil.rmtree(root, ignore_errors=True)


def run_python(code: str, **limits) -> SandboxResult:
    """``Sandbox(**limits).run(code)``."""
    return Sandbox(**limits).run(code)
