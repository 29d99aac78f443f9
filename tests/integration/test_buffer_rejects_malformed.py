"""A real BufferService answers malformed messages with ErrorReply and keeps serving."""

from __future__ import annotations

from collections import Counter

import msgspec
import pytest
import zmq

from asyncrl.core.messages import (
    SCHEMA_VERSION,
    Ack,
    ArraySpec,
    BatchRequest,
    ErrorReply,
    Trajectories,
    WorkGrant,
    WorkRequest,
    decode,
    encode,
    encode_raw,
)
from tests.helpers.buffer_wire import RESPONSE_LEN, buffer_config, exchange_frames, trajectories
from tests.helpers.running_buffer import running_buffer

pytestmark = pytest.mark.timeout(60)

REPLY_TIMEOUT_S = 5.0
GROUP_SIZE = 4
GENERATOR = "gen-test"


@pytest.fixture
def buffer():
    with running_buffer(buffer_config(group_size=GROUP_SIZE)) as running:
        yield running


@pytest.fixture
def client(buffer, peers):
    """A generator's socket."""
    return peers.generator(buffer, REPLY_TIMEOUT_S)


def reply_to(sock: zmq.Socket, frames) -> object:
    """Send one multipart message and return the reply's body: a reply to a generator
    never carries arrays."""
    reply, arrays = exchange_frames(sock, frames)
    assert arrays == {}
    return reply


def raw_header(body: dict, arrays: list | None = None) -> bytes:
    return msgspec.msgpack.encode(
        {"schema_version": SCHEMA_VERSION, "body": body, "arrays": arrays or []}
    )


def assert_still_grants_work(sock: zmq.Socket) -> WorkGrant:
    reply = reply_to(sock, encode(WorkRequest(GENERATOR, max_samples=2 * GROUP_SIZE)))
    assert isinstance(reply, WorkGrant)
    assert len(reply.items) == 2
    assert all(item.num_samples == GROUP_SIZE and item.prompt_ids for item in reply.items)
    return reply


# --------------------------------------------------------------------------


def test_malformed_messages_get_error_replies_are_counted_and_serving_continues(buffer, client):
    body_frames = encode(*trajectories(0, range(2), GENERATOR))
    truncated = [bytes(frame) for frame in body_frames]
    truncated[-1] = truncated[-1][:-1]

    garbage = reply_to(client, [b"\xc1 definitely not msgpack"])
    unknown = reply_to(client, [raw_header({"type": "launch_missiles"})])
    short = reply_to(client, truncated)

    assert isinstance(garbage, ErrorReply) and garbage.reason == "bad_header"
    assert isinstance(unknown, ErrorReply) and unknown.reason == "unknown_type"
    assert isinstance(short, ErrorReply) and short.reason == "truncated"
    assert "launch_missiles" in unknown.detail
    assert buffer.service.rejected == Counter({"bad_header": 1, "unknown_type": 1, "truncated": 1})
    assert_still_grants_work(client)
    assert buffer.error is None


def test_a_message_type_the_buffer_does_not_serve_is_answered_with_an_error(buffer, client):
    reply = reply_to(client, encode(Ack(accepted=1)))

    assert isinstance(reply, ErrorReply)
    assert reply.reason == "unexpected_type"
    assert buffer.service.rejected["unexpected_type"] == 1
    assert_still_grants_work(client)


def test_trajectories_whose_arrays_disagree_with_their_metas_are_rejected(buffer, client):
    grant = assert_still_grants_work(client)
    body, arrays = trajectories(grant.items[0].group_id, range(GROUP_SIZE), GENERATOR)
    # One prompt token short: the frame matches its own header, but not the metas.
    arrays["prompt_ids"] = arrays["prompt_ids"][:-1]
    frames = encode(body, arrays)

    reply = reply_to(client, frames)

    assert isinstance(reply, ErrorReply)
    assert reply.reason == "bad_array"
    assert buffer.store.counters["accepted"] == 0
    assert_still_grants_work(client)


def test_trajectories_for_a_group_never_dispatched_are_acked_as_rejected_and_dropped(
    buffer, client
):
    reply = reply_to(client, encode(*trajectories(12345, range(3), GENERATOR)))

    assert reply == Ack(accepted=0, rejected=3)
    assert buffer.store.counters["dropped_unknown_group"] == 3
    assert buffer.store.counters["accepted"] == 0
    assert sum(buffer.service.rejected.values()) == 0


def test_trajectories_for_a_dispatched_group_are_accepted(buffer, client):
    grant = assert_still_grants_work(client)

    reply = reply_to(
        client, encode(*trajectories(grant.items[0].group_id, range(GROUP_SIZE), GENERATOR))
    )

    assert reply == Ack(accepted=GROUP_SIZE, rejected=0)
    assert buffer.store.counters["accepted"] == GROUP_SIZE
    assert buffer.store.held_samples() == GROUP_SIZE


def test_a_waiting_learner_gets_its_batch_once_enough_groups_arrive(buffer, client, peers):
    learner = peers.learner(buffer, REPLY_TIMEOUT_S)
    learner.send_multipart(encode(BatchRequest(policy_version=0)))
    grant = assert_still_grants_work(client)
    for item in grant.items:
        reply = reply_to(client, encode(*trajectories(item.group_id, range(GROUP_SIZE), GENERATOR)))
        assert reply == Ack(accepted=GROUP_SIZE, rejected=0)

    batch, arrays = decode(learner.recv_multipart())

    assert isinstance(batch, Trajectories)
    assert len(batch.samples) == 2 * GROUP_SIZE
    assert arrays["response_ids"].numpy().size == RESPONSE_LEN * 2 * GROUP_SIZE
    assert batch.stats["buffer_held"] == 0.0


def test_an_array_shape_that_overflows_is_rejected_and_serving_continues(buffer, client):
    grant = assert_still_grants_work(client)
    body, arrays = trajectories(grant.items[0].group_id, range(1), GENERATOR)
    # 2**32 * 2**32 int32 elements: the byte count wraps to 0 in int64, matching b"".
    specs = [ArraySpec("prompt_ids", "int32", (2**32, 2**32))]
    frames = [b""]
    for name in ("response_ids", "logprobs", "token_versions", "loss_mask"):
        specs.append(ArraySpec(name, str(arrays[name].dtype), arrays[name].shape))
        frames.append(arrays[name].tobytes())
    client.setsockopt(zmq.RCVTIMEO, 1000)

    try:
        reply = reply_to(client, encode_raw(body, specs, frames))
    except zmq.Again:
        reply = None

    assert isinstance(reply, ErrorReply)
    assert buffer.error is None
    assert_still_grants_work(client)
