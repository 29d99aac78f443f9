"""Fixtures shared by the collective weight tests."""

from __future__ import annotations

from collections import Counter

import pytest

from asyncrl.weights.collective.sender import CollectiveSender
from asyncrl.weights.shm.publisher import ShmPublisher
from asyncrl.weights.shm.writer import ShmWriter
from asyncrl.weights.snapshot import SnapshotStore
from tests.helpers.collective import BUCKET_BYTES, LEARNER_KEY


class _Zmq:
    """The ZeroMQ publisher's part the shm sink feeds: its snapshots."""

    def __init__(self):
        self.snapshots = SnapshotStore(1 << 22, Counter())
        self.version = 0

    def publish(self, tensors, version: int) -> float:
        self.snapshots.publish(dict(tensors), version)
        self.version = version
        return 0.0

    def stats(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        pass


@pytest.fixture
def learner(tmp_path):
    zmq = _Zmq()
    sink = ShmPublisher(zmq, ShmWriter(tmp_path))
    sender = CollectiveSender(
        zmq.snapshots,
        "127.0.0.1",
        0,
        LEARNER_KEY,
        bucket_bytes=BUCKET_BYTES,
        deadline_s=30.0,
        run_dir=tmp_path,
    )
    yield sink, sender
    sender.close()
    sink.close()
