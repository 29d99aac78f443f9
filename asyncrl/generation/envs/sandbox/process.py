"""The sandboxed process from the outside: feed it code, read its output, end it.

:func:`collect_output` reads stdout and stderr until they close or the deadline
passes, keeping at most ``max_output_bytes`` of each (the rest is read and
discarded, so a flood of output neither blocks nor fills memory), then stops
the call: by default it kills the process group; a bubblewrap call passes its
:meth:`~asyncrl.generation.envs.sandbox.launch.CallTree.stop`, which ends every process
of the call.
"""

from __future__ import annotations

import contextlib
import functools
import os
import select
import selectors
import signal
import subprocess
import time
from collections.abc import Callable


def memfd(name: str, data: bytes) -> int:
    """An anonymous in-memory file holding ``data``, rewound: bwrap copies it in."""
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


def kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def readable(fd: int, timeout_s: float) -> bool:
    """Whether ``fd`` becomes readable within ``timeout_s`` (poll: any fd number,
    where ``select`` stops at 1024)."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(max(timeout_s, 0) * 1000))


def read_all(fd: int) -> bytes:
    """What is in a pipe now, without waiting for writers that may linger."""
    data = b""
    os.set_blocking(fd, False)
    with contextlib.suppress(BlockingIOError):
        while chunk := os.read(fd, 65536):
            data += chunk
    return data


def collect_output(
    proc: subprocess.Popen,
    deadline: float,
    max_output_bytes: int,
    stop: Callable[[], None] | None = None,
) -> tuple[str, str, bool, bool]:
    """``(stdout, stderr, truncated, timed_out)``: both pipes read up to the output
    limit until EOF or the deadline; ``stop`` (default: kill the process group)
    is called in every case, before ``proc`` is reaped."""
    stop_call = stop if stop is not None else functools.partial(kill_group, proc.pid)
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
                room = max_output_bytes - len(buffer)
                if len(chunk) > room:
                    truncated = True
                buffer += chunk[: max(room, 0)]
            if proc.poll() is not None:
                # Exited: stop anything it left behind, then drain what is left.
                stop_call()
        if not timed_out:
            try:  # it may have closed its output and still be running
                proc.wait(timeout=max(deadline - time.monotonic(), 0.001))
            except subprocess.TimeoutExpired:
                timed_out = True
    finally:
        selector.close()
        stop_call()
        proc.wait()
        proc.stdout.close()
        proc.stderr.close()
    return (
        kept["stdout"].decode("utf-8", "replace"),
        kept["stderr"].decode("utf-8", "replace"),
        truncated,
        timed_out,
    )
