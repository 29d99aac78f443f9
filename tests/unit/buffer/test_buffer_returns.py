"""A generator silent past the heartbeat timeout (its host's link cut) that speaks again:
its groups were handed out again, its return and its first accepted sample after it are
logged with their durations, and ``buffer_generators_returned`` counts it."""

from __future__ import annotations

import logging
import time

import pytest

from asyncrl.buffer.returns import Returns
from asyncrl.core.messages import Ack, Heartbeat, Join, WorkRequest
from tests.helpers.buffer_service import Recorded, samples_of


@pytest.fixture
def buffer():
    made = Recorded("buffer.heartbeat_timeout_s=5")
    yield made
    made.close()


def go_silent(buffer: Recorded, generator_id: str, seconds: float) -> None:
    """As if ``generator_id`` was last heard from ``seconds`` ago, then the expiry runs."""
    buffer.store.last_seen[generator_id] = time.monotonic() - seconds
    buffer._expire_silent_generators()


def test_a_generator_back_after_its_groups_were_requeued_is_said_counted_and_timed(
    buffer, caplog
):
    caplog.set_level(logging.INFO, logger="asyncrl.buffer")
    buffer.handle(b"a", WorkRequest("gen-a", 2))
    (first,) = buffer.last(b"a").items
    go_silent(buffer, "gen-a", 30.0)
    assert buffer.store.counters["requeued_groups"] == 1
    assert buffer._status(time.monotonic()).stats["buffer_generators_returned"] == 0

    buffer.handle(b"a", Heartbeat("gen-a"))  # the link is back
    back = [r.getMessage() for r in caplog.records if "is back after" in r.getMessage()]
    assert len(back) == 1 and back[0].startswith("generator gen-a is back after 3")
    assert buffer._status(time.monotonic()).stats["buffer_generators_returned"] == 1

    buffer.handle(b"a", *samples_of(first, "gen-a"))  # its old group: handed out again
    assert buffer.last(b"a") == Ack(0, 2)
    assert not any("first sample accepted" in r.getMessage() for r in caplog.records)

    buffer.handle(b"a", WorkRequest("gen-a", 2))
    (again,) = buffer.last(b"a").items
    assert again.group_id == first.group_id  # requeued groups go out first
    buffer.handle(b"a", *samples_of(again, "gen-a"))
    assert buffer.last(b"a") == Ack(2, 0)
    said = [r.getMessage() for r in caplog.records if "first sample accepted" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("generator gen-a: first sample accepted since")

    buffer.handle(b"a", Heartbeat("gen-a"))  # back once: no second return
    assert buffer._status(time.monotonic()).stats["buffer_generators_returned"] == 1


def test_a_new_process_joining_under_the_id_is_not_a_return(buffer):
    buffer.handle(b"a", WorkRequest("gen-a", 2))
    go_silent(buffer, "gen-a", 30.0)
    buffer.handle(b"b", Join("gen-a", incarnation="other-process"))
    buffer.handle(b"b", Heartbeat("gen-a", incarnation="other-process"))
    assert buffer._status(time.monotonic()).stats["buffer_generators_returned"] == 0


def test_returns_keeps_nothing_once_the_generator_is_forgotten():
    returns = Returns()
    returns.expired("gen-a", 1.0)
    returns.forget("gen-a")
    assert not returns.heard("gen-a", 5.0)
    returns.expired("gen-b", 1.0)
    assert returns.heard("gen-b", 5.0) and not returns.heard("gen-b", 6.0)
    returns.accepted("gen-b", 7.0)
    assert returns.back_since == {} and returns.silent_since == {}
