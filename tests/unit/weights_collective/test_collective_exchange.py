"""Learner and replica in two processes exchange two versions over a gloo group."""

from __future__ import annotations

import time
from collections import Counter

import pytest
import torch

from asyncrl.core.signing import group_key_pair
from asyncrl.weights.collective.buckets import JoinRequest, seal
from asyncrl.weights.collective.groups import JOIN_QUEUE, connect_store
from asyncrl.weights.collective.sender import CollectiveSender
from asyncrl.weights.snapshot import SnapshotStore
from tests.helpers.collective import LEARNER_KEY, running_replica, version_tensors

BUCKET_BYTES = 256  # the 16-wide model's 4 float32 tensors (32 + 512 + 256 + 16 bytes) and bf16


def ask(pipe, *command):
    pipe.send(command)
    assert pipe.poll(60), f"the replica did not answer {command}"
    reply = pipe.recv()
    assert reply[0] == "ok", reply
    return reply[1:]


@pytest.fixture
def sender():
    snapshots = SnapshotStore(1 << 20, Counter())
    made = CollectiveSender(
        snapshots, "127.0.0.1", 0, LEARNER_KEY, bucket_bytes=BUCKET_BYTES, deadline_s=30.0
    )
    yield made
    made.close()


@pytest.fixture
def replica(sender):
    with running_replica(sender.address, BUCKET_BYTES, 16) as pipe:
        yield pipe


@pytest.mark.timeout(180)
def test_two_versions_reach_the_replica_exactly_and_nothing_when_up_to_date(sender, replica):
    assert ask(replica, "sync", 30.0) == (None, 0)  # joins; nothing published yet
    for version in (1, 2):
        sender.snapshots.publish(version_tensors(version), version)
        assert ask(replica, "sync", 30.0) == (version, version)
        state, held = ask(replica, "params")
        assert held == version
        expected = version_tensors(version)
        assert set(state) == set(expected)
        for name, tensor in expected.items():
            assert state[name].dtype == tensor.dtype
            assert torch.equal(state[name], tensor), name  # bit for bit
    assert ask(replica, "sync", 30.0) == (None, 2)  # up to date
    stats = sender.stats()
    total = sum(t.numel() * t.element_size() for t in version_tensors(1).values())
    assert stats["weights_collective_joins_accepted_total"] == 1
    assert stats["weights_collective_transfers_finished_total"] == 2
    assert stats["weights_collective_bytes_sent_total"] == 2 * total
    assert stats["weights_collective_members"] == 1
    assert "weights_collective_deadline_missed_total" not in stats


@pytest.mark.timeout(60)
def test_a_join_request_signed_with_another_key_is_refused_and_counted(sender):
    client = connect_store(sender.address, 5.0)
    stranger, _ = group_key_pair(b"S" * 32, b"T" * 32)  # keys of no side of this group
    forged = seal(JoinRequest("intruder", "0" * 32, 2), stranger, "join")
    client.queue_push(JOIN_QUEUE, forged)
    for _ in range(100):
        if sender.stats().get("weights_collective_joins_refused_total"):
            break
        time.sleep(0.05)
    stats = sender.stats()
    assert stats["weights_collective_joins_refused_total"] == 1
    assert stats["weights_collective_members"] == 0
    assert not client.check(["asyncrl/accept/" + "0" * 32])  # nothing answered
