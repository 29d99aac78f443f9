"""A replica checks what it fetches over ZeroMQ too: the learner's server may have copied
the version from a shared-memory slot someone wrote NaN into. A version whose values are
not finite, or whose manifest is not the engine's layout, is refused before the engine
gets a byte, counted, and neither fetched nor counted again."""

from __future__ import annotations

import math
import time

import pytest
import torch
import zmq

from asyncrl.core.transport import free_port, tcp
from asyncrl.weights import WeightClient, WeightPublisher
from asyncrl.weights.checks import WeightsRefused
from asyncrl.weights.zmq.source import ZmqSource
from tests.helpers.weights import EMBEDDING, holds, make_backend, published, sample


@pytest.fixture
def learner_and_replica():
    publisher = WeightPublisher(tcp("127.0.0.1", free_port()))
    context = zmq.Context()
    client = WeightClient(context, publisher.endpoint, timeout_s=30.0)
    source, backend = ZmqSource(client), make_backend()
    publisher.publish(published(1), 1)
    assert source.sync_into(backend, backend.version, time.monotonic() + 30).version == 1
    yield publisher, client, source, backend
    client.close()
    context.term()
    publisher.close()


def sync(source: ZmqSource, backend):
    return source.sync_into(backend, backend.version, time.monotonic() + 30)


def test_a_version_with_nan_is_refused_before_the_engine_gets_it_and_fetched_once(
    learner_and_replica,
):
    publisher, client, source, backend = learner_and_replica
    poisoned = published(2)
    poisoned[EMBEDDING].view(-1)[:2] = torch.tensor([math.nan, math.inf])
    publisher.publish(poisoned, 2)

    with pytest.raises(WeightsRefused, match=rf"zmq v2: refused: tensor '{EMBEDDING}' holds NaN"):
        sync(source, backend)
    assert backend.version == 1 and holds(backend, published(1))
    assert source.counters == {"refused_nonfinite": 1}
    sample(backend)

    fetched = client.stats["fetched"]
    assert sync(source, backend) is None  # v2 again: its manifest only, no chunk
    assert client.stats["fetched"] == fetched and source.counters == {"refused_nonfinite": 1}

    publisher.publish(published(3), 3)
    assert sync(source, backend).version == 3 and holds(backend, published(3))


def test_a_manifest_not_laid_out_as_the_engine_is_refused_before_any_chunk(learner_and_replica):
    publisher, client, source, backend = learner_and_replica
    wrong = published(2)
    wrong[EMBEDDING] = wrong[EMBEDDING].to(torch.bfloat16)
    publisher.publish(wrong, 2)
    fetched = client.stats["fetched"]

    with pytest.raises(WeightsRefused, match=r"is bfloat16, the engine's is float32") as caught:
        sync(source, backend)
    assert not caught.value.partial and caught.value.reason == "layout"
    assert client.stats["fetched"] == fetched  # no chunk was asked for
    assert backend.version == 1 and holds(backend, published(1))
    assert source.counters == {"refused_layout": 1}
