"""A replica's turn of the loop costs one round trip, not three.

Across a link with latency every round trip is paid in full: handing in samples
(Trajectories, then its Ack), asking for work (WorkRequest, then its grant) and
looking for newer weights (a request to the weights server) used to be three in a
row. Now the samples' Ack is read only before the next reply, and the weights are
looked for while the buffer answers the work request: the buffer's answers arrive
together, after one round trip.
"""

from __future__ import annotations

import zmq

from asyncrl.config import load_config
from asyncrl.core.messages import Ack, Leave, Trajectories, WorkGrant, WorkRequest
from asyncrl.generation.tasks import build_tokenizer
from asyncrl.generators.worker import GeneratorReplica
from tests.helpers.generators import ScriptedBackend, finished_rollout


class OrderedBuffer:
    """Answers each message in order, as the buffer does; records sends and reads."""

    endpoint = "recording://buffer"
    timeout_s = 5.0

    def __init__(self, events: list[str]):
        self.events = events
        self.owed: list[object] = []

    def send(self, body, arrays=None):
        self.events.append(f"send {type(body).__name__}")
        if isinstance(body, Trajectories):
            self.owed.append(Ack(accepted=len(body.samples)))
        elif isinstance(body, WorkRequest):
            self.owed.append(WorkGrant([], policy_version=0))
        elif isinstance(body, Leave):
            self.owed.append(Ack(accepted=0))

    def receive(self, timeout_s=None):
        reply = self.owed.pop(0)
        self.events.append(f"read {type(reply).__name__}")
        return reply, {}

    def request(self, body, arrays=None, timeout_s=None):
        self.send(body, arrays)
        return self.receive(timeout_s)


class RecordingWeights:
    def __init__(self, events: list[str]):
        self.events = events

    def fetch_newer(self, have_version: int):
        self.events.append("look for weights")
        return None


def test_samples_work_and_weights_go_out_before_any_answer_is_awaited():
    events: list[str] = []
    config = load_config(None, ["model.tiny={}", "algorithm.group_size=2"])
    context = zmq.Context()
    replica = GeneratorReplica(
        config, "gen-0", ScriptedBackend(build_tokenizer()), context, "default",
        OrderedBuffer(events), "tcp://127.0.0.1:9", run_dir=None,
    )  # fmt: skip
    replica.weights.socket.close(linger=0)
    replica.weights = RecordingWeights(events)
    try:
        replica.send([finished_rollout(replica, 0), finished_rollout(replica, 1)], wait_s=60)
        replica.active = [finished_rollout(replica, 2)]  # still generating: the request is not held
        grant = replica.ask_for_work(room=4)
        assert isinstance(grant, WorkGrant) and replica.weights_checked
        assert events == [
            "send Trajectories",
            "send WorkRequest",
            "look for weights",  # while the buffer answers
            "read Ack",  # the samples' answer, read only now
            "read WorkGrant",
        ]
        assert replica.stats["samples_sent"] == 2 and replica.link.unanswered == 0

        events.clear()
        replica.send([finished_rollout(replica, 3)], wait_s=60)
        replica.close()  # Leave: the Ack still owed is read on the way
        assert events == ["send Trajectories", "send Leave", "read Ack", "read Ack"]
    finally:
        replica.scorer.close()
        context.term()
