"""WeightPublisher -> WeightClient over real TCP sockets on localhost, in chunks."""

from __future__ import annotations

import threading

import msgspec
import pytest
import torch
import zmq

from asyncrl.config import ModelConfig, TinyModelConfig
from asyncrl.core.messages import (
    SCHEMA_VERSION,
    Ack,
    ErrorReply,
    WeightsChunkRequest,
    WeightsRequest,
    WireError,
    decode,
    encode,
)
from asyncrl.core.transport import client_socket, free_port, tcp
from asyncrl.generation.models import build_policy
from asyncrl.weights import WeightClient, WeightPublisher

torch.set_num_threads(1)

CHUNK = 1000
"""A small chunk size, so that tensors straddle chunks and big ones span several."""


def make_publisher(cls=WeightPublisher, chunk_bytes: int = CHUNK) -> WeightPublisher:
    return cls(tcp("127.0.0.1", free_port()), chunk_bytes=chunk_bytes)


@pytest.fixture
def context():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


@pytest.fixture
def endpoint(context):
    publisher = make_publisher()
    client = WeightClient(context, publisher.endpoint, timeout_s=10.0)
    try:
        yield publisher, client
    finally:
        client.close()
        publisher.close()


def mixed_state(seed: int = 0) -> dict[str, torch.Tensor]:
    """fp32 and bf16 at odd sizes (so tensors sit at unaligned stream offsets), an
    empty tensor, a scalar, and a matrix spanning many chunks."""
    generator = torch.Generator().manual_seed(seed)
    return {
        "embed": torch.randn(7, 3, generator=generator),
        "big": torch.randn(40, 50, generator=generator),  # 8000 bytes: 9 chunks
        "norm.bf16": torch.randn(13, generator=generator).to(torch.bfloat16),
        "empty": torch.zeros(0, 3),
        "scale": torch.tensor(2.5),
        "half": torch.randn(5, generator=generator).to(torch.float16),
        "steps": torch.tensor([1, 2, 3], dtype=torch.int64),
        "flags": torch.tensor([True, False, True]),
        "head.bf16": torch.randn(33, 9, generator=generator).to(torch.bfloat16),
    }


def bytes_of(tensor: torch.Tensor) -> bytes:
    return bytes(tensor.reshape(-1).view(torch.uint8).numpy())


def assert_same_state(received: dict[str, torch.Tensor], sent: dict[str, torch.Tensor]):
    assert list(received) == list(sent)
    for name, tensor in sent.items():
        assert received[name].dtype == tensor.dtype, name
        assert received[name].shape == tensor.shape, name
        # bit-exact, not just equal as numbers (bf16 and -0.0 included)
        assert bytes_of(received[name]) == bytes_of(tensor), name


# --------------------------------------------------------------------------
# round trips


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
    for name, tensor in state_dict.items():
        assert torch.equal(received[name], tensor), name
    # the same answer for any version below 3
    assert client.fetch_newer(0)[0] == 3
    assert publisher.served["manifests_sent"] == 2
    assert publisher.served["transfers_finished"] == 2


def test_fp32_bf16_empty_and_multi_chunk_tensors_round_trip_bit_exactly(endpoint):
    publisher, client = endpoint
    state_dict = mixed_state()
    publisher.publish(state_dict, version=1)

    version, _, received = client.fetch_newer(0)

    assert version == 1
    assert_same_state(received, state_dict)
    total = sum(t.numel() * t.element_size() for t in state_dict.values())
    assert publisher.served["chunks_sent"] == -(-total // CHUNK) > 8
    assert publisher.served["bytes_sent"] == total


def test_a_client_holding_the_latest_version_gets_none(endpoint):
    publisher, client = endpoint
    publisher.publish(mixed_state(), version=3)
    assert client.fetch_newer(3) is None
    assert client.fetch_newer(7) is None
    assert publisher.served["manifests_sent"] == 0


def test_nothing_published_yet_means_nothing_newer(endpoint):
    _, client = endpoint
    assert client.fetch_newer(-1) is None


def test_a_state_of_only_empty_tensors_needs_no_chunk(endpoint):
    publisher, client = endpoint
    publisher.publish({"a": torch.zeros(0), "b": torch.zeros(3, 0, dtype=torch.bfloat16)}, 1)
    _, _, received = client.fetch_newer(-1)
    assert received["b"].shape == (3, 0) and received["b"].dtype == torch.bfloat16
    assert publisher.served["chunks_sent"] == 0


def test_streamed_pairs_publish_the_same_as_a_dict(endpoint):
    """What the FSDP2 learner does: gather and hand over one full tensor at a time."""
    publisher, client = endpoint
    state_dict = mixed_state()
    gathered = []

    def gather_one_at_a_time():
        for name, tensor in state_dict.items():
            gathered.append(name)
            yield name, tensor.clone()  # e.g. DTensor.full_tensor()

    stall = publisher.publish(gather_one_at_a_time(), version=2)

    assert stall > 0
    assert gathered == list(state_dict)
    assert_same_state(client.fetch_newer(-1)[2], state_dict)


def test_handed_over_tensors_are_served_without_a_copy(endpoint):
    publisher, client = endpoint
    state_dict = mixed_state()
    publisher.publish(state_dict, version=1, copy=False)
    assert publisher.snapshots.latest.buffers[1].data_ptr() == state_dict["big"].data_ptr()
    assert_same_state(client.fetch_newer(-1)[2], state_dict)


def test_a_newer_publication_replaces_the_served_weights(endpoint):
    publisher, client = endpoint
    model, _ = build_policy(ModelConfig(tiny=TinyModelConfig()), seed=0)
    first = {name: t.clone() for name, t in model.state_dict().items()}
    publisher.publish(model.state_dict(), version=3)
    _, _, received_v3 = client.fetch_newer(-1)

    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.25)
    second = {name: t.clone() for name, t in model.state_dict().items()}
    publisher.publish(model.state_dict(), version=4)

    version, _, received_v4 = client.fetch_newer(3)
    assert version == 4
    assert_same_state(received_v4, second)
    assert not torch.equal(received_v4["model.norm.weight"], first["model.norm.weight"])
    # the first fetch is unaffected by the second publication
    assert_same_state(received_v3, first)


def test_publish_snapshots_the_tensors_so_later_training_does_not_leak_in(endpoint):
    publisher, client = endpoint
    weight = torch.arange(600, dtype=torch.float32).reshape(20, 30)
    publisher.publish({"w": weight}, version=1)
    weight.add_(100.0)  # the learner keeps training after publishing
    _, _, received = client.fetch_newer(0)
    assert torch.equal(received["w"], torch.arange(600, dtype=torch.float32).reshape(20, 30))


def test_idle_buffers_two_versions_back_are_reused_and_serve_the_new_values(endpoint):
    publisher, client = endpoint
    for version in (1, 2, 3):
        publisher.publish(mixed_state(seed=version), version)
        if version == 1:
            first_buffers = [b.data_ptr() for b in publisher.snapshots.latest.buffers]
    assert [b.data_ptr() for b in publisher.snapshots.latest.buffers] == first_buffers
    assert_same_state(client.fetch_newer(2)[2], mixed_state(seed=3))


def test_versions_must_increase(endpoint):
    publisher, _ = endpoint
    publisher.publish(mixed_state(), version=2)
    with pytest.raises(ValueError, match="not newer"):
        publisher.publish(mixed_state(), version=2)


def test_duplicate_names_in_a_stream_are_refused(endpoint):
    publisher, _ = endpoint
    with pytest.raises(ValueError, match="'w' is published twice"):
        publisher.publish(iter([("w", torch.zeros(2)), ("w", torch.ones(2))]), version=1)


def test_several_concurrent_clients_all_get_the_same_tensors(context):
    publisher = make_publisher()
    state_dict = mixed_state()
    publisher.publish(state_dict, version=5)
    results: dict[int, tuple] = {}

    def fetch(index: int) -> None:
        client = WeightClient(context, publisher.endpoint, timeout_s=10.0, window=1 + index % 3)
        try:
            results[index] = client.fetch_newer(-1)
        finally:
            client.close()

    threads = [threading.Thread(target=fetch, args=(index,)) for index in range(4)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=20)
    finally:
        publisher.close()
    assert sorted(results) == [0, 1, 2, 3]
    for version, _, received in results.values():
        assert version == 5
        assert_same_state(received, state_dict)
    assert publisher.served["transfers_finished"] == 4


# --------------------------------------------------------------------------
# a newer version published mid-transfer


class PausingPublisher(WeightPublisher):
    """Holds the server thread while it serves one chunk, so the test can publish meanwhile."""

    pause_at = (1, 2)  # (version, chunk)

    def __init__(self, *args, **kwargs):
        self.reached, self.resume = threading.Event(), threading.Event()
        super().__init__(*args, **kwargs)

    def _chunk_message(self, snapshot, index):
        if (snapshot.version, index) == self.pause_at and not self.reached.is_set():
            self.reached.set()
            self.resume.wait(10)
        return super()._chunk_message(snapshot, index)


def fetch_while_publishing(context, newer_versions: list[int]):
    publisher = make_publisher(PausingPublisher)
    publisher.publish(mixed_state(seed=1), version=1)
    client = WeightClient(context, publisher.endpoint, timeout_s=10.0)
    result = {}
    fetcher = threading.Thread(target=lambda: result.update(update=client.fetch_newer(-1)))
    try:
        fetcher.start()
        assert publisher.reached.wait(10)
        for version in newer_versions:
            publisher.publish(mixed_state(seed=version), version)
        publisher.resume.set()
        fetcher.join(timeout=20)
    finally:
        client.close()
        publisher.close()
    return publisher, client, result["update"]


def test_a_client_mid_transfer_finishes_its_version_when_one_newer_is_published(context):
    publisher, client, (version, _, received) = fetch_while_publishing(context, [2])

    assert version == 1
    assert_same_state(received, mixed_state(seed=1))
    assert client.stats["restarts"] == 0
    assert publisher.served["version_gone"] == 0


def test_a_client_whose_version_was_dropped_restarts_and_ends_with_one_version(context):
    publisher, client, (version, _, received) = fetch_while_publishing(context, [2, 3])

    assert version == 3
    assert_same_state(received, mixed_state(seed=3))
    assert client.stats["restarts"] == 1
    assert publisher.served["version_gone"] >= 1
    # the dropped snapshot was still being read, so its buffers were not overwritten
    assert publisher.served["snapshot_not_reused"] == 1


# --------------------------------------------------------------------------
# damaged transfers are detected and named


class DamagingPublisher(WeightPublisher):
    """Serves chunk 2 damaged in the way ``damage`` names."""

    damage = "none"

    def _chunk_message(self, snapshot, index):
        body, specs, views = super()._chunk_message(snapshot, index)
        if index != 2 or self.damage == "none":
            return body, specs, views
        if self.damage == "skip":  # chunk 3 in place of chunk 2
            return super()._chunk_message(snapshot, 3)
        if self.damage == "drop_piece":
            return body, specs[:-1], views[:-1]
        corrupted = bytearray(views[0])
        corrupted[0] ^= 0x01
        return body, specs, [memoryview(corrupted), *views[1:]]


@pytest.mark.parametrize(
    ("damage", "reason", "named"),
    [
        ("skip", "missing_chunk", "expected chunk 2 of v1 ('big')"),
        ("drop_piece", "missing_tensor", "tensor 'big'"),
        ("corrupt", "corrupt_chunk", "chunk 2 of v1 ('big') fails its crc32"),
    ],
)
def test_a_missing_or_corrupt_chunk_is_detected_and_named(context, damage, reason, named):
    publisher = make_publisher(DamagingPublisher)
    publisher.damage = damage
    publisher.publish(mixed_state(), version=1)
    client = WeightClient(context, publisher.endpoint, timeout_s=10.0)
    try:
        with pytest.raises(WireError) as caught:
            client.fetch_newer(-1)
        assert caught.value.reason == reason
        assert named in str(caught.value)
        assert client.errors[reason] == 1
        # replies still in flight from the failed fetch do not confuse the next one
        publisher.damage = "none"
        assert_same_state(client.fetch_newer(-1)[2], mixed_state())
    finally:
        client.close()
        publisher.close()


def test_a_manifest_whose_index_does_not_add_up_is_rejected_on_decoding():
    bad = {
        "type": "weights_manifest",
        "version": 1,
        "published_at": 0.0,
        "chunk_bytes": 1000,
        "total_bytes": 24,
        "num_chunks": 1,
        "tensors": [["w", "float32", [2, 3], 0, 20]],  # 2x3 float32 is 24 bytes
    }
    frame = msgspec.msgpack.encode({"schema_version": SCHEMA_VERSION, "body": bad, "arrays": []})
    with pytest.raises(WireError, match="tensor 'w'") as caught:
        decode([frame])
    assert caught.value.reason == "bad_header"


# --------------------------------------------------------------------------
# the server keeps serving through bad requests


def test_malformed_requests_get_an_error_reply_and_the_server_keeps_serving(endpoint, context):
    publisher, client = endpoint
    publisher.publish(mixed_state(), version=1)
    raw = client_socket(context, publisher.endpoint, timeout_s=5.0)
    try:
        for frames, reason in [
            ([b"not msgpack at all"], "bad_header"),
            (encode(Ack(1)), "unexpected_type"),
            (encode(WeightsChunkRequest(1, 999)), "bad_request"),
            (encode(WeightsRequest(0), {"x": torch.zeros(2).numpy()}), "bad_array"),
        ]:
            raw.send_multipart(frames)
            assert raw.poll(5000)
            reply, _ = decode(raw.recv_multipart())
            assert isinstance(reply, ErrorReply)
            assert reply.reason == reason
            assert publisher.served[f"rejected_{reason}"] == 1
    finally:
        raw.close(linger=0)
    assert_same_state(client.fetch_newer(-1)[2], mixed_state())


def test_a_chunk_of_a_version_no_longer_served_is_answered_gone(endpoint, context):
    publisher, _ = endpoint
    for version in (1, 2, 3):
        publisher.publish(mixed_state(), version)
    raw = client_socket(context, publisher.endpoint, timeout_s=5.0)
    try:
        raw.send_multipart(encode(WeightsChunkRequest(1, 0)))
        assert raw.poll(5000)
        reply, _ = decode(raw.recv_multipart())
    finally:
        raw.close(linger=0)
    assert (type(reply).__name__, reply.version, reply.latest_version) == ("WeightsGone", 1, 3)
