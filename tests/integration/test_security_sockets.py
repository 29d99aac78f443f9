"""CURVE endpoints over real sockets: the run's clients are served, any other peer is refused.

Each server (the weights publisher, the buffer service) is checked against
three peers: one with the run's keys, one speaking plain ZeroMQ, and one that
knows the server's public key but holds a client key of its own. Only the
first gets replies; the server goes on serving it after refusing the others.
The test process holds every role's credentials (it plays them all); a
generator machine holds only the files docs/security.md says to copy to it,
and cannot act as the learner with them.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import zmq
from zmq.auth.thread import AuthenticationThread

from asyncrl.config import ClusterConfig, load_config
from asyncrl.core.keys_folder import hold_every_role
from asyncrl.core.messages import (
    BatchRequest,
    ErrorReply,
    WeightsRequest,
    WireError,
    WorkGrant,
    WorkRequest,
    decode,
    encode,
)
from asyncrl.core.security import CurveKeys, SecurityError, client_context, generate_keys
from asyncrl.core.transport import client_socket, free_port, tcp
from asyncrl.weights import WeightClient, WeightPublisher
from tests.helpers.running_buffer import RunningBuffer

pytestmark = pytest.mark.timeout(60)

QUICKSTART = Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml"
REFUSED_WAIT_MS = 1000
"""How long a refused peer waits for the reply that must not come."""


@pytest.fixture
def keys(tmp_path) -> CurveKeys:
    """The run's keys, and every role's credentials held here (the learner's new)."""
    directory = generate_keys(tmp_path / "run")
    hold_every_role(ClusterConfig(keys_dir=str(directory), curve=True))
    return CurveKeys(directory)


@pytest.fixture
def stranger_keys(tmp_path, keys) -> CurveKeys:
    """Keys of another run, except the server's public key, which it knows."""
    stranger = generate_keys(tmp_path / "stranger")
    shutil.copy(keys.directory / "server.key", stranger / "server.key")
    return CurveKeys(stranger)


def no_reply(context: zmq.Context, endpoint: str, body) -> bool:
    """Send ``body`` from a fresh socket of ``context``; True if nothing comes back."""
    sock = client_socket(context, endpoint, timeout_s=REFUSED_WAIT_MS / 1000)
    try:
        sock.send_multipart(encode(body))
        return sock.poll(REFUSED_WAIT_MS) == 0
    finally:
        sock.close(linger=0)


def wait_for_refusal(caplog, timeout_s: float = 10.0) -> None:
    """The server's ZAP handler logs the stranger's key (a handshake, so not instant)."""
    deadline = time.monotonic() + timeout_s
    while not any("refused a peer" in record.getMessage() for record in caplog.records):
        assert time.monotonic() < deadline, "the server never refused the stranger's key"
        time.sleep(0.05)


def authenticators_alive() -> int:
    return sum(isinstance(thread, AuthenticationThread) for thread in threading.enumerate())


@pytest.fixture
def curve_contexts(keys, stranger_keys) -> Iterator[dict[str, zmq.Context]]:
    """Clients of the weights endpoint: the run's generator and learner, a plain ZeroMQ
    peer, and a generator of another run that knows the server's public key."""
    run = ClusterConfig(keys_dir=str(keys.directory), curve=True)
    stranger = ClusterConfig(keys_dir=str(stranger_keys.directory), curve=True)
    made = {
        "generator": client_context(run, "generator"),
        "learner": client_context(run, "learner"),
        "plain": zmq.Context(),
        "stranger": client_context(stranger, "generator"),
    }
    yield made
    for context in made.values():
        context.destroy(linger=0)


def test_weights_reach_only_the_run_s_clients(curve_contexts, keys, caplog):
    caplog.set_level(logging.WARNING, logger="asyncrl.security")
    contexts = curve_contexts
    cluster = ClusterConfig(keys_dir=str(keys.directory), curve=True)
    publisher = WeightPublisher(tcp("127.0.0.1", free_port()), chunk_bytes=64, cluster=cluster)
    client = WeightClient(contexts["generator"], publisher.endpoint, timeout_s=10.0)
    try:
        state = {"w": torch.arange(40, dtype=torch.float32)}
        publisher.publish(state, version=0)
        version, _, fetched = client.fetch_newer(-1)
        assert version == 0
        assert torch.equal(fetched["w"], state["w"])

        assert no_reply(contexts["plain"], publisher.endpoint, WeightsRequest(-1))
        assert no_reply(contexts["stranger"], publisher.endpoint, WeightsRequest(-1))
        wait_for_refusal(caplog)
        assert publisher.served["manifests_sent"] == 1  # neither peer got as far as a request
        assert publisher.stats()["weights_refused_auth_total"] >= 1
        # the learner is the run's, but weights are for generators
        learner = WeightClient(contexts["learner"], publisher.endpoint, timeout_s=10.0)
        with pytest.raises(WireError, match="forbidden"):
            learner.fetch_newer(-1)
        learner.close()
        assert publisher.served["manifests_sent"] == 1

        publisher.publish({"w": state["w"] * 2}, version=1)
        version, _, fetched = client.fetch_newer(0)
        assert version == 1
        assert torch.equal(fetched["w"], state["w"] * 2)
    finally:
        client.close()
        publisher.close()
    assert authenticators_alive() == 0


@contextlib.contextmanager
def running_buffer(keys: CurveKeys) -> Iterator[RunningBuffer]:
    # bind 0.0.0.0 turns CURVE on (auto); RunningBuffer itself listens on 127.0.0.1 only
    config = load_config(
        QUICKSTART,
        [
            "cluster.bind=0.0.0.0",
            f"cluster.keys_dir={keys.directory}",
            f"cluster.buffer_port={free_port()}",
        ],
    )
    running = RunningBuffer(config).start()
    try:
        yield running
    finally:
        running.stop()
    assert running.error is None, running.error


def test_the_buffer_answers_only_the_run_s_clients(curve_contexts, keys, caplog):
    caplog.set_level(logging.WARNING, logger="asyncrl.security")
    contexts = curve_contexts
    with running_buffer(keys) as buffer:
        generator = client_socket(contexts["generator"], buffer.endpoint, timeout_s=10.0)
        try:
            generator.send_multipart(encode(WorkRequest("gen-0", max_samples=8)))
            grant, _ = decode(generator.recv_multipart())
            assert isinstance(grant, WorkGrant) and grant.items

            assert no_reply(contexts["plain"], buffer.endpoint, WorkRequest("plain", 8))
            assert no_reply(contexts["stranger"], buffer.endpoint, WorkRequest("stranger", 8))
            wait_for_refusal(caplog)
            assert set(buffer.store.last_seen) == {"gen-0"}  # the others never reached it

            generator.send_multipart(encode(WorkRequest("gen-0", max_samples=8)))
            grant, _ = decode(generator.recv_multipart())
            assert isinstance(grant, WorkGrant)
        finally:
            generator.close(linger=0)
    assert authenticators_alive() == 0


GENERATOR_MACHINE_FILES = ("server.key", "client.key", "client.key_secret", "group.key")
"""What docs/security.md (Multi-node: copying the keys) says a generator machine gets."""


def test_a_generator_machine_s_keys_cannot_act_as_the_learner(keys, tmp_path):
    machine = tmp_path / "generator-machine"
    machine.mkdir(mode=0o700)
    for name in GENERATOR_MACHINE_FILES:
        shutil.copy(keys.directory / name, machine / name)
    there = ClusterConfig(keys_dir=str(machine), curve=True)  # held by no one: only files
    with pytest.raises(SecurityError, match="handed to the learner process alone"):
        client_context(there, "learner")
    assert not any("learner" in path.name for path in keys.directory.iterdir())
    generator = client_context(there, "generator")
    with running_buffer(keys) as buffer:
        sock = client_socket(generator, buffer.endpoint, timeout_s=10.0)
        try:  # admitted, as a generator: a learner's request is refused and counted
            sock.send_multipart(encode(BatchRequest(policy_version=0)))
            reply, _ = decode(sock.recv_multipart())
            assert isinstance(reply, ErrorReply) and reply.reason == "forbidden"
            assert buffer.service.rejected["forbidden"] == 1
        finally:
            sock.close(linger=0)
            generator.destroy(linger=0)
