"""WeightPublisher -> WeightClient over real TCP sockets on localhost."""

from __future__ import annotations

import pytest
import torch
import zmq

from asyncrl.config import ModelConfig, TinyModelConfig
from asyncrl.models import build_policy
from asyncrl.transport import free_port, tcp
from asyncrl.weights import WeightClient, WeightPublisher

torch.set_num_threads(1)


@pytest.fixture
def endpoint():
    publisher = WeightPublisher(tcp("127.0.0.1", free_port()))
    context = zmq.Context()
    client = WeightClient(context, publisher.endpoint, timeout_s=10.0)
    try:
        yield publisher, client
    finally:
        client.close()
        context.term()
        publisher.close()


def assert_same_state(received: dict[str, torch.Tensor], sent: dict[str, torch.Tensor]):
    assert list(received) == list(sent)
    for name, tensor in sent.items():
        assert received[name].dtype == tensor.dtype, name
        assert received[name].shape == tensor.shape, name
        assert torch.equal(received[name], tensor), name


def test_a_client_with_no_weights_fetches_the_published_version_exactly(endpoint):
    publisher, client = endpoint
    model, _ = build_policy(ModelConfig(tiny=TinyModelConfig()), seed=0)
    state_dict = model.state_dict()
    publisher.publish(state_dict, version=3)

    update = client.fetch_newer(-1)
    assert update is not None
    version, published_at, received = update
    assert version == 3
    assert published_at > 0
    assert_same_state(received, state_dict)
    # the same answer for any version below 3
    assert client.fetch_newer(0)[0] == 3
    assert publisher.served["weights_sent"] == 2


def test_a_client_holding_the_latest_version_gets_none(endpoint):
    publisher, client = endpoint
    model, _ = build_policy(ModelConfig(tiny=TinyModelConfig()), seed=0)
    publisher.publish(model.state_dict(), version=3)
    assert client.fetch_newer(3) is None
    assert client.fetch_newer(7) is None
    assert publisher.served["weights_sent"] == 0


def test_nothing_published_yet_means_nothing_newer(endpoint):
    _, client = endpoint
    assert client.fetch_newer(-1) is None


def test_a_newer_publication_replaces_the_served_weights(endpoint):
    publisher, client = endpoint
    model, _ = build_policy(ModelConfig(tiny=TinyModelConfig()), seed=0)
    first = {name: t.clone() for name, t in model.state_dict().items()}
    publisher.publish(model.state_dict(), version=3)
    _, _, received_v3 = client.fetch_newer(-1)

    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.25)
    second = model.state_dict()
    publisher.publish(second, version=4)

    version, _, received_v4 = client.fetch_newer(3)
    assert version == 4
    assert_same_state(received_v4, second)
    assert not torch.equal(received_v4["model.norm.weight"], first["model.norm.weight"])
    # the first fetch is unaffected by the second publication
    assert_same_state(received_v3, first)


def test_publish_snapshots_the_tensors_so_later_training_does_not_leak_in(endpoint):
    publisher, client = endpoint
    weight = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    publisher.publish({"w": weight}, version=1)
    weight.add_(100.0)  # the learner keeps training after publishing
    _, _, received = client.fetch_newer(0)
    assert torch.equal(received["w"], torch.arange(6, dtype=torch.float32).reshape(2, 3))


def test_bfloat16_and_other_dtypes_round_trip_bit_exactly(endpoint):
    publisher, client = endpoint
    torch.manual_seed(0)
    state_dict = {
        "bf16": torch.randn(4, 5).to(torch.bfloat16),
        "fp16": torch.randn(3).to(torch.float16),
        "steps": torch.tensor([1, 2, 3], dtype=torch.int64),
        "flags": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 3),
    }
    publisher.publish(state_dict, version=1)
    _, _, received = client.fetch_newer(0)
    assert_same_state(received, state_dict)
    # bit-exact, not just equal as numbers
    assert torch.equal(received["bf16"].view(torch.int16), state_dict["bf16"].view(torch.int16))
