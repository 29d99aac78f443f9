"""The bubblewrap command line of a sandboxed call, and what bwrap reports back.

:func:`bwrap_command` builds the walls: new user, pid, network, ipc, uts and
cgroup namespaces (no nested user namespaces), a minimal filesystem (``/usr``,
the links into it, ``/etc/ld.so.cache``, the interpreter's tree, package
directories hidden), a fresh ``/proc`` and ``/dev``, private ``/tmp`` and
``/dev/shm`` tmpfs, an empty environment, the seccomp filter and
``--die-with-parent``/``--new-session``. Every writable mount has a size: the
root tmpfs bwrap builds (where ``/etc`` and the mount points live) and the
``/dev`` tmpfs are remounted read-only once set up, so only ``/tmp``
(``tmp_mb``) and ``/dev/shm`` (``shm_mb``) take writes. The interpreter runs
as PID 1 (``--as-pid-1``: the prelude is the init, see :mod:`.limits`), and
bwrap holds it on ``--block-fd`` until the caller has put it in the call's
cgroup. bwrap's ``--json-status-fd`` documents say which namespaces it built
and the host pid of the sandbox's PID 1 (:class:`StatusReader`), or, missing,
that it never started the code (:func:`setup_failure`).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from typing import TYPE_CHECKING, Any

from asyncrl.generation.envs.sandbox.interpreter import interpreter_layout, root_links
from asyncrl.generation.envs.sandbox.process import read_all, readable
from asyncrl.generation.envs.sandbox.result import INSTALL_HINT

if TYPE_CHECKING:
    from asyncrl.generation.envs.sandbox.runner import Sandbox

log = logging.getLogger("asyncrl.envs.sandbox")

SANDBOX_UID = 65534
"""The host user ``bwrap`` runs as when this process is root ("nobody"), and the
uid/gid the code sees inside the sandbox."""

SANDBOX_PATH = "/usr/local/bin:/usr/bin:/bin"
"""``PATH`` inside the sandbox; bwrap is also looked for there."""

NAMESPACE_KEYS: tuple[tuple[str, str], ...] = (
    ("pid-namespace", "pid"),
    ("net-namespace", "net"),
    ("mnt-namespace", "mount"),
    ("ipc-namespace", "ipc"),
    ("uts-namespace", "uts"),
    ("cgroup-namespace", "cgroup"),
)
"""bwrap's ``--json-status-fd`` keys and the names they get in ``layers``."""


def bwrap_path(name: str) -> str | None:
    """The bubblewrap executable ``name`` (a path, or a name on ``PATH``), None if missing."""
    if os.sep in name:
        return name if os.access(name, os.X_OK) else None
    return shutil.which(name, path=os.environ.get("PATH", "") + os.pathsep + SANDBOX_PATH)


def bwrap_command(
    sandbox: Sandbox,
    command: list[str],
    *,
    code_fd: int,
    filter_fd: int,
    status_fd: int,
    block_fd: int,
) -> list[str]:
    """bwrap's arguments to run ``command`` as PID 1 inside ``sandbox``'s walls; the
    code comes from the memfd ``code_fd``, the seccomp filter from ``filter_fd``,
    bwrap writes its status documents to ``status_fd`` and holds the command until
    ``block_fd`` can be read."""
    binds, hidden = interpreter_layout(sandbox.python)
    # fmt: off
    args = [
        bwrap_path(sandbox.bwrap) or sandbox.bwrap,
        "--unshare-all", "--unshare-user", "--disable-userns",
        "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID),
        "--hostname", "sandbox",
        "--die-with-parent", "--new-session", "--as-pid-1",
        "--ro-bind", "/usr", "/usr",
        *root_links(),
        "--ro-bind-try", "/etc/ld.so.cache", "/etc/ld.so.cache",
    ]
    for path in binds:
        args += ["--ro-bind", path, path]
    if not sandbox.site_packages:
        for path in hidden:
            args += ["--size", "4096", "--tmpfs", path, "--remount-ro", path]
    args += [
        "--proc", "/proc",
        "--dev", "/dev",
        "--size", str(sandbox.tmp_mb * 1024 * 1024), "--tmpfs", "/tmp",
        "--size", str(sandbox.shm_mb * 1024 * 1024), "--tmpfs", "/dev/shm",
        "--remount-ro", "/dev",
        "--file", str(code_fd), "/tmp/main.py",
        "--remount-ro", "/",
        "--chdir", "/tmp",
        "--clearenv",
        "--setenv", "PATH", SANDBOX_PATH,
        "--setenv", "HOME", "/tmp",
        "--setenv", "TMPDIR", "/tmp",
        "--setenv", "LANG", "C.UTF-8",
        "--seccomp", str(filter_fd),
        "--json-status-fd", str(status_fd),
        "--block-fd", str(block_fd),
        "--",
        *command,
    ]
    # fmt: on
    return args


class StatusReader:
    """bwrap's ``--json-status-fd`` documents as they come: the host pid of the
    sandbox's PID 1 first (:meth:`child_pid`), then the rest at the end
    (:meth:`finish`). Only bwrap writes there: its child closes the pipe before
    the sandbox runs anything."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.text = ""
        self.status: dict[str, Any] = {}

    def _parse(self) -> None:
        decoder = json.JSONDecoder()
        while True:
            text = self.text.lstrip()
            try:
                document, end = decoder.raw_decode(text)
            except ValueError:
                self.text = text
                return
            self.text = text[end:]
            if isinstance(document, dict):
                self.status.update(document)

    def child_pid(self, deadline: float) -> int | None:
        """The host pid bwrap reports for the sandbox's PID 1 (it waits on
        ``--block-fd`` then); None when bwrap exits first or the deadline passes."""
        while "child-pid" not in self.status:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not readable(self.fd, remaining):
                return None
            chunk = os.read(self.fd, 65536)
            if not chunk:
                return None
            self.text += chunk.decode("utf-8", "replace")
            self._parse()
        pid = self.status["child-pid"]
        return pid if isinstance(pid, int) and pid > 0 else None

    def finish(self) -> dict[str, Any]:
        """Every document bwrap wrote, merged (what is in the pipe now)."""
        self.text += read_all(self.fd).decode("utf-8", "replace")
        self._parse()
        return self.status


def read_status(fd: int) -> dict[str, Any]:
    """bwrap's ``--json-status-fd`` documents, merged."""
    return StatusReader(fd).finish()


def started(status: dict[str, Any]) -> bool:
    """Whether bwrap built its namespaces and cloned the child that runs the code."""
    return "child-pid" in status


def setup_failure(status: dict[str, Any], stderr: str, returncode: int | None) -> str:
    """Why the code did not start (bwrap's last error line, or the exit status);
    bwrap's own failures are logged once per process."""
    reason = stderr.strip().splitlines()[-1] if stderr.strip() else f"exit {returncode}"
    reason = reason.rstrip(". ")
    if not started(status):  # no namespaces: bwrap never cloned its child
        _log_setup_failure(reason)
        return f"bubblewrap could not set up the sandbox: {reason}; {INSTALL_HINT}"
    if reason.startswith("bwrap:"):  # a mount or exec step inside failed
        _log_setup_failure(reason)
        return f"bubblewrap could not set up the sandbox: {reason}"
    return f"the sandbox's interpreter did not start: {reason}"


def applied_layers(
    status: dict[str, Any], *, separate_user: bool, call_cgroup: str
) -> tuple[str, ...]:
    """``SandboxResult.layers`` of a call that ran: the namespaces bwrap reported,
    and the call's cgroup (``cgroup-v2``/``cgroup-v1``) when it had one."""
    layers = ["bubblewrap"]
    if separate_user:
        layers.append("separate-user")
    layers.append("user")
    for key, name in NAMESPACE_KEYS:
        if key in status:
            layers.append(name)
    layers += ["seccomp", "rlimits", "init"]
    if call_cgroup != "none":
        layers.append(call_cgroup)
    return tuple(layers)


def child_returncode(returncode: int | None) -> int | None:
    """The code's exit status: bwrap's reaper reports a child killed by signal N as
    128 + N, which becomes -N as ``subprocess`` reports it."""
    if returncode is not None and 128 < returncode <= 128 + 64:
        return 128 - returncode
    return returncode


_SETUP_FAILURE_LOGGED = False


def _log_setup_failure(reason: str) -> None:
    global _SETUP_FAILURE_LOGGED
    if not _SETUP_FAILURE_LOGGED:
        _SETUP_FAILURE_LOGGED = True
        log.error("python sandbox: bubblewrap could not set up the sandbox: %s", reason)
