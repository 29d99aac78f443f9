"""No unbounded message, before or after login: the buffer's and the weights server's sockets.

A real BufferService (a thread) and WeightPublisher over TCP with authentication
on. A stranger is a raw TCP socket that speaks the first bytes of ZMTP
(:mod:`zmtp_stranger`); an insider holds a generator's credentials. Each test
drives one attack that used to cost the server memory without bound, and checks
that it is refused, counted in the server's metrics, and that the run's own peers
go on being served. Memory figures, with the buffer in its own process, are in
``test_socket_limits_memory.py``.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import zmq

from asyncrl.config import ClusterConfig
from asyncrl.core.message_limits import MIN_UNAUTHENTICATED, buffer_guard_limits
from asyncrl.core.messages import Status, StatusRequest, WeightsRequest, encode
from asyncrl.core.security import GENERATOR, client_context
from asyncrl.core.transport import client_socket, free_port, tcp
from asyncrl.weights import WeightClient, WeightPublisher
from asyncrl.weights.zmq.limits import FRAME_MAX_BYTES, HELD_BYTES, guard_limits
from tests.helpers.buffer_wire import Peers, buffer_config, exchange, fresh_keys_dir
from tests.helpers.running_buffer import RunningBuffer, running_buffer
from tests.helpers.waiting import wait_until
from tests.helpers.zmtp_stranger import Stranger, closed_by_server, endless_message, plain_login

pytestmark = pytest.mark.timeout(120)

REPLY_TIMEOUT_S = 10.0
NO_REPLY_MS = 1000


@pytest.fixture
def buffer(peers) -> Iterator[RunningBuffer]:
    """A buffer already listening (raw sockets do not retry as ZeroMQ's do)."""
    with running_buffer(buffer_config(group_size=4)) as running:
        buffer_stats(running, peers)
        yield running


def buffer_stats(buffer: RunningBuffer, peers: Peers) -> dict[str, float]:
    """The buffer's metrics, as ``asyncrl status`` reads them (a fresh connection each time)."""
    sock = peers.observer(buffer, REPLY_TIMEOUT_S)
    try:
        status = exchange(sock, StatusRequest())
    finally:
        sock.close(linger=0)
    assert isinstance(status, Status), status
    return status.stats


def counted(buffer: RunningBuffer, peers: Peers, what: str) -> float:
    """One of the buffer's ``buffer_connections_<what>`` counters."""
    return buffer_stats(buffer, peers)[f"buffer_connections_{what}"]


def credentials(context: zmq.Context) -> tuple[bytes, bytes]:
    """The PLAIN user name and password ``context``'s sockets log in with."""
    sock = context.socket(zmq.DEALER)
    try:
        return sock.getsockopt(zmq.PLAIN_USERNAME), sock.getsockopt(zmq.PLAIN_PASSWORD)
    finally:
        sock.close(linger=0)


def port_of(endpoint: str) -> int:
    return int(endpoint.rsplit(":", 1)[1])


# ------------------------------------------------------------------ the buffer


def test_a_stranger_declaring_a_huge_handshake_command_is_dropped_before_it_is_read(buffer, peers):
    """N1: a greeting, then a command declaring 1 GiB: closed at its header, before the
    64 MiB that follow are taken (the kernel's socket buffers take a few MB)."""
    stranger = Stranger(port_of(buffer.endpoint), declared=1 << 30)
    try:
        taken = stranger.stream(64 << 20)
        assert stranger.closed_by_server()
        assert taken < 16 << 20, f"the buffer took {taken >> 20} MiB of a stranger's command"
    finally:
        stranger.close()
    # serving still: a status request is answered (not its gauge of open connections,
    # which can be read before the guard has recorded the observer's own connection)
    assert "buffer_connections_open" in buffer_stats(buffer, peers)


def test_connections_in_their_handshake_are_bounded_and_the_oldest_shut(buffer, peers):
    """Strangers each holding half a command (under the frame cap): beyond the limit the
    oldest are shut, counted; the newest stay; the run's peers go on being served."""
    limit = buffer_guard_limits(buffer.config).unauthenticated
    strangers = [Stranger(port_of(buffer.endpoint), declared=1 << 20) for _ in range(limit + 40)]
    try:
        for stranger in strangers:
            stranger.stream(256 << 10)
        # before the handshake timeout (10 s), on a loaded machine too: shut for their
        # number, not their age (the refusal counter below says which)
        assert all(stranger.closed_by_server(within_s=9) for stranger in strangers[:40])
        assert not strangers[-1].closed_by_server(within_s=0.2)  # the newest stay
        # the gauge drops as the guard reaps each shut connection (on a loaded machine
        # a moment after the peer saw it shut)
        wait_until(
            lambda: buffer_stats(buffer, peers)["buffer_connections_unauthenticated"] <= limit
        )
        assert buffer_stats(buffer, peers)["buffer_connections_refused_unauthenticated"] >= 40
        generator = peers.generator(buffer, REPLY_TIMEOUT_S)
        assert isinstance(exchange(generator, StatusRequest()), Status)
    finally:
        for stranger in strangers:
            stranger.close()


def test_an_authenticated_peer_s_oversized_frame_drops_its_connection_unread(buffer, peers):
    """N3: a generator's credentials and a 16 MiB frame: libzmq drops the connection at
    the frame's header (no reply, nothing buffered), counted; the peer reconnects."""
    generator = peers.generator(buffer, REPLY_TIMEOUT_S)
    assert isinstance(exchange(generator, StatusRequest()), Status)  # past the handshake
    generator.send_multipart([encode(StatusRequest())[0], bytes(16 << 20)])
    assert generator.poll(NO_REPLY_MS) == 0  # no reply: the frame was never taken
    wait_until(lambda: counted(buffer, peers, "dropped_after_login") == 1)
    assert isinstance(exchange(generator, StatusRequest()), Status)  # reconnected, served


def test_a_message_of_endless_frames_from_an_authenticated_peer_is_cut(buffer, peers):
    """libzmq keeps a multipart message whole until its last frame, however many: a
    generator's credentials and frames that never end are cut once they exceed
    ``held_bytes``, counted; nothing is decoded, and the buffer serves on."""
    held = buffer_guard_limits(buffer.config).held_bytes
    insider = plain_login(
        port_of(buffer.endpoint), *credentials(peers.context(buffer.config, GENERATOR))
    )
    try:
        endless_message(insider, frame_bytes=100, total_bytes=4 * held)
        assert closed_by_server(insider)
        wait_until(lambda: counted(buffer, peers, "dropped_held_bytes") == 1)
    finally:
        insider.close()
    assert counted(buffer, peers, "dropped_after_login") == 0  # counted once, as cut
    assert isinstance(exchange(peers.generator(buffer), StatusRequest()), Status)


def test_every_peer_of_the_run_reconnecting_at_once_is_served_none_refused(buffer, peers):
    """The bound never cuts the run's own peers: twice the connections its replicas, the
    learner and observers open, all at once, are all answered and none is refused."""
    count = buffer_guard_limits(buffer.config).unauthenticated - MIN_UNAUTHENTICATED
    sockets = [peers.observer(buffer, REPLY_TIMEOUT_S) for _ in range(count)]
    for sock in sockets:
        sock.send_multipart(encode(StatusRequest()))
    for sock in sockets:
        assert sock.poll(int(REPLY_TIMEOUT_S * 1000)), "a peer of the run was not answered"
        sock.recv_multipart()
    assert counted(buffer, peers, "refused_unauthenticated") == 0


# ------------------------------------------------------------------ the weights server


@pytest.fixture
def cluster() -> ClusterConfig:
    return ClusterConfig(keys_dir=str(fresh_keys_dir()))


def test_the_weights_server_bounds_strangers_frames_and_held_bytes(cluster):
    """The same limits on the learner's weights server: strangers in their handshake
    beyond the limit shut, a frame over the cap and endless frames from a generator's
    credentials dropped, all counted; a generator still gets the weights."""
    publisher = WeightPublisher(tcp("127.0.0.1", free_port()), chunk_bytes=1000, cluster=cluster)
    context = client_context(cluster, GENERATOR)
    limit = guard_limits(replicas=1).unauthenticated
    strangers = [
        Stranger(port_of(publisher.endpoint), declared=32 << 10) for _ in range(limit + 10)
    ]
    try:
        for stranger in strangers:
            stranger.stream(16 << 10)
        assert all(stranger.closed_by_server(within_s=5) for stranger in strangers[:10])
        stats = publisher.stats
        wait_until(lambda: stats()["weights_connections_refused_unauthenticated_total"] >= 10)
        assert stats()["weights_connections_unauthenticated"] <= limit

        oversized = client_socket(context, publisher.endpoint, timeout_s=REPLY_TIMEOUT_S)
        oversized.send_multipart(encode(WeightsRequest(-1)))
        assert oversized.poll(int(REPLY_TIMEOUT_S * 1000))  # connected, past the handshake
        oversized.recv_multipart()
        oversized.send(bytes(2 * FRAME_MAX_BYTES))
        # at least once: the client's ZeroMQ reconnects and may send the frame again
        wait_until(lambda: stats()["weights_connections_dropped_after_login_total"] >= 1)
        oversized.close(linger=0)

        endless = plain_login(port_of(publisher.endpoint), *credentials(context))
        endless_message(endless, frame_bytes=100, total_bytes=4 * HELD_BYTES)
        assert closed_by_server(endless)
        wait_until(lambda: stats()["weights_connections_dropped_held_bytes_total"] == 1)
        endless.close()

        sent = {"w": torch.arange(600, dtype=torch.float32)}
        publisher.publish(sent, version=1)
        client = WeightClient(context, publisher.endpoint, timeout_s=REPLY_TIMEOUT_S)
        update = client.fetch_newer(-1)
        client.close()
        assert update is not None and torch.equal(update[2]["w"], sent["w"])
    finally:
        for stranger in strangers:
            stranger.close()
        publisher.close()
        context.destroy(linger=0)
