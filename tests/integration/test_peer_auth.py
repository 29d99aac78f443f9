"""Peer authentication over real sockets: every peer proves it belongs to the run, on
loopback too, and the server learns each peer's role from its credentials.

A ROUTER socket secured with the run's credentials (PLAIN with the per-run secret
on loopback, CURVE when asked) is sent one message by each peer; the role the
server reads from the message must be the one the peer holds credentials for,
and a peer without them, or posing as another role, is never heard.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import zmq

from asyncrl.config import ClusterConfig
from asyncrl.security import (
    RUN_SECRET,
    RunSecret,
    client_context,
    generate_keys,
    generate_run_secret,
    peer_role,
    role_password,
    secure_server,
)

pytestmark = pytest.mark.timeout(60)
REFUSED_WAIT_MS = 1000


@pytest.fixture(params=["plain", "curve"])
def cluster(request, tmp_path) -> ClusterConfig:
    if request.param == "plain":
        generate_run_secret(tmp_path / "keys")
        return ClusterConfig(keys_dir=str(tmp_path / "keys"))
    generate_keys(tmp_path)
    return ClusterConfig(keys_dir=str(tmp_path / "keys"), curve=True)


@pytest.fixture
def server(cluster) -> Iterator[tuple[zmq.Socket, str, object]]:
    context = zmq.Context()
    socket = context.socket(zmq.ROUTER)
    auth = secure_server(context, socket, cluster)
    port = socket.bind_to_random_port("tcp://127.0.0.1")
    yield socket, f"tcp://127.0.0.1:{port}", auth
    socket.close(linger=0)
    auth.stop()
    context.term()


def send_from(context: zmq.Context, endpoint: str, payload: bytes) -> None:
    """Send one message from a new socket of ``context``, kept open until the context is
    destroyed (a closed socket would drop it before the handshake)."""
    socket = context.socket(zmq.DEALER)
    socket.connect(endpoint)
    socket.send(payload)


def heard(server_socket: zmq.Socket) -> list[tuple[bytes, str | None]]:
    """Every message the server receives within the wait: (payload, the sender's role)."""
    got = []
    while server_socket.poll(REFUSED_WAIT_MS):
        _identity, payload = server_socket.recv_multipart(copy=False)
        got.append((payload.bytes, peer_role(payload)))
    return got


def test_each_role_is_named_by_the_credentials_it_holds(cluster, server):
    socket, endpoint, _ = server
    contexts = {role: client_context(cluster, role) for role in ("learner", "generator")}
    for role, context in contexts.items():
        send_from(context, endpoint, role.encode())
    assert sorted(heard(socket)) == [(b"generator", "generator"), (b"learner", "learner")]
    for context in contexts.values():
        context.destroy(linger=0)


def test_a_peer_without_the_run_s_credentials_is_never_heard(cluster, server):
    socket, endpoint, auth = server
    stranger = zmq.Context()
    send_from(stranger, endpoint, b"plain zeromq")
    guesser = zmq.Context()
    guesser.setsockopt(zmq.PLAIN_USERNAME, b"learner")
    guesser.setsockopt(zmq.PLAIN_PASSWORD, b"0" * 64)
    send_from(guesser, endpoint, b"a guessed password")
    assert heard(socket) == []
    if not cluster.uses_curve:  # the guess reached the ZAP handler and was counted
        assert auth.refused == 1
    # and the run's own peer is still served
    own = client_context(cluster, "generator")
    send_from(own, endpoint, b"still here")
    assert heard(socket) == [(b"still here", "generator")]
    for context in (stranger, guesser, own):
        context.destroy(linger=0)


def test_a_generator_cannot_log_in_as_the_learner(tmp_path):
    generate_run_secret(tmp_path / "keys")
    cluster = ClusterConfig(keys_dir=str(tmp_path / "keys"))
    context = zmq.Context()
    socket = context.socket(zmq.ROUTER)
    auth = secure_server(context, socket, cluster)
    endpoint = f"tcp://127.0.0.1:{socket.bind_to_random_port('tcp://127.0.0.1')}"
    # a generator knows its own password, not the secret: it can only claim a name
    generator_password = role_password(
        RunSecret(tmp_path / "keys" / RUN_SECRET).load(), "generator"
    )
    impostor = zmq.Context()
    impostor.setsockopt(zmq.PLAIN_USERNAME, b"learner")
    impostor.setsockopt(zmq.PLAIN_PASSWORD, generator_password)
    send_from(impostor, endpoint, b"BatchRequest")
    try:
        assert heard(socket) == []
        assert auth.refused == 1
    finally:
        impostor.destroy(linger=0)
        socket.close(linger=0)
        auth.stop()
        context.term()
