"""The weights server costs the learner bounded time and memory, whoever its peers are.

Over real sockets: requests that are not a generator's small request are refused
before they are decoded, a peer that never reads cannot make the server hold more
than a few chunk replies for it (and is dropped once it stops answering
heartbeats), only generators get weights when authentication is on, and every
refusal is counted in :meth:`WeightPublisher.stats` and logged once per interval.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import msgspec
import pytest
import torch
import zmq

from asyncrl import weights
from asyncrl.config import ClusterConfig
from asyncrl.core.keys_folder import hold_every_role
from asyncrl.core.messages import (
    SCHEMA_VERSION,
    ErrorReply,
    WeightsChunkRequest,
    WeightsRequest,
    WireError,
    decode,
    encode,
)
from asyncrl.core.security import client_context
from asyncrl.core.transport import client_socket, free_port, tcp
from asyncrl.weights import WeightClient, WeightPublisher
from asyncrl.weights.zmq import server as zmq_server
from tests.helpers.waiting import wait_until

pytestmark = pytest.mark.timeout(120)

CAP = 8
"""weights.PEER_MAX_CHUNKS: chunk replies libzmq may hold for one peer."""
REFUSED_WAIT_MS = 1000


@pytest.fixture
def context() -> Iterator[zmq.Context]:
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


@pytest.fixture
def publisher() -> Iterator[WeightPublisher]:
    publisher = WeightPublisher(tcp("127.0.0.1", free_port()), chunk_bytes=1000)
    yield publisher
    publisher.close()


@pytest.fixture
def cluster(tmp_path) -> ClusterConfig:
    """A loopback run with authentication (PLAIN, a password per role), every role's
    credentials held by the test process."""
    cluster = ClusterConfig(keys_dir=str(tmp_path / "keys"))
    hold_every_role(cluster)
    return cluster


def state(seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(40, 50, generator=generator), "b": torch.randn(7, generator=generator)}


def fetched_exactly(context: zmq.Context, endpoint: str, sent: dict[str, torch.Tensor]) -> bool:
    client = WeightClient(context, endpoint, timeout_s=10.0)
    try:
        update = client.fetch_newer(-1)
    finally:
        client.close()
    return update is not None and all(torch.equal(update[2][n], t) for n, t in sent.items())


def ask(context: zmq.Context, endpoint: str, frames: list) -> ErrorReply:
    sock = client_socket(context, endpoint, timeout_s=10.0)
    try:
        sock.send_multipart(frames)
        assert sock.poll(10_000), "no reply"
        reply, _ = decode(sock.recv_multipart())
        return reply
    finally:
        sock.close(linger=0)


def many_dimension_header(dims: int, size: int = 2**63 - 1) -> bytes:
    """A WeightsRequest header naming one uint8 array of ``dims`` huge dimensions: decoding
    it multiplies them all (a 63 KB one cost the server thread 0.1 s before the limits)."""
    return msgspec.msgpack.encode(
        {
            "schema_version": SCHEMA_VERSION,
            "body": {"type": "weights_request", "have_version": -1},
            "arrays": [["x", "uint8", [size] * dims]],
        }
    )


def wait_until_idle(publisher: WeightPublisher, quiet_s: float = 0.5) -> None:
    """Until the server's counters have not moved for ``quiet_s``: every request handled."""
    last, since = None, time.monotonic()
    deadline = since + 30
    while time.monotonic() - since < quiet_s:
        assert time.monotonic() < deadline, "the server never settled"
        now = dict(publisher.served)
        if now != last:
            last, since = now, time.monotonic()
        time.sleep(0.05)


def never_reading_socket(context: zmq.Context, endpoint: str) -> zmq.Socket:
    """A peer that asks and never reads: room for one reply in its queue, a tiny kernel
    buffer, so the server's replies back up at once."""
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.RCVHWM, 1)
    sock.setsockopt(zmq.RCVBUF, 4096)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    return sock


def held_chunk_replies(publisher: WeightPublisher) -> int:
    """Chunk replies libzmq holds: one piece per chunk here, each a tracked zero-copy frame."""
    return sum(not tracker.done for tracker in publisher.snapshots.latest.trackers)


# --------------------------------------------------------------------------
# requests that are not small single-frame headers are refused before decoding


@pytest.mark.parametrize(
    ("frames", "reason", "decoded"),
    [
        ([many_dimension_header(6991), b"\0"], "bad_array", False),  # 63 KB and an array
        ([many_dimension_header(6991)], "oversized", False),  # 63 KB, header only
        ([many_dimension_header(3, 2)], "frame_count", True),  # names an array, has none
        (encode(WeightsRequest(-1)) * 3, "bad_array", False),
    ],
    ids=["63KB-with-a-frame", "63KB-header", "no-array-frame", "three-frames"],
)
def test_a_many_dimension_request_is_refused_cheaply_and_the_server_keeps_serving(
    publisher, context, monkeypatch, frames, reason, decoded
):
    calls = []

    def counting_decode(*args, **kwargs):
        calls.append(sum(len(frame) for frame in args[0]))
        return decode(*args, **kwargs)

    monkeypatch.setattr(zmq_server, "decode", counting_decode)
    publisher.publish(state(), version=1)

    reply = ask(context, publisher.endpoint, frames)

    assert isinstance(reply, ErrorReply)
    assert reply.reason == reason
    assert len(reply.detail) <= 200
    assert bool(calls) == decoded  # the big ones are refused on their sizes alone
    assert all(size <= 4096 for size in calls)
    assert publisher.stats()[f"weights_rejected_{reason}_total"] == 1
    assert fetched_exactly(context, publisher.endpoint, state())


# --------------------------------------------------------------------------
# a peer that never reads


def flood_with_chunk_requests(sock: zmq.Socket, publisher, total: int, chunks: int) -> list[int]:
    """Send ``total`` chunk requests in waves; the chunk replies the server held after each."""
    held = []
    for start in range(0, total, 100):
        for index in range(start, min(total, start + 100)):
            sock.send_multipart(encode(WeightsChunkRequest(1, index % chunks)))
        time.sleep(0.05)
        held.append(held_chunk_replies(publisher))
    wait_until_idle(publisher)
    held.append(held_chunk_replies(publisher))
    return held


def test_a_client_that_never_reads_gets_at_most_the_cap_of_chunk_replies_held(context):
    publisher = WeightPublisher(tcp("127.0.0.1", free_port()), chunk_bytes=1 << 20)
    never = never_reading_socket(context, publisher.endpoint)
    try:
        publisher.publish({"w": torch.zeros(4 << 20)}, version=1)  # 16 chunks of one piece

        held = flood_with_chunk_requests(never, publisher, total=1000, chunks=16)

        # the server never held more than the cap of chunk replies for it; the rest of
        # its 1000 requests waited in the server or were refused, not queued in libzmq
        assert max(held) <= CAP, held
        assert held[-1] > 0  # it is stuck: what it pins stays pinned until it is dropped
        assert weights.PEER_MAX_CHUNKS == CAP
        assert 1 <= publisher.peak_peer_in_flight <= CAP
        served = publisher.stats()
        assert served["weights_chunks_sent_total"] < 100
        # its requests beyond the cap were refused, and the refusals dropped once its
        # queue was full, all without blocking the server thread
        assert served["weights_rejected_peer_busy_total"] > 0
        assert served["weights_replies_dropped_peer_full_total"] > 0
        # a well-behaved client is served meanwhile, in full
        sent = {"w": torch.zeros(4 << 20)}
        assert fetched_exactly(context, publisher.endpoint, sent)
        assert held_chunk_replies(publisher) <= CAP
    finally:
        never.close(linger=0)
        publisher.close()


def test_a_peer_that_stops_reading_is_dropped_and_what_it_pinned_is_released(context, monkeypatch):
    monkeypatch.setattr(zmq_server, "HEARTBEAT_INTERVAL_S", 0.2)
    monkeypatch.setattr(zmq_server, "HEARTBEAT_TIMEOUT_S", 1.0)
    publisher = WeightPublisher(tcp("127.0.0.1", free_port()), chunk_bytes=1 << 20)
    never = never_reading_socket(context, publisher.endpoint)
    try:
        publisher.publish({"w": torch.zeros(4 << 20)}, version=1)
        for index in range(64):
            never.send_multipart(encode(WeightsChunkRequest(1, index % 16)))
        wait_until(lambda: held_chunk_replies(publisher) > 0, 20.0)  # stuck

        # it stops answering the heartbeats: dropped, its replies released, its slot freed
        wait_until(lambda: held_chunk_replies(publisher) == 0, 20.0)
        wait_until_idle(publisher)
        assert held_chunk_replies(publisher) == 0
        assert publisher.stats()["weights_peers_served"] == 0
        assert publisher.served["chunks_sent"] < 64
    finally:
        never.close(linger=0)
        publisher.close()


def test_a_peer_that_holds_chunks_pins_only_the_tensors_they_are_cut_from(context):
    publisher = WeightPublisher(tcp("127.0.0.1", free_port()), chunk_bytes=1 << 20)
    never = never_reading_socket(context, publisher.endpoint)
    try:
        sent = {"a": torch.zeros(4 << 20), "b": torch.ones(1 << 20)}  # 16 + 4 chunks
        publisher.publish(sent, version=1)
        first = [buffer.data_ptr() for buffer in publisher.snapshots.latest.buffers]
        for index in range(16):  # chunks of 'a' only
            never.send_multipart(encode(WeightsChunkRequest(1, index)))
        wait_until(lambda: held_chunk_replies(publisher) > 0, 20.0)
        wait_until_idle(publisher)

        publisher.publish(sent, version=2)
        publisher.publish(sent, version=3)  # into the buffers of version 1 where it can

        third = [buffer.data_ptr() for buffer in publisher.snapshots.latest.buffers]
        assert third[0] != first[0]  # zmq may still read 'a' of version 1: not overwritten
        assert third[1] == first[1]  # 'b' was reused: no fresh snapshot for one slow peer
        assert publisher.served["snapshot_not_reused"] == 1
        assert fetched_exactly(context, publisher.endpoint, sent)
    finally:
        never.close(linger=0)
        publisher.close()


# --------------------------------------------------------------------------
# authorization: only generators get weights


def test_only_generators_get_weights_when_authentication_is_on(cluster, caplog):
    caplog.set_level(logging.WARNING, logger="asyncrl")
    publisher = WeightPublisher(tcp("127.0.0.1", free_port()), chunk_bytes=1000, cluster=cluster)
    contexts = {
        role: client_context(cluster, role) for role in ("generator", "learner", "observer")
    }
    contexts["none"] = zmq.Context()  # no credentials at all
    contexts["wrong"] = zmq.Context()  # a generator with a password of another run
    contexts["wrong"].setsockopt(zmq.PLAIN_USERNAME, b"generator")
    contexts["wrong"].setsockopt(zmq.PLAIN_PASSWORD, b"0" * 64)
    try:
        sent = state()
        publisher.publish(sent, version=1)
        assert fetched_exactly(contexts["generator"], publisher.endpoint, sent)

        for role in ("learner", "observer"):
            client = WeightClient(contexts[role], publisher.endpoint, timeout_s=10.0)
            with pytest.raises(WireError) as refused:
                client.fetch_newer(-1)
            client.close()
            assert refused.value.reason == "forbidden"
            chunk = ask(contexts[role], publisher.endpoint, encode(WeightsChunkRequest(1, 0)))
            assert chunk.reason == "forbidden"
        for stranger in ("none", "wrong"):
            sock = client_socket(contexts[stranger], publisher.endpoint, timeout_s=1.0)
            sock.send_multipart(encode(WeightsRequest(-1)))
            assert sock.poll(REFUSED_WAIT_MS) == 0  # never heard: the handshake failed
            sock.close(linger=0)

        wait_until(lambda: publisher.stats().get("weights_refused_auth_total", 0) >= 1, 20.0)
        stats = publisher.stats()
        assert stats["weights_rejected_forbidden_total"] == 4
        assert stats["weights_manifests_sent_total"] == 1  # the generator's alone
        assert stats["weights_transfers_finished_total"] == 1
        forbidden = [r for r in caplog.records if "(forbidden)" in r.getMessage()]
        assert len(forbidden) == 1  # the first; the others are only counted
        assert fetched_exactly(contexts["generator"], publisher.endpoint, sent)
    finally:
        publisher.close()
        for context in contexts.values():
            context.destroy(linger=0)


def test_a_message_without_a_role_is_refused_when_authentication_is_on(cluster, monkeypatch):
    monkeypatch.setattr(zmq_server, "peer_role", lambda frame: None)
    publisher = WeightPublisher(tcp("127.0.0.1", free_port()), chunk_bytes=1000, cluster=cluster)
    generator = client_context(cluster, "generator")
    try:
        publisher.publish(state(), version=1)
        reply = ask(generator, publisher.endpoint, encode(WeightsRequest(-1)))
        assert reply.reason == "no_role"
        assert publisher.stats()["weights_rejected_no_role_total"] == 1
        assert "weights_manifests_sent_total" not in publisher.stats()
    finally:
        publisher.close()
        generator.destroy(linger=0)


# --------------------------------------------------------------------------
# counters and the log


def test_stats_count_every_refusal_and_the_log_says_it_once_per_interval(
    publisher, context, caplog
):
    caplog.set_level(logging.WARNING, logger="asyncrl.weights")
    publisher.publish(state(), version=1)
    oversized = [b"\x81" + b"x" * 5000]
    for _ in range(30):
        assert ask(context, publisher.endpoint, oversized).reason == "oversized"
    assert ask(context, publisher.endpoint, [b"not msgpack"]).reason == "bad_header"
    assert fetched_exactly(context, publisher.endpoint, state())

    stats = publisher.stats()
    assert stats["weights_rejected_oversized_total"] == 30
    assert stats["weights_rejected_bad_header_total"] == 1
    assert stats["weights_published_total"] == 1
    assert stats["weights_manifests_sent_total"] == 1
    assert stats["weights_chunks_sent_total"] == stats["weights_transfers_finished_total"] * 9
    assert stats["weights_peers_served"] + stats["weights_peers_waiting"] >= 0
    assert all(isinstance(value, float) for value in stats.values())
    assert "weights_refused_auth_total" not in stats  # authentication is off here
    lines = [r.getMessage() for r in caplog.records if r.name == "asyncrl.weights"]
    assert len(lines) == 2, lines  # one per reason
    assert "refused 1 request(s) (oversized)" in lines[0]

    publisher._rejections.interval_s = 0.0  # the interval is over: the next line counts all
    assert ask(context, publisher.endpoint, oversized).reason == "oversized"
    lines = [r.getMessage() for r in caplog.records if r.name == "asyncrl.weights"]
    assert "refused 30 request(s) (oversized)" in lines[-1]


def test_a_client_window_beyond_what_the_server_holds_for_a_peer_is_refused(context):
    with pytest.raises(ValueError, match="window"):
        WeightClient(context, "tcp://127.0.0.1:1", window=weights.MAX_WINDOW + 1)


def test_a_client_with_the_widest_window_is_served_through_the_per_peer_cap(context):
    """Its requests beyond the cap wait in the server and are served as replies drain."""
    publisher = WeightPublisher(tcp("127.0.0.1", free_port()), chunk_bytes=1000)
    client = WeightClient(context, publisher.endpoint, timeout_s=10.0, window=weights.MAX_WINDOW)
    try:
        sent = {"w": torch.randn(100, 100)}  # 40 chunks
        publisher.publish(sent, version=1)
        _, _, received = client.fetch_newer(-1)
        assert torch.equal(received["w"], sent["w"])
        assert publisher.peak_peer_in_flight <= weights.PEER_MAX_CHUNKS
        assert publisher.stats()["weights_transfers_finished_total"] == 1
    finally:
        client.close()
        publisher.close()
