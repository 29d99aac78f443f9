"""A learner that stops while waiting for a batch still gets a complete checkpoint.

The learner abandons its BatchRequest and sends SaveBufferState with
``abandoned_batch_request``. Either the buffer had not answered yet (the
request is cancelled: no batch is sent later) or it had (the batch it served
is taken back: its groups are unfinished in the saved state). Both orders are
driven here against a real BufferService over TCP.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import zmq

from asyncrl.core.messages import (
    Ack,
    BatchRequest,
    SaveBufferState,
    Trajectories,
    WorkGrant,
    WorkRequest,
    decode,
    encode,
)
from asyncrl.core.paths import BUFFER_STATE, checkpoint_dir
from tests.helpers.buffer_wire import Peers, buffer_config, exchange, send_samples
from tests.helpers.running_buffer import running_buffer

pytestmark = pytest.mark.timeout(60)

GROUP_SIZE = 4
PROMPTS_PER_STEP = 2
REPLY_TIMEOUT_MS = 5000


@pytest.fixture
def buffer(tmp_path: Path):
    config = buffer_config(group_size=GROUP_SIZE, prompts_per_step=PROMPTS_PER_STEP)
    with running_buffer(config) as running:
        running.service.run_dir = tmp_path  # where SaveBufferState writes
        yield running


@pytest.fixture
def sockets(buffer, peers: Peers):
    generator = peers.generator(buffer, REPLY_TIMEOUT_MS / 1000)
    learner = peers.learner(buffer, REPLY_TIMEOUT_MS / 1000)
    return generator, learner


def deliver_groups(generator: zmq.Socket, count: int) -> list[int]:
    """Generate ``count`` whole groups at version 0; returns their ids."""
    grant = exchange(generator, WorkRequest("gen-0", count * GROUP_SIZE))
    assert isinstance(grant, WorkGrant) and len(grant.items) == count
    for item in grant.items:
        ack = send_samples(generator, item.group_id, range(GROUP_SIZE), "gen-0")
        assert ack.accepted == GROUP_SIZE
    return [item.group_id for item in grant.items]


def saved_state(run_dir: Path, step: int) -> dict:
    return json.loads((checkpoint_dir(run_dir, step) / BUFFER_STATE).read_text())


def test_a_batch_served_after_the_learner_gave_up_is_unfinished_in_the_checkpoint(
    buffer, sockets, tmp_path: Path
) -> None:
    generator, learner = sockets
    learner.send_multipart(encode(BatchRequest(policy_version=0)))  # then the learner stops
    served = deliver_groups(generator, PROMPTS_PER_STEP)  # the buffer answers it now
    assert learner.poll(REPLY_TIMEOUT_MS), "the batch should have been sent"

    learner.send_multipart(encode(SaveBufferState(step=1, abandoned_batch_request=True)))
    late, _ = decode(learner.recv_multipart())
    assert isinstance(late, Trajectories)
    assert sorted({meta.group_id for meta in late.samples}) == served
    ack, _ = decode(learner.recv_multipart())
    assert isinstance(ack, Ack)

    assert saved_state(tmp_path, 1)["unfinished_groups"] == served
    assert buffer.store.counters["returned_unconsumed"] == PROMPTS_PER_STEP * GROUP_SIZE


def test_a_batch_request_the_learner_gave_up_on_is_cancelled_before_it_is_answered(
    buffer, sockets, tmp_path: Path
) -> None:
    generator, learner = sockets
    learner.send_multipart(encode(BatchRequest(policy_version=0)))  # nothing to serve yet
    ack = exchange(learner, SaveBufferState(step=1, abandoned_batch_request=True))
    assert isinstance(ack, Ack)

    ready = deliver_groups(generator, PROMPTS_PER_STEP)  # a whole batch is ready now
    assert not learner.poll(500), "a cancelled request must not be answered"
    assert buffer.store.counters["served"] == 0
    assert saved_state(tmp_path, 1)["unfinished_groups"] == []  # nothing was handed out
    assert len(ready) == PROMPTS_PER_STEP


def test_a_plain_save_keeps_a_served_batch_out_of_the_unfinished_groups(
    buffer, sockets, tmp_path: Path
) -> None:
    generator, learner = sockets
    deliver_groups(generator, PROMPTS_PER_STEP)
    batch = exchange(learner, BatchRequest(policy_version=0))
    assert isinstance(batch, Trajectories) and batch.samples
    assert isinstance(exchange(learner, SaveBufferState(step=1)), Ack)  # trained, then saved
    assert saved_state(tmp_path, 1)["unfinished_groups"] == []
    assert buffer.store.counters["returned_unconsumed"] == 0
