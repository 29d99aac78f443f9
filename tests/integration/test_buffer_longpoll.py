"""A real BufferService holds an idle replica's work request until work is admitted.

``WorkRequest.wait_s > 0`` lets the buffer keep a request it cannot serve and
answer it as soon as dispatch can (the learner's next ``BatchRequest`` opens
admission), or with an empty grant at its deadline. Every request still gets
exactly one reply: on Leave, on a newer request of the same generator and when
the service stops. Ordering is asserted, not latency.
"""

from __future__ import annotations

import functools
import math
import threading
import time
from types import SimpleNamespace

import pytest
import zmq

from asyncrl.buffer.metrics import busy_fraction
from asyncrl.core.messages import (
    Ack,
    BatchRequest,
    ErrorReply,
    Leave,
    Status,
    StatusRequest,
    Trajectories,
    WorkGrant,
    WorkRequest,
    decode,
    encode,
)
from asyncrl.core.security import GENERATOR, LEARNER
from asyncrl.core.transport import RequestClient, client_socket
from asyncrl.generation.tasks import build_tokenizer
from tests.helpers.buffer_wire import Peers, buffer_config, exchange, send_samples
from tests.helpers.running_buffer import RunningBuffer, running_buffer

pytestmark = pytest.mark.timeout(60)

REPLY_TIMEOUT_S = 10.0
GROUP_SIZE = 4
GROUP = range(GROUP_SIZE)
"""A whole group; sent with ``reward=float``, sample ``i`` scores ``i``."""
ACCEPTED = Ack(accepted=GROUP_SIZE)
BATCH = 2 * GROUP_SIZE
LONG_WAIT_S = 30.0
"""A hold that outlasts any test: only work, Leave, a newer request or a stop end it."""

make_config = functools.partial(
    buffer_config,
    "buffer.max_staleness=0",
    group_size=GROUP_SIZE,
    heartbeat_timeout_s=100,
    heartbeat_interval_s=0.1,
)
"""Synchronous admission (one batch of prompts per version) and a long heartbeat
timeout, so a held request is capped well beyond any test."""


def receive(sock: zmq.Socket):
    assert sock.poll(int(REPLY_TIMEOUT_S * 1000)), "no reply"
    reply, _ = decode(sock.recv_multipart())
    return reply


def status(sock: zmq.Socket) -> Status:
    reply = exchange(sock, StatusRequest())
    assert isinstance(reply, Status), reply
    return reply


def held_now(sock: zmq.Socket, count: int) -> dict[str, float]:
    """The buffer's stats once it holds ``count`` requests (messages on other
    connections may still be on their way when this one asks)."""
    deadline = time.monotonic() + REPLY_TIMEOUT_S
    while (stats := status(sock).stats)["buffer_work_requests_held_now"] != count:
        assert time.monotonic() < deadline, f"the buffer never held {count} request(s)"
        time.sleep(0.02)
    return stats


def close_admission(sock: zmq.Socket) -> list[int]:
    """``gen-x`` takes the whole batch version 0 admits; returns its group ids."""
    grant = exchange(sock, WorkRequest("gen-x", max_samples=BATCH))
    assert isinstance(grant, WorkGrant) and len(grant.items) == 2, grant
    return [item.group_id for item in grant.items]


def ids(grant: WorkGrant) -> list[int]:
    return [item.group_id for item in grant.items]


# --------------------------------------------------------------------------


def test_a_held_request_is_answered_with_work_once_the_learner_s_next_step_admits_it(peers):
    with running_buffer(make_config()) as buffer:
        taker = peers.generator(buffer, REPLY_TIMEOUT_S)
        a = peers.generator(buffer, REPLY_TIMEOUT_S)
        c = peers.generator(buffer, REPLY_TIMEOUT_S)
        learner = peers.learner(buffer, REPLY_TIMEOUT_S)
        observer = peers.observer(buffer, REPLY_TIMEOUT_S)
        for group_id in close_admission(taker):
            assert send_samples(taker, group_id, GROUP, "gen-x", reward=float) == ACCEPTED

        a.send_multipart(encode(WorkRequest("gen-a", BATCH, wait_s=LONG_WAIT_S)))
        held_now(observer, 1)  # gen-a's request is the older: two connections race otherwise
        c.send_multipart(encode(WorkRequest("gen-c", BATCH, wait_s=LONG_WAIT_S)))
        held = held_now(observer, 2)
        assert held["buffer_work_requests_held"] == 2.0
        assert held["buffer_admission_refusals"] == 2.0

        # the learner takes the batch of version 0: still nothing admitted, still held
        batch = exchange(learner, BatchRequest(policy_version=0))
        assert isinstance(batch, Trajectories) and len(batch.samples) == BATCH
        assert batch.stats["buffer_work_requests_held_now"] == 2.0
        assert a.poll(0) == 0 and c.poll(0) == 0

        # version 1 admits one more batch of prompts: the older held request gets it
        learner.send_multipart(encode(BatchRequest(policy_version=1)))
        grant = receive(a)
        assert isinstance(grant, WorkGrant)
        assert ids(grant) == [2, 3]
        assert grant.policy_version == 1  # answered after the BatchRequest was handled
        assert grant.retry_after_s == 0.0

        after = status(observer).stats
        assert after["buffer_work_requests_held_granted"] == 1.0
        assert after["buffer_work_requests_held_now"] == 1.0  # gen-c: nothing left for it
        assert after["buffer_admission_refusals"] == 2.0  # tried again, not refused again
        assert set(buffer.store.in_flight) == {2, 3}
        assert c.poll(0) == 0

    # stopping the service answers the request still held, with nothing
    last = receive(c)
    assert isinstance(last, WorkGrant) and last.items == []


def test_a_held_request_with_nothing_to_give_is_answered_empty_at_its_deadline(peers):
    with running_buffer(make_config()) as buffer:
        taker = peers.generator(buffer, REPLY_TIMEOUT_S)
        a = peers.generator(buffer, REPLY_TIMEOUT_S)
        close_admission(taker)

        grant = exchange(a, WorkRequest("gen-a", BATCH, wait_s=0.2))

        assert isinstance(grant, WorkGrant)
        assert grant.items == []
        assert grant.retry_after_s == 0.0  # it waited already: ask again at once
        stats = status(a).stats
        assert stats["buffer_work_requests_held"] == 1.0
        assert stats["buffer_work_requests_held_granted"] == 0.0
        assert stats["buffer_work_requests_held_now"] == 0.0


def test_without_wait_s_a_refused_request_is_answered_at_once_with_a_retry_hint(peers):
    with running_buffer(make_config()) as buffer:
        taker = peers.generator(buffer, REPLY_TIMEOUT_S)
        close_admission(taker)
        refused = exchange(taker, WorkRequest("gen-x", BATCH))
        assert refused.items == [] and refused.retry_after_s > 0
        assert status(taker).stats["buffer_work_requests_held"] == 0.0


@pytest.mark.parametrize("wait_s", [-1.0, math.nan, math.inf], ids=["negative", "nan", "inf"])
def test_an_invalid_wait_s_is_rejected_as_bad_field_and_the_buffer_keeps_serving(peers, wait_s):
    with running_buffer(make_config()) as buffer:
        sock = peers.generator(buffer, REPLY_TIMEOUT_S)

        reply = exchange(sock, WorkRequest("gen-a", BATCH, wait_s=wait_s))

        assert isinstance(reply, ErrorReply)
        assert reply.reason == "bad_field"
        assert "wait_s" in reply.detail
        assert buffer.service.rejected["bad_field"] == 1
        assert buffer.store.cursor == 0  # nothing was dispatched
        grant = exchange(sock, WorkRequest("gen-a", BATCH, wait_s=1.0))
        assert ids(grant) == [0, 1]
        assert status(sock).stats["buffer_rejected_bad_field"] == 1.0


def test_a_generator_waiting_at_the_buffer_is_never_taken_for_silent(peers):
    # a wait far beyond the 0.5 s timeout: the buffer cuts it, so the generator speaks
    # again before it could expire, and keeps the groups it was given
    timeout_s = 0.5
    config = make_config(heartbeat_timeout_s=timeout_s)
    with running_buffer(config) as buffer:
        a = peers.generator(buffer, REPLY_TIMEOUT_S)
        taken = exchange(a, WorkRequest("gen-a", max_samples=BATCH))
        assert ids(taken) == [0, 1]

        until = time.monotonic() + 4 * timeout_s
        while time.monotonic() < until:  # uncut, the first hold would outlast the socket
            grant = exchange(a, WorkRequest("gen-a", BATCH, wait_s=1000.0))
            assert isinstance(grant, WorkGrant) and grant.items == []
            assert "gen-a" in buffer.store.last_seen

        assert buffer.store.counters["requeued_groups"] == 0
        assert set(buffer.store.in_flight) == {0, 1}


def test_leave_answers_the_held_request_first_then_requeues(peers):
    with running_buffer(make_config()) as buffer:
        a = peers.generator(buffer, REPLY_TIMEOUT_S)
        taken = exchange(a, WorkRequest("gen-a", max_samples=BATCH))
        assert ids(taken) == [0, 1]

        a.send_multipart(encode(WorkRequest("gen-a", BATCH, wait_s=LONG_WAIT_S)))
        a.send_multipart(encode(Leave("gen-a")))

        first, second = receive(a), receive(a)
        assert isinstance(first, WorkGrant) and first.items == []
        assert second == Ack(accepted=2)
        assert buffer.store.counters["requeued_groups"] == 2
        assert "gen-a" not in buffer.service.held


def test_a_newer_request_of_the_same_generator_replaces_the_held_one(peers):
    with running_buffer(make_config()) as buffer:
        taker = peers.generator(buffer, REPLY_TIMEOUT_S)
        old = peers.generator(buffer, REPLY_TIMEOUT_S)
        new = peers.generator(buffer, REPLY_TIMEOUT_S)
        learner = peers.learner(buffer, REPLY_TIMEOUT_S)
        for group_id in close_admission(taker):
            assert send_samples(taker, group_id, GROUP, "gen-x", reward=float) == ACCEPTED

        old.send_multipart(encode(WorkRequest("gen-a", BATCH, wait_s=LONG_WAIT_S)))
        held_now(taker, 1)  # the first request is in
        new.send_multipart(encode(WorkRequest("gen-a", BATCH, wait_s=LONG_WAIT_S)))

        replaced = receive(old)
        assert isinstance(replaced, WorkGrant) and replaced.items == []
        assert status(taker).stats["buffer_work_requests_held_now"] == 1.0
        exchange(learner, BatchRequest(policy_version=0))
        learner.send_multipart(encode(BatchRequest(policy_version=1)))
        assert ids(receive(new)) == [2, 3]


def test_generators_busy_fraction_reaches_the_learner_s_stats(peers):
    with running_buffer(make_config()) as buffer:
        a = peers.generator(buffer, REPLY_TIMEOUT_S)
        b = peers.generator(buffer, REPLY_TIMEOUT_S)
        learner = peers.learner(buffer, REPLY_TIMEOUT_S)
        assert ids(exchange(a, WorkRequest("gen-a", GROUP_SIZE))) == [0]
        assert ids(exchange(b, WorkRequest("gen-b", GROUP_SIZE))) == [1]
        assert (
            send_samples(a, 0, GROUP, "gen-a", reward=float, stats={"busy_s": 3.0, "wall_s": 4.0})
            == ACCEPTED
        )
        assert (
            send_samples(b, 1, GROUP, "gen-b", reward=float, stats={"busy_s": 1.0, "wall_s": 4.0})
            == ACCEPTED
        )

        batch = exchange(learner, BatchRequest(policy_version=0))

        assert isinstance(batch, Trajectories)
        assert batch.stats["generators_busy_fraction"] == pytest.approx(0.5)
        assert batch.stats["generators_busy_s_total"] == 4.0
        assert batch.stats["pool_default_wall_s_total"] == 8.0


def test_busy_fraction_counts_live_replicas_only_and_is_absent_before_any_report():
    reports = {
        "gen-0": {"busy_s": 1.0, "wall_s": 2.0},
        "gen-1": {"busy_s": 3.0, "wall_s": 4.0},
        "gen-2-dead": {"busy_s": 0.0, "wall_s": 100.0},
    }
    assert busy_fraction(reports, ["gen-0", "gen-1"]) == {
        "generators_busy_fraction": pytest.approx(4.0 / 6.0)
    }
    assert busy_fraction(reports, ["gen-new"]) == {}
    assert busy_fraction({"gen-0": {"samples_sent": 8.0}}, ["gen-0"]) == {}


# --------------------------------------------------------------------------
# the replica's side


def replica_for(buffer: RunningBuffer, peers: Peers, generator_id: str = "gen-w"):
    from asyncrl.generators.worker import GeneratorReplica

    context = peers.context(buffer.config, GENERATOR)
    client = RequestClient(context, buffer.endpoint, timeout_s=REPLY_TIMEOUT_S)
    weights = f"tcp://127.0.0.1:{buffer.config.cluster.weights_port}"
    backend = SimpleNamespace(tokenizer=build_tokenizer())  # its episodes decode with it
    return GeneratorReplica(
        buffer.config, generator_id, backend, context, "default", client, weights
    )


def test_an_idle_replica_waits_at_the_buffer_and_gets_work_when_the_learner_admits_it(peers):
    config = make_config(heartbeat_interval_s=20)  # the replica's wait_s
    with running_buffer(config) as buffer:
        taker = peers.generator(buffer, REPLY_TIMEOUT_S)
        for group_id in close_admission(taker):
            assert send_samples(taker, group_id, GROUP, "gen-x", reward=float) == ACCEPTED
        replica = replica_for(buffer, peers)
        assert replica.idle()
        learner_context = peers.context(buffer.config, LEARNER)

        def learner() -> None:  # its next step, once the replica is waiting
            sock = client_socket(learner_context, buffer.endpoint, REPLY_TIMEOUT_S)
            try:
                held_now(sock, 1)
                exchange(sock, BatchRequest(policy_version=0))
                sock.send_multipart(encode(BatchRequest(policy_version=1)))
            finally:
                sock.close(linger=0)

        thread = threading.Thread(target=learner)
        thread.start()
        try:
            grant = replica.ask_for_work(BATCH)
        finally:
            thread.join(REPLY_TIMEOUT_S)
            replica.scorer.close()
        assert grant is not None
        assert ids(grant) == [2, 3]
        assert grant.policy_version == 1
        assert buffer.service.counters["work_requests_held_granted"] == 1


def test_a_replica_stopped_while_waiting_gives_up_the_request_and_still_leaves(peers):
    config = make_config(heartbeat_interval_s=20)
    with running_buffer(config) as buffer:
        taker = peers.generator(buffer, REPLY_TIMEOUT_S)
        close_admission(taker)
        replica = replica_for(buffer, peers)
        replica.stopping = True  # as SIGTERM sets it

        try:
            assert replica.ask_for_work(BATCH) is None
            replica.leave()  # skips the held request's (empty) answer, reads its Ack
        finally:
            replica.scorer.close()
        # the request reached the buffer before Leave (one connection keeps the order)
        assert buffer.service.counters["work_requests_held"] == 1
        assert buffer.store.counters["generators_left"] == 1
        assert not buffer.service.held
        assert "gen-w" not in buffer.store.last_seen
        assert replica.buffer.socket.poll(0) == 0  # both replies were read


def test_a_busy_replica_does_not_ask_the_buffer_to_hold_its_request(peers):
    config = make_config(heartbeat_interval_s=20)
    with running_buffer(config) as buffer:
        taker = peers.generator(buffer, REPLY_TIMEOUT_S)
        close_admission(taker)
        replica = replica_for(buffer, peers)
        replica.active.append(object())  # a rollout in progress
        looked: list[bool] = []
        replica.sync_weights = lambda: looked.append(True)  # no weight server in this test
        try:
            assert not replica.idle()
            grant = replica.ask_for_work(BATCH)
        finally:
            replica.scorer.close()
        assert grant is not None and grant.items == [] and grant.retry_after_s > 0
        assert looked == [True]  # while the buffer answered
        assert buffer.service.counters["work_requests_held"] == 0
