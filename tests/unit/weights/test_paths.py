"""Which weight paths a run uses on each end, from ``weights.transport`` (``paths.py``)."""

from __future__ import annotations

import pytest

from asyncrl.config import Config, ModelConfig, TinyModelConfig, WeightsConfig
from asyncrl.weights import WeightPublisher
from asyncrl.weights.paths import chain_paths, learner_sink, replica_sources
from asyncrl.weights.shm.publisher import ShmPublisher
from asyncrl.weights.shm.reader import ShmSource
from asyncrl.weights.shm.segment import POINTER_FILE


def config(**weights) -> Config:
    return Config(model=ModelConfig(tiny=TinyModelConfig()), weights=WeightsConfig(**weights))


@pytest.mark.parametrize(
    ("transport", "chain"),
    [
        ("collective", ("collective", "shm", "zmq")),
        ("shm", ("shm", "zmq")),
        ("zmq", ("zmq",)),
    ],
)
def test_a_chain_starts_at_the_configured_path_and_ends_at_zmq(transport, chain):
    assert chain_paths(transport) == chain


def test_by_default_a_replica_tries_shared_memory_then_zmq(tmp_path):
    zmq = object()  # stands for the replica's ZeroMQ source
    first, last = replica_sources(config(), tmp_path, zmq)
    assert isinstance(first, ShmSource) and first.run_dir == tmp_path
    assert last is zmq
    only = replica_sources(config(transport="zmq"), tmp_path, zmq)
    assert only == [zmq]


def test_by_default_the_learner_writes_shared_memory_beside_zmq(tmp_path):
    zmq = WeightPublisher("tcp://127.0.0.1:*")
    sink = learner_sink(config(), tmp_path, zmq)
    try:
        assert isinstance(sink, ShmPublisher) and sink.zmq is zmq
    finally:
        sink.close()


def test_zmq_alone_removes_the_segment_an_earlier_shm_run_left(tmp_path):
    (tmp_path / POINTER_FILE).write_text("asyncrl-" + "0" * 32 + "\n")  # names no real file
    zmq = WeightPublisher("tcp://127.0.0.1:*")
    try:
        assert learner_sink(config(transport="zmq"), tmp_path, zmq) is zmq
        assert not (tmp_path / POINTER_FILE).exists()
    finally:
        zmq.close()
