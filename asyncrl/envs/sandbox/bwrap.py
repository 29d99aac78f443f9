"""The bubblewrap command line of a sandboxed call, and what bwrap reports back.

:func:`bwrap_command` builds the walls: new user, pid, network, ipc, uts and
cgroup namespaces (no nested user namespaces), a minimal read-only filesystem
(``/usr``, the links into it, ``/etc/ld.so.cache``, the interpreter's tree,
package directories hidden), a fresh ``/proc`` and ``/dev``, private ``/tmp``
and ``/dev/shm`` tmpfs, an empty environment, the seccomp filter and
``--die-with-parent``/``--new-session``. bwrap's ``--json-status-fd``
documents then say which namespaces it built (:func:`applied_layers`) or,
missing, that it never started the code (:func:`setup_failure`).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from typing import TYPE_CHECKING, Any

from asyncrl.envs.sandbox.interpreter import interpreter_layout, root_links
from asyncrl.envs.sandbox.process import read_all
from asyncrl.envs.sandbox.result import INSTALL_HINT

if TYPE_CHECKING:
    from asyncrl.envs.sandbox.runner import Sandbox

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
    sandbox: Sandbox, command: list[str], *, code_fd: int, filter_fd: int, status_fd: int
) -> list[str]:
    """bwrap's arguments to run ``command`` inside ``sandbox``'s walls; the code comes
    from the memfd ``code_fd``, the seccomp filter from ``filter_fd``, and bwrap writes
    its status documents to ``status_fd``."""
    binds, hidden = interpreter_layout(sandbox.python)
    # fmt: off
    args = [
        bwrap_path(sandbox.bwrap) or sandbox.bwrap,
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
    if not sandbox.site_packages:
        for path in hidden:
            args += ["--size", "4096", "--tmpfs", path, "--remount-ro", path]
    args += [
        "--proc", "/proc",
        "--dev", "/dev",
        "--size", str(sandbox.tmp_mb * 1024 * 1024), "--tmpfs", "/tmp",
        "--size", str(sandbox.shm_mb * 1024 * 1024), "--tmpfs", "/dev/shm",
        "--file", str(code_fd), "/tmp/main.py",
        "--chdir", "/tmp",
        "--clearenv",
        "--setenv", "PATH", SANDBOX_PATH,
        "--setenv", "HOME", "/tmp",
        "--setenv", "TMPDIR", "/tmp",
        "--setenv", "LANG", "C.UTF-8",
        "--seccomp", str(filter_fd),
        "--json-status-fd", str(status_fd),
        "--",
        *command,
    ]
    # fmt: on
    return args


def read_status(fd: int) -> dict[str, Any]:
    """bwrap's ``--json-status-fd`` documents, merged."""
    status: dict[str, Any] = {}
    decoder = json.JSONDecoder()
    text = read_all(fd).decode("utf-8", "replace")
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


def applied_layers(status: dict[str, Any], *, separate_user: bool) -> tuple[str, ...]:
    """``SandboxResult.layers`` of a call that ran: the namespaces bwrap reported."""
    layers = ["bubblewrap"]
    if separate_user:
        layers.append("separate-user")
    layers.append("user")
    for key, name in NAMESPACE_KEYS:
        if key in status:
            layers.append(name)
    layers += ["seccomp", "rlimits"]
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
