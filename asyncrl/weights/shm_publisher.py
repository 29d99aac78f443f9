"""The learner's publish when replicas on its host read shared memory: one copy, then zmq.

:class:`ShmPublisher` writes each version into the shared-memory segment
(:class:`~asyncrl.weights.shm_writer.ShmWriter`): one memory copy, the
learner's whole stall. A thread then copies the slot into the ZeroMQ server's
host snapshot (:class:`~asyncrl.weights.WeightPublisher`), off the learner's
critical path, so replicas on other machines, and every fallback, still get
the version. The next publish first waits for that copy (it reads the slot the
publish after next rewrites; in practice it finished steps ago).

The first publish sizes the segment: it goes to the ZeroMQ snapshot first (the
tensors arrive one at a time, their total unknown until the last) and is copied
into the new segment from there: two copies, once per run.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from asyncrl.weights.shm_writer import ShmWriter
from asyncrl.weights.snapshot import NamedTensors
from asyncrl.weights.zmq_server import WeightPublisher

log = logging.getLogger("asyncrl.weights")


class ShmPublisher:
    """A weight sink: shared memory on the critical path, the ZeroMQ snapshot beside it."""

    def __init__(self, zmq: WeightPublisher, writer: ShmWriter):
        self.zmq = zmq
        self.writer = writer
        self.counters: Counter[str] = Counter()
        self._copier = ThreadPoolExecutor(1, thread_name_prefix="weights-zmq-copy")
        self._pending: Future | None = None

    @property
    def version(self) -> int:
        return self.zmq.version

    def publish(self, tensors: NamedTensors, version: int) -> float:
        """Write ``version`` to shared memory and hand it to ZeroMQ; the seconds stalled."""
        started = time.perf_counter()
        self._wait_for_copy()
        if self.writer.ready:
            written = self.writer.publish(tensors, version)
            if self.writer.ready:
                self._pending = self._copier.submit(self._serve_over_zmq, written, version)
            else:  # outgrown and retired: the tensors are host copies or a dead slot's views
                self.zmq.publish(written, version)
        elif self.writer.retired:
            self.zmq.publish(tensors, version)
        else:
            self.zmq.publish(tensors, version)
            snapshot = self.zmq.snapshots.newest()
            assert snapshot is not None
            if self.writer.create(snapshot.tensors):
                names = [entry.name for entry in snapshot.tensors]
                self.writer.publish(zip(names, snapshot.buffers, strict=True), version)
        return time.perf_counter() - started

    def _serve_over_zmq(self, written: list[tuple[str, torch.Tensor]], version: int) -> None:
        try:
            self.zmq.publish(written, version)
        except Exception:  # the learner must not die of the side path; replicas here use shm
            self.counters["shm_zmq_copy_failed"] += 1
            log.exception("could not copy weights v%d from shared memory for ZeroMQ", version)

    def _wait_for_copy(self) -> None:
        if self._pending is not None:
            self._pending.result()
            self._pending = None

    def stats(self) -> dict[str, float]:
        """The ZeroMQ server's ``weights_*`` counters and ``weights_shm_<counter>_total``."""
        counts = self.writer.counters + self.counters
        return self.zmq.stats() | {f"weights_{k}_total": float(v) for k, v in counts.items()}

    def close(self) -> None:
        self._wait_for_copy()
        self._copier.shutdown(wait=True)
        self.writer.close()
        self.zmq.close()
