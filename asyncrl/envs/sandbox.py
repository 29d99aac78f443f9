"""Run model-written Python in a subprocess with time, memory and network limits.

``Sandbox(timeout_s=2, memory_mb=256).run("print(1 + 1)")`` returns a
:class:`SandboxResult` with the captured output. Each run gets:

- a fresh interpreter, ``python -I -S -B -u -X utf8`` (isolated mode: no
  ``PYTHON*`` variables, no user or site packages unless ``site_packages``);
- a scratch temporary directory as its working directory and ``HOME``, removed
  afterwards, and a minimal environment (``PATH``, ``HOME``, ``TMPDIR``, ``LANG``);
- a wall-clock limit (the whole process group is killed) and ``RLIMIT_CPU``;
- ``RLIMIT_AS`` as the memory limit, ``RLIMIT_FSIZE`` on files it writes, no
  core dumps;
- no network: a new, empty network namespace (``unshare(CLONE_NEWNET)``, or
  ``CLONE_NEWUSER | CLONE_NEWNET`` when not root) in which even loopback is
  down, and/or an audit hook that refuses sockets, process spawning and ctypes;
- when it starts with capabilities (root), all of them dropped, bounding set
  included, with ``no_new_privs``: it cannot raise its limits or leave the
  namespace;
- stdout and stderr each truncated to ``max_output_bytes`` (the rest is read
  and discarded, so a flood of output neither blocks nor fills memory).

Everything is set up by a prelude that runs inside the child before the code
(no ``preexec_fn``, so it is safe to call from a threaded process). The prelude
reports the layers it applied on a private pipe; they come back in
``SandboxResult.layers``. If no network layer can be applied the code is not
run. The prelude is a boundary against accidents and ordinary code, not
against a determined attacker: there is no filesystem isolation beyond the
working directory, and the audit hook alone can be subverted from Python.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Literal

NetworkMode = Literal["auto", "namespace", "audit"]

CLONE_NEWNET = 0x40000000
CLONE_NEWUSER = 0x10000000
NAMESPACE_ATTEMPTS: list[tuple[str, int]] = [
    ("netns", CLONE_NEWNET),  # needs CAP_SYS_ADMIN (root)
    ("userns+netns", CLONE_NEWUSER | CLONE_NEWNET),  # unprivileged, where user namespaces are on
]
"""``unshare`` calls tried in order for the network layer; the first that works is used."""

# Runs inside the child as ``python -c PRELUDE CONFIG_JSON``. Keep it stdlib
# only and free of names that leak into the user's ``__main__``.
PRELUDE = r"""
def _asyncrl_sandbox():
    import json, os, resource, sys, types
    cfg = json.loads(sys.argv[1])
    layers, notes = [], []

    def libc():
        import ctypes
        lib = ctypes.CDLL(None, use_errno=True)
        return ctypes, lib

    netns = False
    if cfg["network"] in ("auto", "namespace"):
        try:
            ctypes, lib = libc()
            errors = []
            for name, flags in cfg["namespaces"]:
                if lib.unshare(flags) == 0:
                    netns = True
                    layers.append(name)
                    break
                errors.append("%s: errno %d" % (name, ctypes.get_errno()))
            else:
                notes.append("unshare failed: " + ", ".join(errors))
        except Exception as exc:
            notes.append("unshare: %r" % (exc,))

    try:
        ctypes, lib = libc()
        PR_SET_NO_NEW_PRIVS, PR_CAPBSET_DROP, PR_CAP_AMBIENT = 38, 24, 47
        lib.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
        with open("/proc/self/status") as f:
            status = dict(line.split(":", 1) for line in f if ":" in line)
        if int(status.get("CapEff", "0").strip(), 16) or int(
            status.get("CapBnd", "0").strip(), 16
        ):
            lib.prctl(PR_CAP_AMBIENT, 4, 0, 0, 0)  # PR_CAP_AMBIENT_CLEAR_ALL
            for cap in range(64):  # past the last capability this fails harmlessly
                lib.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)

            class Header(ctypes.Structure):
                _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

            class Data(ctypes.Structure):
                _fields_ = [(n, ctypes.c_uint32) for n in ("eff", "perm", "inh")]

            data = (Data * 2)()
            if lib.capset(ctypes.byref(Header(0x20080522, 0)), data) == 0:
                layers.append("no-caps")
            else:
                notes.append("capset: errno %d" % ctypes.get_errno())
    except Exception as exc:
        notes.append("caps: %r" % (exc,))

    mem = cfg["memory_bytes"]
    resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
    resource.setrlimit(resource.RLIMIT_CPU, (cfg["cpu_s"], cfg["cpu_s"] + 1))
    resource.setrlimit(resource.RLIMIT_FSIZE, (cfg["file_bytes"], cfg["file_bytes"]))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    layers.append("rlimits")

    if cfg["network"] in ("auto", "audit") or not netns:

        def hook(event, args):
            # Sockets, and what could get around an in-process hook: new
            # processes and foreign function calls.
            if event.startswith((
                "socket.", "subprocess.Popen", "os.system", "os.exec", "os.posix_spawn",
                "os.spawn", "os.fork", "os.forkpty", "pty.spawn", "ctypes.dlopen",
                "ctypes.dlsym", "ctypes.call_function", "_posixsubprocess",
            )):
                raise PermissionError("sandbox: %s is not allowed" % event)

        sys.addaudithook(hook)
        layers.append("audit")

    report = os.fdopen(cfg["report_fd"], "w")
    report.write(json.dumps({"layers": layers, "notes": notes}))
    report.close()

    with open("main.py", encoding="utf-8") as f:
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
    """Exit status; negative: killed by that signal; None: never started."""
    timed_out: bool
    truncated: bool
    """stdout or stderr went over ``max_output_bytes`` and was cut."""
    duration_s: float
    layers: tuple[str, ...] = ()
    """What the prelude applied: ``netns`` (or ``userns+netns``), ``no-caps``,
    ``rlimits``, ``audit``."""
    notes: tuple[str, ...] = field(default=())
    """Why a layer could not be applied, if one could not."""

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out


@dataclass(frozen=True)
class Sandbox:
    """Limits for one run; :meth:`run` is safe to call from several threads."""

    timeout_s: float = 5.0
    memory_mb: int = 512
    max_output_bytes: int = 16_384
    max_file_mb: int = 16
    network: NetworkMode = "auto"
    """``auto``: a network namespace and the audit hook; ``namespace``: the
    namespace alone (the audit hook if no namespace can be made); ``audit``:
    the audit hook alone."""
    site_packages: bool = False
    """Let the code import installed packages (drops ``-S``)."""
    python: str = sys.executable

    def __post_init__(self) -> None:
        if self.timeout_s <= 0 or self.memory_mb < 16 or self.max_output_bytes < 0:
            raise ValueError("sandbox: timeout_s > 0, memory_mb >= 16, max_output_bytes >= 0")
        if self.network not in ("auto", "namespace", "audit"):
            raise ValueError(f"sandbox: network must be auto, namespace or audit: {self.network!r}")

    def run(self, code: str) -> SandboxResult:
        root = tempfile.mkdtemp(prefix="asyncrl-sandbox-")
        report_r, report_w = os.pipe()
        try:
            with open(os.path.join(root, "main.py"), "w", encoding="utf-8") as f:
                f.write(code)
            config = {
                "network": self.network,
                "namespaces": NAMESPACE_ATTEMPTS,
                "memory_bytes": self.memory_mb * 1024 * 1024,
                "cpu_s": math.ceil(self.timeout_s) + 1,
                "file_bytes": self.max_file_mb * 1024 * 1024,
                "report_fd": report_w,
            }
            flags = ["-I", "-B", "-u", "-X", "utf8"] + ([] if self.site_packages else ["-S"])
            env = {"PATH": "/usr/bin:/bin", "HOME": root, "TMPDIR": root, "LANG": "C.UTF-8"}
            start = time.monotonic()
            try:
                proc = subprocess.Popen(
                    [self.python, *flags, "-c", PRELUDE, json.dumps(config)],
                    cwd=root,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    pass_fds=(report_w,),
                    start_new_session=True,
                )
            except OSError as exc:
                return SandboxResult("", f"sandbox: could not start: {exc}", None, False, False, 0)
            os.close(report_w)
            report_w = -1
            out, err, truncated, timed_out = self._collect(proc, start + self.timeout_s)
            duration = time.monotonic() - start
            report = _read_report(report_r)
            return SandboxResult(
                out,
                err,
                proc.returncode,
                timed_out,
                truncated,
                duration,
                tuple(report.get("layers", ())),
                tuple(report.get("notes", ())),
            )
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


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def _read_report(fd: int) -> dict:
    data = b""
    os.set_blocking(fd, False)
    try:
        while chunk := os.read(fd, 65536):
            data += chunk
    except BlockingIOError:
        pass
    try:
        return json.loads(data) if data else {}
    except ValueError:
        return {}


def run_python(code: str, **limits) -> SandboxResult:
    """``Sandbox(**limits).run(code)``."""
    return Sandbox(**limits).run(code)
