"""A real BufferService answers malformed messages with ErrorReply and keeps serving."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import msgspec
import numpy as np
import pytest
import zmq
from running_buffer import RunningBuffer

from asyncrl.config import load_config
from asyncrl.messages import (
    SCHEMA_VERSION,
    Ack,
    ArraySpec,
    BatchRequest,
    ErrorReply,
    Trajectories,
    TrajectoryMeta,
    WorkGrant,
    WorkRequest,
    decode,
    encode,
    encode_raw,
)
from asyncrl.transport import client_socket, free_port

pytestmark = pytest.mark.timeout(60)

QUICKSTART = Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml"
REPLY_TIMEOUT_MS = 5000
GROUP_SIZE = 4


@pytest.fixture
def buffer():
    config = load_config(
        QUICKSTART,
        [
            f"algorithm.group_size={GROUP_SIZE}",
            "algorithm.prompts_per_step=2",
            f"cluster.buffer_port={free_port()}",
        ],
    )
    running = RunningBuffer(config).start()
    yield running
    running.stop()


@pytest.fixture
def client(buffer):
    context = zmq.Context()
    sock = client_socket(context, buffer.endpoint, REPLY_TIMEOUT_MS / 1000)
    yield sock
    sock.close(linger=0)
    context.term()


def exchange(sock: zmq.Socket, frames) -> object:
    """Send one multipart message and return the decoded reply body."""
    sock.send_multipart(frames)
    reply, arrays = decode(sock.recv_multipart())
    assert arrays == {}
    return reply


def raw_header(body: dict, arrays: list | None = None) -> bytes:
    return msgspec.msgpack.encode(
        {"schema_version": SCHEMA_VERSION, "body": body, "arrays": arrays or []}
    )


def trajectory_parts(group_id: int, num_samples: int):
    """Body and arrays of ``num_samples`` well-formed samples of one group."""
    prompt_len, response_len = 4, 3
    metas = [
        TrajectoryMeta(group_id, index, prompt_len, response_len, 0.5, "stop", "gen-test")
        for index in range(num_samples)
    ]
    total = response_len * num_samples
    arrays = {
        "prompt_ids": np.ones(prompt_len * num_samples, dtype=np.int32),
        "response_ids": np.full(total, 4, dtype=np.int32),
        "logprobs": np.full(total, -0.5, dtype=np.float32),
        "token_versions": np.zeros(total, dtype=np.int32),
        "loss_mask": np.ones(total, dtype=np.uint8),
    }
    return Trajectories(metas), arrays


def trajectories_for(group_id: int, num_samples: int) -> list:
    """A well-formed Trajectories message: ``num_samples`` samples of one group."""
    return encode(*trajectory_parts(group_id, num_samples))


def assert_still_grants_work(sock: zmq.Socket) -> WorkGrant:
    reply = exchange(sock, encode(WorkRequest("gen-test", max_samples=2 * GROUP_SIZE)))
    assert isinstance(reply, WorkGrant)
    assert len(reply.items) == 2
    assert all(item.num_samples == GROUP_SIZE and item.prompt_ids for item in reply.items)
    return reply


# --------------------------------------------------------------------------


def test_malformed_messages_get_error_replies_are_counted_and_serving_continues(buffer, client):
    body_frames = trajectories_for(group_id=0, num_samples=2)
    truncated = [bytes(frame) for frame in body_frames]
    truncated[-1] = truncated[-1][:-1]

    garbage = exchange(client, [b"\xc1 definitely not msgpack"])
    unknown = exchange(client, [raw_header({"type": "launch_missiles"})])
    short = exchange(client, truncated)

    assert isinstance(garbage, ErrorReply) and garbage.reason == "bad_header"
    assert isinstance(unknown, ErrorReply) and unknown.reason == "unknown_type"
    assert isinstance(short, ErrorReply) and short.reason == "truncated"
    assert "launch_missiles" in unknown.detail
    assert buffer.service.rejected == Counter({"bad_header": 1, "unknown_type": 1, "truncated": 1})
    assert_still_grants_work(client)
    assert buffer.error is None


def test_a_message_type_the_buffer_does_not_serve_is_answered_with_an_error(buffer, client):
    reply = exchange(client, encode(Ack(accepted=1)))

    assert isinstance(reply, ErrorReply)
    assert reply.reason == "unexpected_type"
    assert buffer.service.rejected["unexpected_type"] == 1
    assert_still_grants_work(client)


def test_trajectories_whose_arrays_disagree_with_their_metas_are_rejected(buffer, client):
    grant = assert_still_grants_work(client)
    body, arrays = trajectory_parts(grant.items[0].group_id, GROUP_SIZE)
    # One prompt token short: the frame matches its own header, but not the metas.
    arrays["prompt_ids"] = arrays["prompt_ids"][:-1]
    frames = encode(body, arrays)

    reply = exchange(client, frames)

    assert isinstance(reply, ErrorReply)
    assert reply.reason == "bad_array"
    assert buffer.store.counters["accepted"] == 0
    assert_still_grants_work(client)


def test_trajectories_for_a_group_never_dispatched_are_acked_as_rejected_and_dropped(
    buffer, client
):
    reply = exchange(client, trajectories_for(group_id=12345, num_samples=3))

    assert reply == Ack(accepted=0, rejected=3)
    assert buffer.store.counters["dropped_unknown_group"] == 3
    assert buffer.store.counters["accepted"] == 0
    assert sum(buffer.service.rejected.values()) == 0


def test_trajectories_for_a_dispatched_group_are_accepted(buffer, client):
    grant = assert_still_grants_work(client)

    reply = exchange(client, trajectories_for(grant.items[0].group_id, GROUP_SIZE))

    assert reply == Ack(accepted=GROUP_SIZE, rejected=0)
    assert buffer.store.counters["accepted"] == GROUP_SIZE
    assert buffer.store.held_samples() == GROUP_SIZE


def test_a_waiting_learner_gets_its_batch_once_enough_groups_arrive(buffer, client):
    learner = client_socket(client.context, buffer.endpoint, REPLY_TIMEOUT_MS / 1000)
    try:
        learner.send_multipart(encode(BatchRequest(policy_version=0)))
        grant = assert_still_grants_work(client)
        for item in grant.items:
            reply = exchange(client, trajectories_for(item.group_id, GROUP_SIZE))
            assert reply == Ack(accepted=GROUP_SIZE, rejected=0)

        batch, arrays = decode(learner.recv_multipart())
    finally:
        learner.close(linger=0)

    assert isinstance(batch, Trajectories)
    assert len(batch.samples) == 2 * GROUP_SIZE
    assert arrays["response_ids"].numpy().size == 3 * 2 * GROUP_SIZE
    assert batch.stats["buffer_held"] == 0.0


def test_an_array_shape_that_overflows_is_rejected_and_serving_continues(buffer, client):
    grant = assert_still_grants_work(client)
    body, arrays = trajectory_parts(grant.items[0].group_id, 1)
    # 2**32 * 2**32 int32 elements: the byte count wraps to 0 in int64, matching b"".
    specs = [ArraySpec("prompt_ids", "int32", (2**32, 2**32))]
    frames = [b""]
    for name in ("response_ids", "logprobs", "token_versions", "loss_mask"):
        specs.append(ArraySpec(name, str(arrays[name].dtype), arrays[name].shape))
        frames.append(arrays[name].tobytes())
    client.setsockopt(zmq.RCVTIMEO, 1000)

    try:
        reply = exchange(client, encode_raw(body, specs, frames))
    except zmq.Again:
        reply = None

    assert isinstance(reply, ErrorReply)
    assert buffer.error is None
    assert_still_grants_work(client)
