"""The learner's publish when replicas on its host read shared memory: one copy, zmq on demand.

:class:`ShmPublisher` writes each version into the shared-memory segment
(:class:`~asyncrl.weights.shm.writer.ShmWriter`): one memory copy, the
learner's whole stall. The ZeroMQ server's host snapshot
(:class:`~asyncrl.weights.WeightPublisher`), which replicas on other machines
and every fallback read, is filled from the slot *when someone asks for it*:
the first manifest request after a publish copies the newest version from its
slot on the server thread (:meth:`ShmPublisher.serve_over_zmq`). A run whose
replicas all read shared memory or the broadcast never pays for that copy, and
the copy never competes with the broadcast for memory bandwidth (it took 8% of
the collective path's rate here when it ran beside it). Copy and publish hold
one lock, so the publish after next cannot rewrite the slot being copied; the
learner waits only for a copy already under way.

The first publish sizes the segment: it goes to the ZeroMQ snapshot first (the
tensors arrive one at a time, their total unknown until the last) and is copied
into the new segment from there: two copies, once per run.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter

import torch

from asyncrl.weights.shm.writer import ShmWriter
from asyncrl.weights.snapshot import NamedTensors
from asyncrl.weights.zmq.server import WeightPublisher

log = logging.getLogger("asyncrl.weights")


class ShmPublisher:
    """A weight sink: shared memory on the critical path, the ZeroMQ snapshot on demand."""

    def __init__(self, zmq: WeightPublisher, writer: ShmWriter):
        self.zmq = zmq
        self.writer = writer
        self.counters: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._version = -1
        self._unserved: tuple[list[tuple[str, torch.Tensor]], int] | None = None
        """The newest version's views of its slot, until ZeroMQ has a copy of them."""
        zmq.before_manifest = self.serve_over_zmq

    @property
    def version(self) -> int:
        return self._version

    def publish(self, tensors: NamedTensors, version: int) -> float:
        """Write ``version`` to shared memory (ZeroMQ copies it when asked); the seconds
        stalled."""
        started = time.perf_counter()
        with self._lock:
            self._unserved = None
            if self.writer.ready:
                written = self.writer.publish(tensors, version)
                if self.writer.ready:
                    self._unserved = (written, version)
                else:  # outgrown and retired: the tensors are host copies or a dead slot's
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
            self._version = version
        return time.perf_counter() - started

    def serve_over_zmq(self) -> None:
        """Copy the newest version from its slot into the ZeroMQ snapshot, if not yet done
        (the ZeroMQ server calls this before it answers a manifest request)."""
        if self._unserved is None:  # nothing to copy: never wait on a publish under way
            return
        with self._lock:
            if self._unserved is None:
                return
            written, version = self._unserved
            self._unserved = None
            try:
                self.zmq.publish(written, version)
                self.counters["shm_zmq_copies"] += 1
            except Exception:  # the learner must not die of the side path; shm still serves
                self.counters["shm_zmq_copy_failed"] += 1
                log.exception("could not copy weights v%d from shared memory for ZeroMQ", version)

    def stats(self) -> dict[str, float]:
        """The ZeroMQ server's ``weights_*`` counters and ``weights_shm_<counter>_total``."""
        counts = self.writer.counters + self.counters
        return self.zmq.stats() | {f"weights_{k}_total": float(v) for k, v in counts.items()}

    def close(self) -> None:
        with self._lock:  # no copy reads the segment any more
            self._unserved = None
            self.zmq.before_manifest = None
            self.writer.close()
        self.zmq.close()
