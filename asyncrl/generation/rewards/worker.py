"""A reward worker process: load the function, then score what the scorer sends.

Started by :class:`~asyncrl.generation.rewards.scorer.RewardScorer` as
``python -c WORKER_COMMAND fd spec parent_pid memory_limit_mb``, with the channel's
socket on ``fd`` and its stdout and stderr on a pipe the scorer reads."""

from __future__ import annotations

import fcntl
import os
import resource
import signal
import socket
import threading
import time

from asyncrl.generation.process_tree import become_subreaper
from asyncrl.generation.rewards.channel import FRAME, decode_jobs, read_exactly, send_reply
from asyncrl.generation.rewards.loading import load_reward_function
from asyncrl.generation.rewards.outcome import (
    DETAIL_CHARS,
    ERROR_BAD_RETURN,
    ERROR_EXCEPTION,
    ERROR_MEMORY,
    ERROR_NO_FUNCTION,
    clip,
    describe,
    short_repr,
    to_reward,
)
from asyncrl.generation.rewards.sources import RewardFunction, builtin_reward_function

_CHANNEL_FD = 512
"""Where a worker moves its channel: far from the low numbers a function might write to."""


def score_one(function: RewardFunction | None, job: tuple) -> tuple[float, str | None, str]:
    """Run one job in the worker: ``(reward, error tag or None, detail)``."""
    data_source, solution_str, ground_truth, extra_info, *named = job
    if named and named[0]:  # the job's own function (an environment's); imported once
        try:
            function = load_reward_function(named[0])
        except Exception as error:
            return 0.0, ERROR_EXCEPTION, clip(str(error))
    if function is None:
        function = builtin_reward_function(data_source)
        if function is None:
            return 0.0, ERROR_NO_FUNCTION, f"no reward function for data_source {data_source!r}"
    try:
        value = function(data_source, solution_str, ground_truth, extra_info)
    except MemoryError as error:
        return 0.0, ERROR_MEMORY, describe(error)
    except BaseException as error:  # SystemExit too: a reward function must not end the worker
        return 0.0, ERROR_EXCEPTION, describe(error)
    try:
        return to_reward(value), None, ""
    except Exception as error:
        return 0.0, ERROR_BAD_RETURN, f"returned {short_repr(value)}: {describe(error)}"


def read_job_batch(channel: socket.socket) -> list | None:
    """The next batch from the scorer; None when it says stop or the channel closes."""
    header = read_exactly(channel, FRAME.size)
    payload = None if header is None else read_exactly(channel, FRAME.unpack(header)[0])
    return None if payload is None else decode_jobs(payload)


def _private_channel(fd: int) -> socket.socket:
    """The channel moved to a high, close-on-exec descriptor, the one it came on closed.

    Its number is then none that a function writing to "its" descriptors (3, 4, ...)
    would hit by accident, and no program the function starts inherits it.
    """
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    lowest = _CHANNEL_FD if soft == resource.RLIM_INFINITY else min(_CHANNEL_FD, soft - 1)
    if lowest <= fd:
        return socket.socket(fileno=fd)
    moved = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, lowest)
    os.close(fd)
    return socket.socket(fileno=moved)


def _limit_memory(megabytes: int) -> None:
    """Cap the worker's address space, so that a runaway function gets a MemoryError (or
    is killed) instead of taking the host's memory."""
    if megabytes <= 0:
        return
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = megabytes << 20
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


def _watch_parent(parent_pid: int) -> None:
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:
            os._exit(0)


WORKER_COMMAND = (
    "import sys; from asyncrl.generation.rewards.worker import worker_main; "
    "worker_main(int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))"
)


def worker_main(fd: int, spec: str, parent_pid: int, memory_limit_mb: int = 0) -> None:
    """A scoring process: load the function, then score batches, one reply per sample.

    stdin is /dev/null and stdout/stderr a pipe the scorer reads (bounded), so the
    only way onto the channel is a deliberate write to its descriptor.
    """
    channel = _private_channel(fd)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when to stop
    become_subreaper()  # what the function starts stays below it, for the scorer to kill
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    _limit_memory(memory_limit_mb)
    try:
        function = load_reward_function(spec) if spec else None
    except Exception as error:
        send_reply(channel, ["failed", clip(str(error), 4 * DETAIL_CHARS)])
        return
    send_reply(channel, ["ready"])
    while (batch := read_job_batch(channel)) is not None:
        for job_id, job in batch:
            reward, error, detail = score_one(function, job)
            send_reply(channel, [job_id, reward, error, detail])
            if error == ERROR_MEMORY:
                return  # the heap may be in a bad way: the scorer starts a fresh worker
