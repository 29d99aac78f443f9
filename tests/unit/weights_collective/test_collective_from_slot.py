"""The broadcast sends from the learner's shared-memory slot: it follows a write in
progress, and a version rewritten while it was sent is refused by the verdict."""

from __future__ import annotations

import threading

import pytest

import asyncrl.weights.collective.outgoing as outgoing
import asyncrl.weights.shm.writer as shm_writer
from asyncrl.weights.shm.segment import PROGRESS_OFFSET
from tests.helpers.collective import (
    BUCKET_BYTES,
    LAYERS,
    WIDTH,
    assert_holds,
    command,
    running_replica,
    version_tensors,
)
from tests.helpers.waiting import came_true


@pytest.fixture
def replica(learner):
    _, sender = learner
    with running_replica(sender.address, BUCKET_BYTES, WIDTH, layers=LAYERS, homing=True) as pipe:
        yield pipe


@pytest.mark.timeout(180)
def test_buckets_go_while_the_learner_is_still_writing_the_version(learner, replica):
    sink, sender = learner
    sink.publish(version_tensors(1, WIDTH, LAYERS).items(), 1)  # sizes the segment
    assert command(replica, "sync", 30.0) == ("ok", 1, 1)
    assert_holds(replica, 1)
    assert sender.stats()["weights_collective_transfers_from_slot_total"] == 1

    second = list(version_tensors(2, WIDTH, LAYERS).items())
    last_allowed = threading.Event()

    def gated():  # the learner gathers its last tensor only once the test allows it
        yield from second[:-1]
        assert last_allowed.wait(60)
        yield second[-1]

    publishing = threading.Thread(target=sink.publish, args=(gated(), 2))
    publishing.start()
    try:
        sent_before = sender.stats()["weights_collective_bytes_sent_total"]
        replica.send(("sync", 30.0))
        # bytes of v2 leave while its last tensor is not even written
        sent = "weights_collective_bytes_sent_total"
        assert came_true(lambda: sender.stats()[sent] > sent_before, 30.0, 0.01)
        assert not replica.poll(0.2)  # and the replica waits for the rest
    finally:
        last_allowed.set()
        publishing.join(30)
    assert replica.poll(60) and replica.recv() == ("ok", 2, 2)
    assert_holds(replica, 2)
    # the sender counts a transfer after the replica already has it: on a loaded machine
    # the replica's answer comes first
    counted = {"weights_collective_transfers_finished_total": 2,
               "weights_collective_transfers_followed_total": 1}  # fmt: skip
    came_true(lambda: all(sender.stats().get(k, 0) == n for k, n in counted.items()), 30.0, 0.01)
    stats = sender.stats()
    assert {key: stats.get(key, 0) for key in counted} == counted


@pytest.mark.timeout(180)
def test_the_first_bytes_go_while_the_learner_is_still_writing_the_first_tensor(
    learner, replica, monkeypatch
):
    sink, sender = learner
    sink.publish(version_tensors(1, WIDTH, LAYERS).items(), 1)
    assert command(replica, "sync", 30.0) == ("ok", 1, 1)
    # the slot holds "scale" (bf16, 12 bytes: a bucket of its own), then "0.weight" (f32,
    # 1 KiB) from byte 64: the broadcasts are "scale" whole, then 256, 512, ... bytes
    monkeypatch.setattr(shm_writer, "WRITE_PIECE", 256)
    monkeypatch.setattr(outgoing, "FIRST_PIECE", 128)
    real_write_u64 = shm_writer.write_u64
    first_piece_written, rest_allowed = threading.Event(), threading.Event()

    def held_after_the_first_piece(buffer, offset, value):
        real_write_u64(buffer, offset, value)
        if offset % 4096 == PROGRESS_OFFSET and value == 64 + 256:  # a slot's progress
            first_piece_written.set()
            assert rest_allowed.wait(60)

    monkeypatch.setattr(shm_writer, "write_u64", held_after_the_first_piece)
    publishing = threading.Thread(
        target=sink.publish, args=(version_tensors(2, WIDTH, LAYERS).items(), 2)
    )
    sent = "weights_collective_bytes_sent_total"
    sent_before = sender.stats()[sent]
    publishing.start()
    try:
        assert first_piece_written.wait(30)
        replica.send(("sync", 30.0))
        # "scale" and the first 256 bytes of "0.weight" leave; the next piece waits for its
        assert came_true(lambda: sender.stats()[sent] - sent_before == 12 + 256, 30.0, 0.01)
        assert not replica.poll(0.2)
        assert sender.stats()[sent] - sent_before == 12 + 256
    finally:
        rest_allowed.set()
        publishing.join(30)
    assert replica.poll(60) and replica.recv() == ("ok", 2, 2)
    assert_holds(replica, 2)
    assert sender.stats()["weights_collective_transfers_followed_total"] == 1


@pytest.mark.timeout(180)
def test_a_version_rewritten_while_sent_is_refused_and_read_again(learner, replica, monkeypatch):
    sink, sender = learner
    sink.publish(version_tensors(1, WIDTH, LAYERS).items(), 1)
    assert command(replica, "sync", 30.0) == ("ok", 1, 1)
    sink.publish(version_tensors(2, WIDTH, LAYERS).items(), 2)

    # the learner rewrites the slot during the send: the seqlock counter moves
    real_intact = outgoing.SlotVersion.intact

    def rewritten_meanwhile(self, deadline):
        sink.publish(version_tensors(3, WIDTH, LAYERS).items(), 3)
        sink.publish(version_tensors(4, WIDTH, LAYERS).items(), 4)  # v2's slot
        return real_intact(self, deadline)

    monkeypatch.setattr(outgoing.SlotVersion, "intact", rewritten_meanwhile)
    reply = command(replica, "sync", 30.0)
    assert reply[0] == "error" and reply[1] == "WeightTransferError", reply
    _, _, message, partial, _, _, held = reply
    assert "v2 was rewritten while it was sent" in message
    assert partial is True and held == 1  # received into the model: a mix, not claimed
    # the sender counts it after the verdict the replica already acted on
    overwritten = "weights_collective_transfers_overwritten_total"
    assert came_true(lambda: sender.stats().get(overwritten) == 1, 10.0), sender.stats()
    assert sender.stats()["weights_collective_members"] == 1  # the group is sound and stays

    monkeypatch.setattr(outgoing.SlotVersion, "intact", real_intact)
    assert command(replica, "sync", 30.0) == ("ok", 4, 4)  # the newest, whole
    assert_holds(replica, 4)
    assert sender.stats()["weights_collective_joins_accepted_total"] == 1  # no re-join
