"""A real BufferService requeues a silent generator's groups and applies back-pressure."""

from __future__ import annotations

import functools
import time

import pytest

from asyncrl.core.messages import (
    Ack,
    BatchRequest,
    Heartbeat,
    Join,
    Joined,
    Leave,
    Status,
    StatusRequest,
    Trajectories,
    WorkGrant,
    WorkRequest,
)
from asyncrl.core.security import GENERATOR
from tests.helpers.buffer_wire import buffer_config, exchange, send_samples
from tests.helpers.running_buffer import running_buffer
from tests.helpers.waiting import wait_until

pytestmark = pytest.mark.timeout(60)

REPLY_TIMEOUT_S = 5.0
GROUP_SIZE = 4
GROUP = range(GROUP_SIZE)
BATCH = 2 * GROUP_SIZE
TIMEOUT_S = 0.5

make_config = functools.partial(
    buffer_config, group_size=GROUP_SIZE, heartbeat_timeout_s=TIMEOUT_S, heartbeat_interval_s=0.1
)


@pytest.fixture
def buffer():
    with running_buffer(make_config()) as running:
        yield running


# --------------------------------------------------------------------------


def test_a_silent_generator_s_groups_go_to_another_and_its_late_samples_are_duplicates(
    buffer, peers
):
    a = peers.generator(buffer, REPLY_TIMEOUT_S)
    b = peers.generator(buffer, REPLY_TIMEOUT_S)
    learner = peers.learner(buffer, REPLY_TIMEOUT_S)

    grant = exchange(a, WorkRequest("gen-a", max_samples=BATCH))
    assert [item.group_id for item in grant.items] == [0, 1]
    started = time.monotonic()
    assert send_samples(a, 0, range(2), "gen-a") == Ack(accepted=2)

    # gen-a goes silent; gen-b stays alive with heartbeats until gen-a is presumed dead
    wait_until(
        lambda: buffer.store.counters["requeued_groups"] == 2,
        10.0,
        every_s=0.05,
        while_waiting=lambda: exchange(b, Heartbeat("gen-b")),
    )
    assert time.monotonic() - started >= TIMEOUT_S
    assert buffer.store.counters["discarded_requeue"] == 2
    assert "gen-b" in buffer.store.last_seen

    grant = exchange(b, WorkRequest("gen-b", max_samples=BATCH))
    assert isinstance(grant, WorkGrant)
    assert [item.group_id for item in grant.items] == [0, 1]

    # gen-a was only slow: what it sends now is too late
    late = send_samples(a, 0, range(2, GROUP_SIZE), "gen-a")
    late_whole = send_samples(a, 1, GROUP, "gen-a")
    assert late == Ack(accepted=0, rejected=2)
    assert late_whole == Ack(accepted=0, rejected=GROUP_SIZE)
    assert buffer.store.counters["dropped_duplicate"] == 2 + GROUP_SIZE

    assert send_samples(b, 0, GROUP, "gen-b") == Ack(accepted=GROUP_SIZE)
    assert send_samples(b, 1, GROUP, "gen-b") == Ack(accepted=GROUP_SIZE)
    batch = exchange(learner, BatchRequest(policy_version=0))

    assert isinstance(batch, Trajectories)
    assert {(m.group_id, m.generator_id) for m in batch.samples} == {(0, "gen-b"), (1, "gen-b")}
    assert batch.stats["buffer_requeued_groups"] == 2.0
    assert batch.stats["buffer_dropped_duplicate"] == float(2 + GROUP_SIZE)
    assert batch.stats["buffer_discarded_requeue"] == 2.0
    assert buffer.store.accounted() == buffer.store.counters["accepted"]


def test_heartbeats_keep_a_busy_generator_s_groups(peers):
    # a longer timeout than elsewhere: a 0.1s heartbeat must not miss it on a loaded machine
    timeout_s = 1.0
    with running_buffer(make_config(heartbeat_timeout_s=timeout_s)) as buffer:
        a = peers.generator(buffer, REPLY_TIMEOUT_S)
        grant = exchange(a, WorkRequest("gen-a", max_samples=BATCH))
        assert len(grant.items) == 2

        until = time.monotonic() + 2 * timeout_s
        while time.monotonic() < until:
            assert exchange(a, Heartbeat("gen-a")) == Ack(accepted=0)
            time.sleep(0.1)

        assert buffer.store.counters["requeued_groups"] == 0
        assert set(buffer.store.in_flight) == {0, 1}


def test_the_heartbeat_thread_keeps_a_replica_alive_while_its_loop_is_blocked(peers):
    """A replica stuck in one long engine call (here: its thread asleep for three
    timeouts) keeps its groups: liveness comes from a thread of its own. Once that
    thread stops, as when the process is SIGSTOPped, the buffer expires it."""
    from asyncrl.generators.liveness import HeartbeatThread

    timeout_s = 1.0
    with running_buffer(make_config(heartbeat_timeout_s=timeout_s)) as buffer:
        a = peers.generator(buffer, REPLY_TIMEOUT_S)
        grant = exchange(a, WorkRequest("gen-a", max_samples=BATCH))
        assert len(grant.items) == 2
        context = peers.context(buffer.config, GENERATOR)
        heartbeats = HeartbeatThread(context, buffer.endpoint, "gen-a", 0.1, timeout_s).start()
        time.sleep(3 * timeout_s)  # the "chunk": nothing from this thread
        assert buffer.store.counters["requeued_groups"] == 0
        assert set(buffer.store.in_flight) == {0, 1}
        assert heartbeats.sent >= 10

        heartbeats.stop()
        wait_until(
            lambda: buffer.store.counters["requeued_groups"] == 2,
            timeout_s=5 * timeout_s,
            every_s=0.05,
            while_waiting=lambda: f"counters {dict(buffer.store.counters)}",
        )
        assert "gen-a" not in buffer.store.last_seen


def test_back_pressure_refuses_work_with_a_retry_hint_while_a_batch_is_still_served(peers):
    config = make_config("buffer.max_held_samples=8", "buffer.max_staleness=3")
    with running_buffer(config) as buffer:
        generator = peers.generator(buffer, REPLY_TIMEOUT_S)
        learner = peers.learner(buffer, REPLY_TIMEOUT_S)
        grant = exchange(generator, WorkRequest("gen-a", max_samples=BATCH))
        for item in grant.items:
            assert send_samples(generator, item.group_id, GROUP, "gen-a") == Ack(
                accepted=GROUP_SIZE
            )
        assert buffer.store.held_samples() == 8

        refused = exchange(generator, WorkRequest("gen-a", max_samples=BATCH))
        assert isinstance(refused, WorkGrant)
        assert refused.items == []
        assert refused.retry_after_s > 0
        assert buffer.store.counters["dispatch_refused_backpressure"] == 1
        assert buffer.store.counters["dispatch_refused_admission"] == 0

        batch = exchange(learner, BatchRequest(policy_version=0))
        assert isinstance(batch, Trajectories)
        assert len(batch.samples) == BATCH
        assert batch.stats["buffer_backpressure_refusals"] == 1.0
        assert batch.stats["buffer_dropped_stale"] == 0.0

        # room again: work flows
        grant = exchange(generator, WorkRequest("gen-a", max_samples=BATCH))
        assert [item.group_id for item in grant.items] == [2, 3]


def test_a_joining_generator_learns_the_weights_port_and_is_listed_in_status(buffer, peers):
    sock = peers.generator(buffer, REPLY_TIMEOUT_S)
    joined = exchange(sock, Join("extra-host-1", pool="extra"))
    assert joined == Joined(buffer.config.cluster.weights_port, 0, buffer.config.run.name)
    exchange(sock, WorkRequest("extra-host-1", max_samples=GROUP_SIZE))
    status = exchange(sock, StatusRequest())
    assert isinstance(status, Status)
    assert set(status.generators) == {"extra-host-1"}
    assert status.generators["extra-host-1"]["seen_s_ago"] < 5
    assert status.pools == {"extra-host-1": "extra"}
    assert status.stats["buffer_in_flight_groups"] == 1


def test_a_generator_that_leaves_hands_its_groups_back_at_once(peers):
    config = make_config(heartbeat_timeout_s=60)  # expiry would take a minute
    with running_buffer(config) as buffer:
        leaving = peers.generator(buffer, REPLY_TIMEOUT_S)
        staying = peers.generator(buffer, REPLY_TIMEOUT_S)
        grant = exchange(leaving, WorkRequest("gen-a", max_samples=BATCH))
        taken = sorted(item.group_id for item in grant.items)
        send_samples(leaving, taken[0], range(1), "gen-a")  # one partial sample
        assert exchange(leaving, Leave("gen-a")) == Ack(accepted=len(taken))
        assert buffer.store.counters["requeued_groups"] == len(taken)
        regrant = exchange(staying, WorkRequest("gen-b", max_samples=BATCH))
        assert sorted(item.group_id for item in regrant.items) == taken
        assert "gen-a" not in buffer.store.last_seen
