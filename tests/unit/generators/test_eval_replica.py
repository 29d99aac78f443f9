"""A generator replica generates an eval round's prompts like training ones, one turn
or multi-turn, and sends their samples back tagged with the round.

The replica's real loop runs against a scripted backend and a buffer stand-in
that hands out one eval group and one training group, then nothing.
"""

from __future__ import annotations

import pytest
import zmq

from asyncrl.config import load_config
from asyncrl.generators.worker import GeneratorReplica
from asyncrl.messages import (
    Ack,
    Heartbeat,
    Leave,
    Trajectories,
    TrajectoryMeta,
    WorkGrant,
    WorkItem,
    WorkRequest,
)
from asyncrl.tasks import build_tokenizer
from tests.unit.generators.test_episodes import ScriptedBackend

MESSAGES = [{"role": "user", "content": "123="}]
EVAL_ITEM = WorkItem(-1, 2, [1, 4, 5, 6, 13], "234", "synthetic/digits", {}, MESSAGES, 3)
TRAIN_ITEM = WorkItem(0, 2, [1, 4, 5, 6, 13], "234", "synthetic/digits", {}, MESSAGES)


class ScriptedBuffer:
    """Grants both items once, then empty grants; stops the replica once all 4 samples
    are in. Speaks the RequestClient interface the replica uses."""

    endpoint = "scripted://buffer"
    timeout_s = 5.0

    def __init__(self):
        self.granted = False
        self.replica: GeneratorReplica | None = None
        self.samples: list[TrajectoryMeta] = []
        self.replies: list[object] = []

    def answer(self, body):
        match body:
            case WorkRequest():
                items = [] if self.granted else [EVAL_ITEM, TRAIN_ITEM]
                self.granted = True
                return WorkGrant(items, policy_version=0, retry_after_s=0.0 if items else 0.01)
            case Trajectories(samples=metas):
                self.samples += metas
                if len(self.samples) == 4:
                    assert self.replica is not None
                    self.replica.stopping = True
                return Ack(accepted=len(metas))
            case Heartbeat() | Leave():
                return Ack(accepted=0)
        raise AssertionError(f"unexpected {body!r}")

    def request(self, body, arrays=None, timeout_s=None):
        return self.answer(body), {}

    def send(self, body, arrays=None):
        self.replies.append(self.answer(body))  # answered in order, as the buffer does

    def receive(self, timeout_s=None):
        if not self.replies:
            raise TimeoutError("nothing sent")
        return self.replies.pop(0), {}


class NoNewWeights:
    def fetch_newer(self, have_version: int):
        return None


def run_replica(*overrides: str) -> list[TrajectoryMeta]:
    config = load_config(
        None,
        ["model.tiny={}", "algorithm.group_size=2", "buffer.heartbeat_interval_s=0.05",
         *overrides],
    )  # fmt: skip
    buffer = ScriptedBuffer()
    backend = ScriptedBackend(build_tokenizer(), turn_length=3)
    context = zmq.Context()
    replica = GeneratorReplica(
        config, "gen-0", backend, context, "default", buffer, "tcp://127.0.0.1:9"
    )
    replica.weights.socket.close(linger=0)  # never asked: no newer weights in this test
    replica.weights = NoNewWeights()
    buffer.replica = replica
    try:
        replica.run_loop()
    finally:
        replica.close()
        context.term()
    return buffer.samples


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        [
            "environment.name=tests.unit.generators.test_episodes:CountdownEnv",
            "environment.formatter=plain",
            "environment.kwargs={turns: 2}",
        ],
    ],
    ids=["one turn", "multi-turn"],
)
def test_eval_samples_come_back_tagged_with_their_round_training_ones_untagged(overrides):
    samples = run_replica(*overrides)
    tags = sorted((meta.group_id, meta.sample_index, meta.eval_round) for meta in samples)
    assert tags == [(-1, 0, 3), (-1, 1, 3), (0, 0, -1), (0, 1, -1)]
    by_group = {meta.group_id: meta for meta in samples}
    # the same prompt, the same generation and scoring path: the same result
    assert by_group[-1].response_len == by_group[0].response_len > 0
    assert by_group[-1].reward == by_group[0].reward
