"""Peer authentication over real sockets: every peer proves it belongs to the run, on
loopback too, and the server learns each peer's role from its credentials.

A ROUTER socket secured with the run's credentials (PLAIN with a password per
role on loopback, CURVE when asked) is sent one message by each peer; the role
the server reads from the message must be the one the peer holds credentials
for, and a peer without them, or posing as another role, is never heard. The
test process holds every role's credentials (it plays them all); an impostor
gets only what a generator is given.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from asyncrl.config import ClusterConfig
from asyncrl.core.keys_folder import hold_every_role, provision
from asyncrl.core.security import client_context, generate_keys, peer_role, secure_server

pytestmark = pytest.mark.timeout(120)
REFUSED_WAIT_MS = 1000
"""How long to wait for a message that must not come."""
EXPECTED_WAIT_MS = 30_000
"""How long to wait for a message that must come (a CURVE handshake and the ZAP
handler's answer; seconds on a machine busy with other tests' processes)."""


@pytest.fixture(params=["plain", "curve"])
def cluster(request, tmp_path) -> ClusterConfig:
    if request.param == "plain":
        cluster = ClusterConfig(keys_dir=str(tmp_path / "keys"))
    else:
        generate_keys(tmp_path)
        cluster = ClusterConfig(keys_dir=str(tmp_path / "keys"), curve=True)
    hold_every_role(cluster)
    return cluster


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


@pytest.fixture
def clients() -> Iterator[list[zmq.Context]]:
    """The clients' contexts a test makes, destroyed with their sockets when it ends, failed
    or not: left to the garbage collector, a context whose sockets' weak references were
    already cleared would wait on them forever in ``term()``, in whichever later test
    the collection happens, where no test timeout can stop it."""
    made: list[zmq.Context] = []
    yield made
    for context in made:
        context.destroy(linger=0)


def send_from(
    context: zmq.Context, endpoint: str, payload: bytes, *, refused: bool = False
) -> zmq.Socket:
    """Send one message from a new socket of ``context``. Keep the socket until the test
    ends: closed, it would drop the message before the handshake. No linger, so a
    message that can never be delivered does not hold up ``context.destroy()``.

    A ``refused`` peer's handshake fails, and once it has, its socket may have no pipe
    left to queue on: its send would block for ever, so it is tried once without
    blocking (a message it cannot even queue is not heard either). Any other send
    must be queued within ``EXPECTED_WAIT_MS``."""
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.SNDTIMEO, EXPECTED_WAIT_MS)
    socket.connect(endpoint)
    if refused:
        with contextlib.suppress(zmq.Again):
            socket.send(payload, zmq.NOBLOCK)
    else:
        socket.send(payload)
    return socket


def heard(server_socket: zmq.Socket, expected: int = 0) -> list[tuple[bytes, str | None]]:
    """What the server receives, as (payload, the sender's role): waits up to
    ``EXPECTED_WAIT_MS`` for each of the ``expected`` messages (a handshake on a busy
    machine), then ``REFUSED_WAIT_MS`` for any that must not come."""
    got = []
    while server_socket.poll(EXPECTED_WAIT_MS if len(got) < expected else REFUSED_WAIT_MS):
        _identity, payload = server_socket.recv_multipart(copy=False)
        got.append((payload.bytes, peer_role(payload)))
    return got


def refusals_counted(auth) -> int:
    """The refusals the ZAP handler counted, once it counted any (it runs in its own
    thread; a refused client may retry the handshake, so there may be several)."""
    deadline = time.monotonic() + EXPECTED_WAIT_MS / 1000
    while not auth.refused and time.monotonic() < deadline:
        time.sleep(0.05)
    return auth.refused


def test_each_role_is_named_by_the_credentials_it_holds(cluster, server, clients):
    socket, endpoint, _ = server
    kept = []
    for role in ("learner", "generator"):
        clients.append(client_context(cluster, role))
        kept.append(send_from(clients[-1], endpoint, role.encode()))
    assert sorted(heard(socket, 2)) == [(b"generator", "generator"), (b"learner", "learner")]


def test_a_peer_without_the_run_s_credentials_is_never_heard(cluster, server, clients):
    socket, endpoint, auth = server
    stranger, guesser = zmq.Context(), zmq.Context()
    clients += [stranger, guesser]
    kept = [send_from(stranger, endpoint, b"plain zeromq", refused=True)]
    guesser.setsockopt(zmq.PLAIN_USERNAME, b"learner")
    guesser.setsockopt(zmq.PLAIN_PASSWORD, b"0" * 64)
    kept.append(send_from(guesser, endpoint, b"a guessed password", refused=True))
    assert heard(socket) == []
    if not cluster.uses_curve:  # the guess reached the ZAP handler and was counted
        assert refusals_counted(auth)
    # and the run's own peer is still served
    clients.append(client_context(cluster, "generator"))
    kept.append(send_from(clients[-1], endpoint, b"still here"))
    assert heard(socket, 1) == [(b"still here", "generator")], f"refused: {auth.refused}"


def generator_s_guesses(cluster: ClusterConfig, generator) -> set[bytes]:
    """Every learner password a generator could try: what it is handed, what the keys
    folder holds, and what the old scheme derived from them (``HMAC(secret, role)``)."""
    found = {generator.passwords["generator"].encode()}
    found |= {path.read_bytes().strip() for path in Path(cluster.keys_dir).iterdir()}
    derived = {
        hmac.new(secret, b"learner", hashlib.sha256).hexdigest().encode() for secret in found
    }
    return found | derived


def test_a_generator_cannot_log_in_as_the_learner(tmp_path, clients):
    cluster = ClusterConfig(keys_dir=str(tmp_path / "keys"))
    run = provision(cluster)  # held by no one here: the server gets the buffer's share
    context = zmq.Context()
    socket = context.socket(zmq.ROUTER)
    auth = secure_server(context, socket, cluster, run.for_role("buffer"))
    endpoint = f"tcp://127.0.0.1:{socket.bind_to_random_port('tcp://127.0.0.1')}"
    guesses = generator_s_guesses(cluster, run.for_role("generator"))
    kept = []
    try:
        for guess in guesses:
            impostor = zmq.Context()
            clients.append(impostor)
            impostor.setsockopt(zmq.PLAIN_USERNAME, b"learner")
            impostor.setsockopt(zmq.PLAIN_PASSWORD, guess)
            kept.append(send_from(impostor, endpoint, b"BatchRequest", refused=True))
        assert heard(socket) == []
        assert refusals_counted(auth)
        # the generator's own credentials still log it in, as a generator
        clients.append(client_context(cluster, "generator", run.for_role("generator")))
        kept.append(send_from(clients[-1], endpoint, b"WorkRequest"))
        assert heard(socket, 1) == [(b"WorkRequest", "generator")]
    finally:
        socket.close(linger=0)
        auth.stop()
        context.term()
