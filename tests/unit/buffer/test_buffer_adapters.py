"""LoRA adapters published alone: the buffer accepts a sample only when the replica that
made it held, for every version its tokens carry, the adapter the learner announced."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from asyncrl.core.messages import (
    BASE_DIGEST,
    Ack,
    AdapterPublished,
    BatchRequest,
    Trajectories,
    WorkGrant,
    WorkRequest,
)
from asyncrl.core.wire import WireError
from tests.helpers.buffer_service import LEARNER, Recorded, samples_of

V1 = "0123456789abcdef" * 2
LORA = ("model.lora.rank=4",)


@pytest.fixture
def buffer():
    service = Recorded(*LORA)
    yield service
    service.close()


def delivered(buffer: Recorded, generator: str, item, version: int, digests, reward=1.0):
    body, arrays = samples_of(item, generator, reward=reward, version=version)
    body = msgspec.structs.replace(body, adapter_digests=digests)
    buffer.handle(generator.encode(), body, arrays)
    return buffer.last(generator.encode())


def test_samples_made_with_another_adapter_are_refused_counted_and_regenerated(buffer):
    buffer.handle(LEARNER, AdapterPublished(1, V1))
    assert buffer.last(LEARNER) == Ack(accepted=1)
    buffer.handle(b"gen-a", WorkRequest("gen-a", 4))
    first, second = buffer.last(b"gen-a").items

    # the replica kept the base model while its tokens say v1: refused, group requeued
    assert delivered(buffer, "gen-a", first, 1, {1: BASE_DIGEST}, reward=0.0) == Ack(0, 2)
    # a replica that reports nothing for v1 vouches for nothing
    assert delivered(buffer, "gen-a", second, 1, {}, reward=0.0) == Ack(0, 2)
    stats = buffer._stats(0.0)
    assert stats["buffer_refused_adapter"] == 4.0
    assert stats["buffer_requeued_groups"] == 2.0
    assert stats["buffer_accepted"] == 0.0

    buffer.handle(b"gen-b", WorkRequest("gen-b", 4))
    again = buffer.last(b"gen-b")
    assert isinstance(again, WorkGrant)
    assert [i.group_id for i in again.items] == [first.group_id, second.group_id]
    assert delivered(buffer, "gen-b", again.items[0], 1, {1: V1}) == Ack(2, 0)
    assert delivered(buffer, "gen-b", again.items[1], 1, {0: BASE_DIGEST, 1: V1}) == Ack(2, 0)

    buffer.handle(LEARNER, BatchRequest(1))
    batch = buffer.last(LEARNER)
    assert isinstance(batch, Trajectories)
    assert [m.reward for m in batch.samples] == [1.0] * 4  # none of the refused ones


def test_version_0_is_the_base_model_in_every_run(buffer):
    buffer.handle(b"gen-a", WorkRequest("gen-a", 4))
    first, second = buffer.last(b"gen-a").items
    assert delivered(buffer, "gen-a", first, 0, {0: BASE_DIGEST}) == Ack(2, 0)
    assert delivered(buffer, "gen-a", second, 0, {0: V1}) == Ack(0, 2)


def test_a_version_announced_again_takes_the_new_digest(buffer):
    buffer.handle(LEARNER, AdapterPublished(1, V1))
    buffer.handle(LEARNER, AdapterPublished(1, "f" * 32))  # resumed from an earlier step
    buffer.handle(b"gen-a", WorkRequest("gen-a", 2))
    (item,) = buffer.last(b"gen-a").items
    assert delivered(buffer, "gen-a", item, 1, {1: V1}) == Ack(0, 2)


def test_a_run_without_adapters_alone_neither_takes_announcements_nor_checks():
    plain = Recorded()
    try:
        with pytest.raises(WireError, match="unexpected_type"):  # answered as an ErrorReply
            plain.handle(LEARNER, AdapterPublished(1, V1))
        plain.handle(b"gen-a", WorkRequest("gen-a", 2))
        (item,) = plain.last(b"gen-a").items
        assert delivered(plain, "gen-a", item, 0, {}) == Ack(2, 0)
    finally:
        plain.close()


def test_digests_on_the_wire_are_checked_when_decoded():
    from asyncrl.core.messages import decode, encode

    with pytest.raises(WireError, match="digest"):
        decode(encode(AdapterPublished(1, "not-a-digest")))
    too_many = {v: V1 for v in range(65)}
    body = Trajectories([], adapter_digests=too_many)
    arrays = {name: np.zeros(0, dtype) for name, dtype in Trajectories.ARRAYS.items()}
    with pytest.raises(WireError, match="adapter_digests"):
        decode([bytes(f) for f in encode(body, arrays)])
