"""The scorer's handle on one reward worker process: how it starts, what it is doing, what
it printed, and how it stops (with every process its function started: the worker is a
subreaper, so they stay below it).

A worker gets its channel as an inherited socket (``socket.socketpair``), stdin from
/dev/null and stdout and stderr on a pipe of its own, read here without blocking, so
a function that prints a flood never stalls its worker and never reaches the
generator's terminal.
"""

from __future__ import annotations

import collections
import contextlib
import math
import os
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass, field

from asyncrl.generation.process_tree import kill_tree
from asyncrl.generation.rewards.channel import READ_BYTES, encode_jobs
from asyncrl.generation.rewards.worker import WORKER_COMMAND

OUTPUT_KEEP_BYTES = 2048
"""Of what a worker prints, this much is kept for the log each time it goes idle."""


@dataclass
class WorkerProcess:
    """One worker: its process, the scorer's end of its channel, the jobs sent to it (the
    first is the one being scored) and the start of what it printed."""

    process: subprocess.Popen
    channel: socket.socket
    ready: bool = False
    jobs: collections.deque = field(default_factory=collections.deque)
    deadline: float = math.inf
    inbox: bytearray = field(default_factory=bytearray)
    """Bytes read from the channel that do not make a whole frame yet."""
    output_fd: int | None = None
    """The read end of the worker's stdout and stderr; None once it is closed."""
    output: bytearray = field(default_factory=bytearray)
    output_bytes: int = 0

    @classmethod
    def start(cls, function: str | None, memory_limit_mb: int) -> WorkerProcess:
        """A new worker loading ``function`` (None: the built-ins by data source)."""
        ours, theirs = socket.socketpair()
        with theirs:
            fd = theirs.fileno()
            command = [sys.executable, "-c", WORKER_COMMAND, str(fd), function or ""]
            process = subprocess.Popen(
                [*command, str(os.getpid()), str(memory_limit_mb)],
                pass_fds=(fd,),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                env={
                    **os.environ,
                    "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
                    "PYTHONUNBUFFERED": "1",  # output reaches the pipe as it is printed
                },
            )
        output_fd = process.stdout.fileno()
        os.set_blocking(output_fd, False)
        return cls(process, ours, output_fd=output_fd)

    def read_output(self) -> bool:
        """Read some of the worker's output, keeping the first few KiB; False when there was
        nothing to read (the pipe is empty, or closed, and then closed here too)."""
        try:
            chunk = os.read(self.output_fd, READ_BYTES)
        except BlockingIOError:
            return False
        except OSError:
            chunk = b""
        if not chunk:
            self.close_output()
            return False
        self.output_bytes += len(chunk)
        room = OUTPUT_KEEP_BYTES - len(self.output)
        if room > 0:
            self.output += chunk[:room]
        return True

    def stop(self) -> None:
        """End the worker and every process its function started: an idle one is asked to
        leave, one scoring (maybe hung) or starting is killed; then read what it printed
        last (a traceback, say, is worth a look)."""
        process = self.process
        if process.poll() is None and not self.jobs and self.ready:
            kill_tree(process.pid, include_root=False)  # what its function left running
            with contextlib.suppress(OSError):
                self.channel.sendall(encode_jobs(None))  # idle: ask it to leave
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=1)
        if process.poll() is None:
            kill_tree(process.pid)  # no need to be polite
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=5)
        self.channel.close()
        for _ in range(8):
            if self.output_fd is None or not self.read_output():
                break

    def close_output(self) -> None:
        self.output_fd = None
        self.process.stdout.close()


def exit_description(code: int | None) -> str:
    """How a worker ended, for the ``error:crashed`` detail: the signal's name if any."""
    if code is not None and code < 0:
        with contextlib.suppress(ValueError):
            return f"the reward worker was killed by {signal.Signals(-code).name}"
    return f"the reward worker exited with code {code}"
