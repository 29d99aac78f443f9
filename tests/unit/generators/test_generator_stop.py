"""A stopping replica does not wait out its client's timeout on a dead buffer."""

from __future__ import annotations

import pytest
import zmq

from asyncrl.config import load_config
from asyncrl.generation.tasks import build_tokenizer
from asyncrl.generators.buffer_link import LEAVE_TIMEOUT_S, STOP_POLL_S
from asyncrl.generators.worker import GeneratorReplica
from tests.helpers.generators import NoNewWeights, ScriptedBackend


class DeadBuffer:
    """Never answers; counts the seconds a caller would have waited on it."""

    endpoint = "tcp://127.0.0.1:9"
    timeout_s = 3600.0

    def __init__(self):
        self.waited_s = 0.0

    def send(self, body, arrays=None):
        pass

    def receive(self, timeout_s=None):
        self.waited_s += self.timeout_s if timeout_s is None else timeout_s
        raise TimeoutError("no reply")

    def request(self, body, arrays=None, timeout_s=None):
        return self.receive(timeout_s)


@pytest.fixture
def replica():
    config = load_config(None, ["model.tiny={}", "algorithm.group_size=2"])
    context = zmq.Context()
    buffer = DeadBuffer()
    replica = GeneratorReplica(
        config, "gen-0", ScriptedBackend(build_tokenizer()), context, "default", buffer,
        "tcp://127.0.0.1:9",
    )  # fmt: skip
    replica.weights.socket.close(linger=0)
    replica.weights = NoNewWeights()  # looked for while the buffer answers a busy request
    yield replica
    replica.scorer.close()
    context.term()


def test_a_stopping_replica_gives_up_on_a_dead_buffer_after_the_leave_timeout(replica):
    replica.active = [object()]  # busy: it asks for work without letting the buffer hold it
    replica.stopping = True
    with pytest.raises(TimeoutError, match="while stopping"):
        replica.ask_for_work(room=4)
    assert replica.buffer.waited_s <= LEAVE_TIMEOUT_S + STOP_POLL_S


def test_a_running_replica_still_waits_its_client_timeout(replica):
    replica.active = [object()]
    with pytest.raises(TimeoutError):
        replica.ask_for_work(room=4)
    assert replica.buffer.waited_s >= replica.buffer.timeout_s
