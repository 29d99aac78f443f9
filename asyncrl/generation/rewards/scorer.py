"""The scorer: reward functions run in worker processes, off the generation path.

:class:`RewardScorer` runs the functions in worker processes, so a slow function
never holds up generation, and a hung one can be killed. Whatever a function does
costs at most the sample it is scoring, which scores 0.0 with a tag:

* it raises: ``error:exception``;
* it returns anything but a finite real number (``bool``, numpy's too, a numeric
  string, None, a list, NaN): ``error:bad_return``;
* it runs past ``timeout_s``: ``error:timeout``;
* it goes past ``memory_limit_mb`` of address space (``RLIMIT_AS``, set before the
  function is loaded): ``error:memory``;
* its process dies (``os._exit``, a signal): ``error:crashed``;
* it writes to the worker's channel to the scorer (every message is a
  length-prefixed JSON frame, checked on arrival): ``error:channel``.

In the last four cases the worker is replaced and the samples queued behind it go
to the new one. Tags are counted in ``scorer.counters`` and logged (the first few
of each kind with details); the run goes on. What a worker prints goes to a pipe
the scorer reads: counted in ``worker_output_bytes``, with the first 2 KiB of it
logged at most once a minute.

Threads could not do this: a thread stuck in a reward function cannot be
stopped, and would keep its pool slot (and a core) for as long as it hangs. A
process-pool library (``pebble`` 5.2, tried for issue 16) could not either: its
workers share one pair of pipes on low descriptors, so a function that writes to
descriptors it believes are its own corrupts the pool, and the sample after it
is never scored; it has no per-worker output pipe and no way to retire the one
worker whose heap ran out of memory. Each worker here has its own channel, moved
out of reach (:func:`asyncrl.generation.rewards.worker._private_channel`).
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import math
import multiprocessing.connection
import os
import socket
import subprocess
import threading
import time
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

from asyncrl.generation.contained import STARTUP_S
from asyncrl.generation.plugin_check import check_reward_function
from asyncrl.generation.rewards.channel import READ_BYTES, decode_reply, encode_jobs, take_frames
from asyncrl.generation.rewards.outcome import (
    ERROR_CHANNEL,
    ERROR_CRASHED,
    ERROR_EXCEPTION,
    ERROR_MEMORY,
    ERROR_TIMEOUT,
    Score,
    clip,
)
from asyncrl.generation.rewards.processes import WorkerProcess, exit_description

log = logging.getLogger("asyncrl.rewards")  # the name operators filter on, as before the split

_LOGGED_PER_TAG = 5
_BATCH = 256
"""Jobs per frame to a worker (a reply per job still resets its deadline)."""

_OUTPUT_LOG_INTERVAL_S = 60.0
"""At most one excerpt of the workers' output is logged per interval; the rest is counted."""


@dataclass
class _Job:
    id: int
    args: tuple
    future: Future


class RewardScorer:
    """Score samples in ``workers`` processes, ``timeout_s`` per sample.

    ``submit(...)`` returns at once with a :class:`concurrent.futures.Future` of a
    :class:`Score`; the future always completes, with a 0.0 ``Score`` tagged
    ``error:...`` when the function raised, hung, crashed, ran out of memory or
    returned something that is not a number::

        with RewardScorer("my_rewards.py:compute_score", timeout_s=5) as scorer:
            future = scorer.submit("openai/gsm8k", "... #### 42", "42", {})
            reward, error, _ = future.result()

    Worker processes start with the first sample, each limited to
    ``memory_limit_mb`` of address space. A background thread hands samples out
    in batches, enforces each sample's deadline, checks every message a worker
    sends, and fills the futures. A worker that hangs, dies, runs out of memory
    or sends anything but a well-formed reply is replaced: the sample it was
    scoring fails, its other samples go to the next worker. What workers print
    is read off a pipe and logged in short excerpts. ``function``
    (``module:function`` or ``file.py:function``) is loaded first in a contained
    child (:func:`asyncrl.generation.plugin_check.check_reward_function`, under
    ``load_timeout_s`` and ``memory_limit_mb``), so a bad name or a module that hangs
    at import fails at construction, not in a worker, and never runs in the caller's
    process.
    """

    def __init__(
        self,
        function: str | None = None,
        timeout_s: float = 10.0,
        workers: int = 1,
        memory_limit_mb: int = 4096,
        load_timeout_s: float = 60.0,
    ):
        if timeout_s <= 0 or load_timeout_s <= 0 or workers < 1 or memory_limit_mb < 1:
            raise ValueError(
                "need timeout_s > 0, load_timeout_s > 0, workers >= 1 and memory_limit_mb "
                f">= 1, got {timeout_s}, {load_timeout_s}, {workers}, {memory_limit_mb}"
            )
        if function:  # imported in a contained child: never in this process
            check_reward_function(
                function, load_timeout_s=load_timeout_s, memory_limit_mb=memory_limit_mb
            )
            where, _, name = function.rpartition(":")
            if where.endswith(".py") or "/" in where or os.sep in where:  # workers: same file
                function = f"{Path(where).expanduser().resolve()}:{name}"
        self.function = function or None
        self.timeout_s = timeout_s
        self.num_workers = workers
        self.memory_limit_mb = memory_limit_mb
        self.counters: collections.Counter[str] = collections.Counter()
        """``scored``, ``errors``, one entry per error tag, ``workers_started``,
        ``worker_output_bytes``."""
        self._lock = threading.Lock()
        self._queue: collections.deque[_Job] = collections.deque()
        self._ids = itertools.count()
        self._workers: list[WorkerProcess] = []
        self._thread: threading.Thread | None = None
        self._wake_recv, self._wake_send = multiprocessing.connection.Pipe(duplex=False)
        self._closed = False
        self._failed: str | None = None
        self._startup_failures = 0
        self._output_logged_at = -math.inf

    @classmethod
    def from_config(cls, config) -> RewardScorer:
        """From the ``reward`` section (:class:`asyncrl.config.RewardConfig`)."""
        return cls(
            config.function,
            config.timeout_s,
            config.workers,
            config.memory_limit_mb,
            config.load_timeout_s,
        )

    # -- the caller's side

    def submit(
        self,
        data_source: str,
        solution_str: str,
        ground_truth: str,
        extra_info: Any = None,
        function: str | None = None,
    ) -> Future:
        """Queue one sample; the returned future gives its :class:`Score`.

        ``function`` (``module:function`` or ``file.py:function``) scores this
        sample instead of the scorer's own (a multi-turn environment's reward)."""
        (future,) = self.submit_many(
            [(data_source, solution_str, ground_truth, extra_info, function)]
        )
        return future

    def submit_many(self, samples: Iterable[tuple]) -> list[Future]:
        """Queue ``(data_source, solution_str, ground_truth, extra_info[, function])``
        samples at once, one future each, in order: the dispatcher wakes once and sends
        them to a worker in one batch, not one round trip per sample."""
        if self._closed:
            raise RuntimeError("the reward scorer is closed")
        if self._failed:
            raise RuntimeError(f"reward workers cannot start: {self._failed}")
        jobs = [
            _Job(next(self._ids), (*sample, None)[:5], Future())  # function: None unless given
            for sample in samples
        ]
        with self._lock:
            self._queue.extend(jobs)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._dispatch_loop, name="reward-scorer", daemon=True
                )
                self._thread.start()
        self._wake()
        return [job.future for job in jobs]

    def score_many(self, samples: Iterable[tuple]) -> list[Score]:
        """Score ``(data_source, solution_str, ground_truth, extra_info)`` tuples; blocks."""
        return [future.result() for future in self.submit_many(samples)]

    def score(self, data_source, solution_str, ground_truth, extra_info=None) -> Score:
        return self.submit(data_source, solution_str, ground_truth, extra_info).result()

    def close(self) -> None:
        """Stop the workers (killing any still scoring); pending futures get ``error:closed``."""
        if self._closed:
            return
        self._closed = True
        self._wake()
        if self._thread is not None:
            self._thread.join(timeout=5)
        pending = []
        for worker in list(self._workers):
            pending += list(worker.jobs)
            self._stop_worker(worker)
        self._workers.clear()
        with self._lock:
            pending, self._queue = pending + list(self._queue), collections.deque()
        for job in pending:
            self._finish(job, Score(0.0, "error:closed", "the scorer was closed"))
        self._wake_send.close()
        self._wake_recv.close()

    def __enter__(self) -> RewardScorer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- the dispatcher thread

    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            self._wake_send.send_bytes(b"")

    def _dispatch_loop(self) -> None:
        try:
            while not self._closed:
                self._fill_workers()
                self._assign()
                self._wait_and_read()
                now = time.monotonic()
                for worker in list(self._workers):
                    if worker.deadline > now:
                        continue
                    if worker.jobs:
                        self._timed_out(worker)
                    elif not worker.ready:
                        detail = f"the reward worker did not load {self.function} in time"
                        self._lost(worker, ERROR_TIMEOUT, detail)
        except Exception as error:  # never leave futures hanging
            log.exception("reward scorer stopped")
            self._failed = f"{type(error).__name__}: {error}"
            with self._lock:
                pending, self._queue = list(self._queue), collections.deque()
            for worker in self._workers:
                pending += list(worker.jobs)
                worker.jobs.clear()
            for job in pending:
                self._finish(job, Score(0.0, "error:scorer", self._failed))

    def _wait_and_read(self) -> None:
        """Wait for a wake-up, a message, output or the next deadline; read what came."""
        deadline = min((w.deadline for w in self._workers), default=math.inf)
        timeout = None if deadline == math.inf else max(0.0, deadline - time.monotonic())
        outputs = [w.output_fd for w in self._workers if w.output_fd is not None]
        ready = set(wait([self._wake_recv, *(w.channel for w in self._workers), *outputs], timeout))
        if self._wake_recv in ready:
            while self._wake_recv.poll():
                self._wake_recv.recv_bytes()
        for worker in list(self._workers):
            if worker.output_fd in ready:
                worker.read_output()
        for worker in list(self._workers):
            if worker in self._workers and worker.channel in ready:
                self._receive(worker)

    def _fill_workers(self) -> None:
        while len(self._workers) < self.num_workers and not self._failed:
            worker = WorkerProcess.start(self.function, self.memory_limit_mb)
            worker.deadline = time.monotonic() + STARTUP_S + self.timeout_s  # to say "ready"
            self._workers.append(worker)
            self.counters["workers_started"] += 1

    def _assign(self) -> None:
        for worker in self._workers:
            if not worker.ready or worker.jobs:
                continue
            with self._lock:
                if not self._queue:
                    return
                batch = [self._queue.popleft() for _ in range(min(_BATCH, len(self._queue)))]
            try:
                frame = encode_jobs([(job.id, job.args) for job in batch])
            except Exception as error:  # e.g. extra_info that is not plain data
                for job in batch:
                    self._finish(job, Score(0.0, ERROR_EXCEPTION, f"cannot send: {error}"))
                continue
            worker.jobs.extend(batch)
            worker.deadline = time.monotonic() + self.timeout_s
            try:
                worker.channel.sendall(frame)
            except OSError:
                worker.jobs.clear()
                worker.deadline = math.inf
                self._requeue(batch)
                self._replace(worker, None)
                return  # self._workers changed under the loop; the next round goes on

    def _receive(self, worker: WorkerProcess) -> None:
        """Read what the worker sent and act on each whole message; replace a worker that
        closed its channel or sent anything but a well-formed message."""
        try:
            data = worker.channel.recv(READ_BYTES, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._crashed(worker)
            return
        worker.inbox += data
        try:
            for frame in take_frames(worker.inbox):
                if not self._handle(worker, decode_reply(frame)):
                    return
        except ValueError as error:  # json's errors and UnicodeDecodeError are ValueErrors
            detail = (
                f"the reward worker sent something that is not a reply ({clip(str(error), 200)});"
                " it was replaced. Does the reward function write to descriptors it did not open?"
            )
            self._lost(worker, ERROR_CHANNEL, detail)

    def _handle(self, worker: WorkerProcess, message: list) -> bool:
        """Act on one checked message; False when the worker is gone after it."""
        if message[0] == "ready":
            if worker.ready:
                raise ValueError("a second 'ready'")
            worker.ready = True
            worker.deadline = math.inf
            self._startup_failures = 0
            return True
        if message[0] == "failed":
            self._failed = message[1]
            log.error("reward worker cannot start: %s", message[1])
            self._fail_everything(message[1])
            return False
        job_id, reward, error, detail = message
        if not worker.ready or not worker.jobs or worker.jobs[0].id != job_id:
            expected = worker.jobs[0].id if worker.jobs else None
            raise ValueError(f"a reply for job {job_id}, expected {expected}")
        job = worker.jobs.popleft()
        if error == ERROR_MEMORY:
            detail = (
                f"{detail}: the reward function ran out of memory "
                f"(reward.memory_limit_mb={self.memory_limit_mb}); the worker was replaced"
            )
            self._replace(worker, (job, Score(0.0, error, detail)))
            return False
        self._finish(job, Score(reward if error is None else 0.0, error, detail))
        worker.deadline = time.monotonic() + self.timeout_s if worker.jobs else math.inf
        if not worker.jobs:
            self._flush_output(worker)
        return True

    def _crashed(self, worker: WorkerProcess) -> None:
        try:
            code = worker.process.wait(timeout=1)
        except subprocess.TimeoutExpired:
            code = None
        self._lost(worker, ERROR_CRASHED, exit_description(code))

    def _lost(self, worker: WorkerProcess, tag: str, detail: str) -> None:
        """Replace a worker that died or broke its channel: the sample it was scoring fails
        with ``tag``, its other samples are requeued. Three in a row that never got ready
        fail the scorer (the function cannot even load)."""
        if not worker.ready:
            self._startup_failures += 1
            if self._startup_failures >= 3:
                self._failed = f"{detail} while starting, {self._startup_failures} times"
                log.error("reward workers cannot start: %s", self._failed)
                self._fail_everything(self._failed)
                return
        current = worker.jobs.popleft() if worker.jobs else None
        if current is None:
            log.warning("reward worker replaced: %s", detail)
        self._replace(worker, None if current is None else (current, Score(0.0, tag, detail)))

    def _timed_out(self, worker: WorkerProcess) -> None:
        job = worker.jobs.popleft()
        detail = f"no reward after {self.timeout_s}s; the worker was killed and replaced"
        self._replace(worker, (job, Score(0.0, ERROR_TIMEOUT, detail)))

    def _replace(self, worker: WorkerProcess, failed: tuple[_Job, Score] | None) -> None:
        """Stop ``worker``, settle its failed job, send its other jobs to the front of the queue."""
        self._stop_worker(worker)
        self._workers.remove(worker)
        self._requeue(list(worker.jobs))
        worker.jobs.clear()
        if failed is not None:
            self._finish(*failed)

    def _requeue(self, jobs: list[_Job]) -> None:
        with self._lock:
            self._queue.extendleft(reversed(jobs))

    def _fail_everything(self, reason: str) -> None:
        with self._lock:
            pending, self._queue = list(self._queue), collections.deque()
        for worker in self._workers:
            pending += list(worker.jobs)
            worker.jobs.clear()
            self._stop_worker(worker)
        self._workers.clear()
        for job in pending:
            self._finish(job, Score(0.0, "error:scorer", reason))

    def _stop_worker(self, worker: WorkerProcess) -> None:
        worker.stop()
        self._flush_output(worker)
        if worker.output_fd is not None:
            worker.close_output()

    # -- what workers print

    def _flush_output(self, worker: WorkerProcess) -> None:
        """Count what the worker printed, and log the start of it if no excerpt was logged
        in the last minute: a chatty function cannot flood the generator's log."""
        if not worker.output_bytes:
            return
        self.counters["worker_output_bytes"] += worker.output_bytes
        now = time.monotonic()
        if now - self._output_logged_at >= _OUTPUT_LOG_INTERVAL_S:
            self._output_logged_at = now
            shown = worker.output.decode(errors="replace")
            more = worker.output_bytes - len(worker.output)
            log.info(
                "reward worker %d printed %d bytes%s (one excerpt a minute is logged):\n%s",
                worker.process.pid,
                worker.output_bytes,
                f", {more} not shown" if more else "",
                shown,
            )
        worker.output.clear()
        worker.output_bytes = 0

    def _finish(self, job: _Job, score: Score) -> None:
        if score.error is None:
            self.counters["scored"] += 1
        else:
            self.counters["errors"] += 1
            self.counters[score.error] += 1
            if self.counters[score.error] <= _LOGGED_PER_TAG:
                data_source = job.args[0]
                log.warning(
                    "reward %s (data_source %r): %s", score.error, data_source, score.detail
                )
                if self.counters[score.error] == _LOGGED_PER_TAG:
                    log.warning("further %s errors are counted, not logged", score.error)
        if not job.future.done():
            job.future.set_result(score)
