"""A replica sends its finished samples in messages that fit the buffer's frame cap.

The buffer's socket drops a peer that sends a frame over its cap
(``asyncrl.core.message_limits.buffer_frame_limit``), so a replica with more finished
samples than one message may hold splits them: every sample arrives once, and every
frame stays within what the cap was derived from.
"""

from __future__ import annotations

import zmq

from asyncrl.config import load_config
from asyncrl.core.message_limits import (
    GENERATOR_HEADER_BYTES,
    TRAJECTORY_MESSAGE_BYTES,
    buffer_frame_limit,
    sample_bytes,
)
from asyncrl.core.messages import Ack, Trajectories, encode
from asyncrl.generation.tasks import build_tokenizer
from asyncrl.generators.worker import GeneratorReplica
from tests.helpers.generators import PROMPT_LEN, RESPONSE_LEN, NoNewWeights, finished_rollout

SAMPLES = 40
"""40 samples of 2,064 tokens: about 1 MB of token columns, four times one message's."""


class RecordingBuffer:
    """Acks every message and keeps its frame sizes (the RequestClient interface)."""

    endpoint = "recording://buffer"
    timeout_s = 5.0

    def __init__(self):
        self.messages: list[tuple[Trajectories, list[int]]] = []

    def send(self, body, arrays=None):
        frames = encode(body, arrays)
        self.messages.append((body, [memoryview(frame).nbytes for frame in frames]))

    def receive(self, timeout_s=None):
        return Ack(accepted=len(self.messages[-1][0].samples)), {}

    def request(self, body, arrays=None, timeout_s=None):  # Leave, on close
        return Ack(accepted=0), {}


class FixedBackend:
    tokenizer = build_tokenizer()
    version = 0
    last_load_s = 0.0


def test_many_long_samples_go_in_several_messages_each_within_the_frame_cap():
    config = load_config(None, ["model.tiny={}", f"generators.max_new_tokens={RESPONSE_LEN}"])
    buffer = RecordingBuffer()
    context = zmq.Context()
    replica = GeneratorReplica(
        config, "gen-0", FixedBackend(), context, "default", buffer, "tcp://127.0.0.1:9"
    )
    replica.weights.socket.close(linger=0)  # never asked: no weights in this test
    replica.weights = NoNewWeights()
    try:
        finished = [finished_rollout(replica, group_id) for group_id in range(SAMPLES)]
        replica.send(finished, wait_s=60)
    finally:
        replica.close()
        context.term()

    assert SAMPLES * sample_bytes(PROMPT_LEN, RESPONSE_LEN) > 3 * TRAJECTORY_MESSAGE_BYTES
    assert len(buffer.messages) >= 4
    sent = [meta.group_id for body, _ in buffer.messages for meta in body.samples]
    assert sent == list(range(SAMPLES))  # every sample once, in order
    assert replica.stats["samples_sent"] == SAMPLES
    for _, sizes in buffer.messages:
        header, *columns = sizes
        assert header <= GENERATOR_HEADER_BYTES
        assert sum(columns) <= TRAJECTORY_MESSAGE_BYTES
        assert max(sizes) <= buffer_frame_limit(config) // 2
