"""Run code the user wrote in a child that cannot hang, stop or outlive its caller.

``asyncrl validate`` and ``asyncrl launch`` import the user's reward and
environment modules to check them. Imported in the command's own process, a
module that hangs at import hung the command for ever, a 3 GiB allocation ran
unlimited, ``os.kill(os.getppid(), SIGSTOP)`` froze it, and a daemonised
grandchild outlived it. :func:`run_contained` runs such work here instead::

    caller ──(request: msgpack, a temporary file on stdin)──▶ keeper ──fork──▶ child
      ▲                                                       (subreaper)     (RLIMIT_AS, own
      └──────────────────────── JSON lines on a pipe ◀──────────────────────── session, PID ns)

- the *keeper* (``python -c KEEPER_COMMAND``, a new session) is a subreaper,
  moves its child into a PID namespace where the kernel allows it
  (:mod:`asyncrl.generation.process_tree`), forks the child and waits for it; whatever the
  child leaves behind is killed before the keeper exits;
- the *child* calls ``entry(request, send)`` (trusted asyncrl code that then
  imports the user's) under ``RLIMIT_AS = memory_limit_mb``, in a session of its
  own, and dies with the keeper. Its parent is the keeper, never the caller: a
  SIGSTOP to "its parent" stops the keeper, not the command;
- the caller reads the child's messages, each due within ``timeout_s`` of the one
  before, and in every case (done, hung, crashed, stopped, garbage) ends with
  :func:`~asyncrl.generation.process_tree.kill_tree` on the keeper and the child.

A failure is a :class:`ContainedError` whose message is one line saying what
happened; no process of the child's survives it.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib
import json
import os
import resource
import select
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import msgspec
import psutil

from asyncrl.generation.process_tree import (
    become_subreaper,
    die_with_parent,
    enter_pid_namespace,
    kill_tree,
)

STARTUP_S = 60.0
"""How long the child may take to start Python and import asyncrl before it says it is
ready; the user's code runs only after that, under ``timeout_s``."""
MAX_MESSAGE_BYTES = 1 << 16
"""The longest message line a child may send; longer is garbage on the pipe."""
_CHANNEL_FD = 512
"""Where the child moves its pipe: out of reach of code writing to low descriptors."""
_READ_BYTES = 1 << 16
KEEPER_COMMAND = "from asyncrl.generation.contained import keeper_main; keeper_main()"


class ContainedError(RuntimeError):
    """The child hung, died, or broke the protocol. ``reason`` says which in a few words;
    ``timed_out`` when it hung; ``ended``: how it died (``exited with code 3``, ``was killed
    by SIGSEGV``) when it did; ``messages`` holds what it sent before."""

    def __init__(
        self,
        reason: str,
        messages: list[Any],
        *,
        timed_out: bool = False,
        ended: str | None = None,
    ):
        self.reason = reason
        self.messages = messages
        self.timed_out = timed_out
        self.ended = ended
        super().__init__(reason)


def run_contained(
    entry: str,
    request: Any,
    *,
    timeout_s: float | Callable[[Any], float],
    memory_limit_mb: int,
) -> list[Any]:
    """Run ``entry`` (``module:function``, called as ``function(request, send)``) in a
    contained child; the messages it sent. Raises :class:`ContainedError` when it does not
    finish, each message due within ``timeout_s`` of the one before (a function: of that
    message, None before the first)."""
    payload = msgspec.msgpack.encode(request, enc_hook=_plain)
    read_fd, write_fd = os.pipe()
    try:
        with tempfile.TemporaryFile() as stdin:
            stdin.write(payload)
            stdin.seek(0)
            keeper = subprocess.Popen(
                [sys.executable, "-c", KEEPER_COMMAND, str(write_fd), entry, str(memory_limit_mb)],
                pass_fds=(write_fd,),
                stdin=stdin,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
                env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)},
            )
    finally:
        os.close(write_fd)
    reader = _Reader(read_fd, keeper)
    try:
        return reader.messages_until_done(timeout_s)
    finally:
        os.close(read_fd)
        if reader.child is not None:
            kill_tree(reader.child)
        if keeper.poll() is None:  # not waited for yet: its pid is still its own
            kill_tree(keeper.pid)
        keeper.wait()


class _Reader:
    """The caller's side of the pipe: whole lines, each a JSON message, on a deadline."""

    def __init__(self, fd: int, keeper: subprocess.Popen):
        self.fd = fd
        self.keeper = keeper
        self.inbox = bytearray()
        self.messages: list[Any] = []
        self.child: psutil.Process | None = None
        """The child, from its first message (sent before any user code runs)."""

    def messages_until_done(self, timeout_s: float | Callable[[Any], float]) -> list[Any]:
        ready = self._next(STARTUP_S, "did not start")
        match ready:
            case ["ready", int() as pid] if pid > 0:
                with contextlib.suppress(psutil.Error):
                    self.child = psutil.Process(pid)
            case _:
                raise ContainedError("did not start as expected", self.messages)
        due = timeout_s if callable(timeout_s) else lambda _previous: timeout_s
        previous = None
        while (message := self._next(due(previous), "did not finish")) != ["done"]:
            self.messages.append(message)
            previous = message
        return self.messages

    def _next(self, wait_s: float, late: str) -> Any:
        """The next message, due within ``wait_s``."""
        deadline = time.monotonic() + wait_s
        while (end := self.inbox.find(b"\n")) < 0:
            if len(self.inbox) > MAX_MESSAGE_BYTES:
                raise self._error(f"sent a message over {MAX_MESSAGE_BYTES} bytes")
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self._readable(remaining):
                raise ContainedError(f"{late} within {wait_s:g} s", self.messages, timed_out=True)
            chunk = os.read(self.fd, _READ_BYTES)
            if not chunk:
                ended = self._ended()
                raise ContainedError(f"its process {ended}", self.messages, ended=ended)
            self.inbox += chunk
        line = bytes(self.inbox[:end])
        del self.inbox[: end + 1]
        try:
            return json.loads(line)
        except ValueError:
            raise self._error("sent something that is not a message") from None

    def _readable(self, wait_s: float) -> bool:
        """Whether the pipe has something (or its end) within ``wait_s``; poll, not select,
        which fails on a descriptor above 1023 in a process holding many."""
        poller = select.poll()
        poller.register(self.fd, select.POLLIN)
        return bool(poller.poll(wait_s * 1000))

    def _ended(self) -> str:
        try:
            code = self.keeper.wait(timeout=5)
        except subprocess.TimeoutExpired:
            return "closed its pipe without finishing"
        return exit_description(code)

    def _error(self, reason: str) -> ContainedError:
        return ContainedError(reason, self.messages)


def exit_description(keeper_code: int) -> str:
    """How the child ended, from its keeper's exit code (128 + a signal's number when the
    child was killed by one; negative when the keeper itself was killed)."""
    if keeper_code < 0:
        return f"was killed by {_signal_name(-keeper_code)}"
    if keeper_code > 128:
        return f"was killed by {_signal_name(keeper_code - 128)}"
    return f"exited with code {keeper_code}"


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _plain(value: Any) -> Any:
    """numpy values (parquet rows' extra_info) as plain Python data."""
    tolist = getattr(value, "tolist", None)
    if callable(tolist):
        return tolist()
    raise TypeError(f"cannot send a {type(value).__name__} to a checking process")


# --------------------------------------------------------------------------
# the keeper and the child (run in ``python -c KEEPER_COMMAND fd entry memory_limit_mb``)


def keeper_main() -> None:
    """Fork the child, wait for it, kill what it left behind; exit with its status."""
    fd, entry, memory_limit_mb = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    die_with_parent()
    request = sys.stdin.buffer.read()
    become_subreaper()
    isolated = enter_pid_namespace()
    child = os.fork()
    if child == 0:
        if isolated:  # PID 1 of the namespace: a plain init, so the user's code is not one
            die_with_parent()
            worker = os.fork()
            if worker == 0:
                _child_main(fd, entry, memory_limit_mb, request)
            os._exit(_exit_code(_wait(worker)))  # and the kernel kills the rest of the namespace
        _child_main(fd, entry, memory_limit_mb, request)
    os.close(fd)
    status = _wait(child)
    kill_tree(os.getpid(), include_root=False)
    os._exit(_exit_code(status))


def _exit_code(status: int) -> int:
    """A wait status as an exit code: 128 + the signal's number for a killed process."""
    if os.WIFSIGNALED(status):
        return 128 + os.WTERMSIG(status)
    return os.WEXITSTATUS(status) if os.WIFEXITED(status) else 1


def _wait(child: int) -> int:
    """The child's wait status, reaping orphans handed to this subreaper meanwhile."""
    while True:
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:
            return 0
        except InterruptedError:
            continue
        if pid == child:
            return status


def _child_main(fd: int, entry: str, memory_limit_mb: int, request: bytes) -> None:
    code = 0
    try:
        os.setsid()  # its own group: kill(0, ...) from the user's code stays in it
        die_with_parent()
        channel = _private_channel(fd)
        null = os.open(os.devnull, os.O_RDWR)
        for target in (0, 1, 2):
            os.dup2(null, target)
        module, _, name = entry.partition(":")
        function = getattr(importlib.import_module(module), name)
        decoded = msgspec.msgpack.decode(request)

        def send(message: Any) -> None:
            os.write(channel, json.dumps(message).encode() + b"\n")

        send(["ready", _host_pid()])
        _limit_memory(memory_limit_mb)
        function(decoded, send)
        send(["done"])
    except BaseException:
        code = 70
    finally:
        os._exit(code)


def _host_pid() -> int:
    """This process's pid as the caller sees it (``/proc`` is the caller's, even inside a
    PID namespace), so the caller can kill it whatever happens to the keeper."""
    try:
        return int(os.readlink("/proc/self"))
    except (OSError, ValueError):
        return os.getpid()


def _private_channel(fd: int) -> int:
    """The pipe moved to a high, close-on-exec descriptor, the one it came on closed."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    lowest = _CHANNEL_FD if soft == resource.RLIM_INFINITY else min(_CHANNEL_FD, soft - 1)
    if lowest <= fd:
        return fd
    moved = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, lowest)
    os.close(fd)
    return moved


def _limit_memory(megabytes: int) -> None:
    """Cap the address space, so that an allocation past it is a MemoryError, not the host's
    memory."""
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = megabytes << 20
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
