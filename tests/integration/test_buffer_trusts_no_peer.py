"""The buffer trusts no peer's word: each attack that once worked on a live run, refused.

A real BufferService over TCP with authentication on (a per-run secret, PLAIN on
loopback). Peers are the run's roles, each with its own credentials
(``buffer_wire.Peers``): the real generator speaks as its process (an
incarnation of its own), the attacker holds a generator's, or the learner's,
credentials but not that process's incarnation; a stranger holds none and gets
no reply at all. Each test drives one attack and checks that nothing of it
reached the store (nor the learner's batches), that it was counted as
``buffer_rejected_<reason>``, and that the run goes on.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import numpy as np
import pytest
import zmq

from asyncrl.core.messages import (
    SCHEMA_VERSION,
    Ack,
    BatchRequest,
    ErrorReply,
    EvalResultsRequest,
    Heartbeat,
    Join,
    Joined,
    Leave,
    SaveBufferState,
    StartEval,
    Status,
    StatusRequest,
    Trajectories,
    WorkGrant,
    WorkRequest,
    decode,
    encode,
)
from asyncrl.core.paths import checkpoint_dir
from asyncrl.core.transport import client_socket
from tests.helpers.buffer_wire import (
    Peers,
    buffer_config,
    exchange,
    exchange_frames,
    trajectories,
)
from tests.helpers.running_buffer import RunningBuffer, running_buffer

pytestmark = pytest.mark.timeout(120)

GROUP_SIZE = 4
BATCH = 2 * GROUP_SIZE
REPLY_TIMEOUT_S = 10.0
NO_REPLY_MS = 1000
"""How long a peer that must get no reply waits for one."""
REAL = 0x5EED_1234_ABCD
"""The real generator's incarnation; the attacker does not know it."""
FORGED = 42


@pytest.fixture
def make_buffer(tmp_path: Path) -> Iterator:
    """Start buffers of this test (``overrides`` as ``buffer_config`` takes them), each
    saving checkpoints under ``tmp_path``; all stopped at the end."""
    started: list = []

    def make(*overrides: str, **options) -> RunningBuffer:
        context = running_buffer(buffer_config(*overrides, group_size=GROUP_SIZE, **options))
        buffer = context.__enter__()
        buffer.service.run_dir = tmp_path
        started.append(context)
        return buffer

    yield make
    for context in reversed(started):
        context.__exit__(None, None, None)


@pytest.fixture
def buffer(make_buffer) -> RunningBuffer:
    return make_buffer()


def take_work(sock: zmq.Socket, generator_id: str = "gen-0", incarnation: int = REAL) -> list:
    """The real generator asks for a batch of work; returns its items."""
    grant = exchange(sock, WorkRequest(generator_id, BATCH, incarnation=incarnation))
    assert isinstance(grant, WorkGrant) and len(grant.items) == 2, grant
    return grant.items


def deliver(sock: zmq.Socket, items, generator_id: str = "gen-0", **options) -> None:
    """The real generator delivers its groups whole."""
    for item in items:
        body, arrays = trajectories(
            item.group_id, range(GROUP_SIZE), generator_id, incarnation=REAL, **options
        )
        assert exchange(sock, body, arrays) == Ack(accepted=GROUP_SIZE)


def refused(reply, reason: str) -> bool:
    return isinstance(reply, ErrorReply) and reply.reason == reason


def no_reply(endpoint: str, body) -> bool:
    """A peer without the run's credentials sends ``body``: True if nothing comes back."""
    context = zmq.Context()
    try:
        sock = client_socket(context, endpoint, timeout_s=NO_REPLY_MS / 1000)
        sock.send_multipart(encode(body))
        return sock.poll(NO_REPLY_MS) == 0
    finally:
        context.destroy(linger=0)


def status_stats(buffer: RunningBuffer, peers: Peers) -> dict[str, float]:
    status = exchange(peers.observer(buffer), StatusRequest())
    assert isinstance(status, Status), status
    return status.stats


# ------------------------------------------------------------------ forged samples


def test_forged_samples_under_a_live_generator_s_id_are_refused_and_never_stored(buffer, peers):
    real, attacker = peers.generator(buffer), peers.generator(buffer)
    items = take_work(real)

    for incarnation in (0, FORGED):  # whatever it guesses, it is not the real process
        body, arrays = trajectories(
            items[0].group_id, range(GROUP_SIZE), "gen-0", incarnation=incarnation
        )
        assert refused(exchange(attacker, body, arrays), "wrong_incarnation")
    assert buffer.store.counters["accepted"] == 0
    assert buffer.store.in_flight[items[0].group_id].samples == {}

    deliver(real, items)  # the real samples still go in, whole
    batch = exchange(peers.learner(buffer), BatchRequest(policy_version=0))
    assert isinstance(batch, Trajectories) and len(batch.samples) == BATCH
    assert batch.stats["buffer_rejected_wrong_incarnation"] == 2.0


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"reward": float("nan")}, "bad_reward"),
        ({"reward": float("inf")}, "bad_reward"),
        ({"reward": 1e6}, "bad_reward"),
        ({"response_ids": 10**6}, "bad_tokens"),
        ({"response_ids": -1}, "bad_tokens"),
        ({"logprobs": float("nan")}, "bad_logprobs"),
        ({"logprobs": 3.0}, "bad_logprobs"),
        ({"token_versions": 2**30}, "bad_version"),
        ({"token_versions": -1}, "bad_version"),
        ({"loss_mask": 7}, "bad_mask"),
        ({"prompt_ids": 2}, "bad_prompt"),
    ],
    ids=lambda value: str(value).replace(" ", ""),
)
def test_poisoned_samples_are_refused_whole_and_the_learner_never_sees_them(
    buffer, peers, change, reason
):
    """NaN rewards made the loss and the weights NaN; token 10**6 killed the learner in
    its embedding. Even from the real generator, such a message is refused whole."""
    generator, learner = peers.generator(buffer), peers.learner(buffer)
    items = take_work(generator)
    ((field, value),) = change.items()
    if field == "reward":
        body, arrays = trajectories(
            items[0].group_id, range(GROUP_SIZE), "gen-0", incarnation=REAL, reward=value
        )
    else:
        body, arrays = trajectories(items[0].group_id, range(GROUP_SIZE), "gen-0", incarnation=REAL)
        arrays[field] = arrays[field].copy()
        arrays[field][-1] = value  # one token of the last sample

    assert refused(exchange(generator, body, arrays), reason)
    assert buffer.store.counters["accepted"] == 0
    assert buffer.store.in_flight[items[0].group_id].samples == {}

    deliver(generator, items)  # the group regenerated cleanly is taken
    batch = exchange(learner, BatchRequest(policy_version=0))
    assert isinstance(batch, Trajectories)
    assert all(np.isfinite(meta.reward) and meta.reward == 0.5 for meta in batch.samples)
    assert batch.stats[f"buffer_rejected_{reason}"] == 1.0  # into metrics.jsonl with the batch
    assert status_stats(buffer, peers)[f"buffer_rejected_{reason}"] == 1.0


def test_samples_whose_prompt_is_not_the_one_handed_out_are_refused(buffer, peers):
    generator = peers.generator(buffer)
    items = take_work(generator)
    other = items[1].prompt_ids
    body, arrays = trajectories(
        items[0].group_id, range(GROUP_SIZE), "gen-0", prompt_ids=[*other, 5], incarnation=REAL
    )
    assert refused(exchange(generator, body, arrays), "bad_lengths")
    body, arrays = trajectories(
        items[0].group_id, range(GROUP_SIZE), "gen-0", prompt_ids=other, incarnation=REAL
    )
    assert refused(exchange(generator, body, arrays), "bad_prompt")
    body, arrays = trajectories(items[0].group_id, [0, 1, 1], "gen-0", incarnation=REAL)
    assert refused(exchange(generator, body, arrays), "bad_index")
    body, arrays = trajectories(items[0].group_id, [GROUP_SIZE], "gen-0", incarnation=REAL)
    assert refused(exchange(generator, body, arrays), "bad_index")
    assert buffer.store.counters["accepted"] == 0


# ----------------------------------------------------------------- the learner's version


def test_a_batch_request_far_ahead_is_refused_and_evicts_nothing(buffer, peers):
    """BatchRequest(2**62) once evicted every held sample as stale and stalled the run."""
    generator, learner = peers.generator(buffer), peers.learner(buffer)
    deliver(generator, take_work(generator))

    for version in (2**62, 2, -1):
        assert refused(exchange(learner, BatchRequest(policy_version=version)), "bad_version")
    assert buffer.store.policy_version == 0
    assert buffer.store.counters["dropped_stale"] == 0
    assert buffer.store.held_samples() == BATCH

    batch = exchange(learner, BatchRequest(policy_version=0))
    assert isinstance(batch, Trajectories) and len(batch.samples) == BATCH
    assert batch.stats["buffer_rejected_bad_version"] == 3.0
    learner.send_multipart(encode(BatchRequest(policy_version=1)))  # the next step: accepted
    assert exchange(learner, SaveBufferState(step=1)) == Ack(accepted=1)
    assert buffer.store.policy_version == 1
    assert buffer.store.durable_state()["policy_version"] == 1


def test_eval_rounds_of_a_version_far_ahead_are_refused(make_buffer, peers):
    buffer = make_buffer("eval.every_steps=1", "eval.max_prompts=2")
    learner = peers.learner(buffer)
    assert refused(exchange(learner, StartEval(round=1, policy_version=2**40)), "bad_version")
    assert buffer.store.policy_version == 0 and buffer.store.evaluation.current is None
    assert exchange(learner, StartEval(round=1, policy_version=1)) == Ack(accepted=1)


# ------------------------------------------------------------------ stolen batches


def test_only_the_learner_gets_batches(buffer, peers):
    """Strangers' BatchRequests once took batches (counted served, never trained) and left
    the learner's own request unanswered."""
    generator, learner = peers.generator(buffer), peers.learner(buffer)
    learner.send_multipart(encode(BatchRequest(policy_version=0)))

    assert no_reply(buffer.endpoint, BatchRequest(policy_version=0))  # no credentials
    assert refused(exchange(generator, BatchRequest(policy_version=0)), "forbidden")
    assert refused(exchange(peers.observer(buffer), BatchRequest(policy_version=0)), "forbidden")
    deliver(generator, take_work(generator))

    assert learner.poll(int(REPLY_TIMEOUT_S * 1000)), "the learner's request was not answered"
    batch, _ = decode(learner.recv_multipart())
    assert isinstance(batch, Trajectories) and len(batch.samples) == BATCH
    assert buffer.store.counters["served"] == BATCH
    assert batch.stats["buffer_rejected_forbidden"] == 2.0


def test_a_generator_cannot_speak_for_the_learner_nor_the_learner_for_a_generator(
    make_buffer, peers
):
    buffer = make_buffer("eval.every_steps=1", "eval.max_prompts=2")
    generator, learner, observer = (
        peers.generator(buffer),
        peers.learner(buffer),
        peers.observer(buffer),
    )
    learner_only = [
        BatchRequest(policy_version=0),
        StartEval(round=1, policy_version=0),
        EvalResultsRequest(wait_s=0.0),
        SaveBufferState(step=0, abandoned_batch_request=True),
    ]
    generator_only = [
        (WorkRequest("gen-0", BATCH), None),
        (Heartbeat("gen-0"), None),
        (Join("gen-0"), None),
        (Leave("gen-0"), None),
        trajectories(0, range(GROUP_SIZE), "gen-0"),
    ]
    for body in learner_only:
        assert refused(exchange(generator, body), "forbidden"), body
        assert refused(exchange(observer, body), "forbidden"), body
    for body, arrays in generator_only:
        assert refused(exchange(learner, body, arrays), "forbidden"), body
        assert refused(exchange(observer, body, arrays), "forbidden"), body
    for sock in (generator, learner, observer):
        assert isinstance(exchange(sock, StatusRequest()), Status)

    store = buffer.store
    assert (store.cursor, store.policy_version, store.last_seen) == (0, 0, {})
    assert store.evaluation.current is None
    assert not list(buffer.service.run_dir.iterdir())  # nothing saved
    assert buffer.service.rejected["forbidden"] == 2 * len(learner_only) + 2 * len(generator_only)


# --------------------------------------------------------------- handing batches back


def test_a_batch_goes_back_only_once_and_only_from_the_learner_it_was_served_to(buffer, peers):
    """SaveBufferState(abandoned_batch_request=True) x20 once handed groups back that the
    learner had trained, so it trained them twice, and wrote junk checkpoint folders."""
    generator, learner = peers.generator(buffer), peers.learner(buffer)
    other_learner = peers.learner(buffer)  # the learner's credentials, another connection
    deliver(generator, take_work(generator))
    first = exchange(learner, BatchRequest(policy_version=0))
    assert isinstance(first, Trajectories)
    trained = {meta.group_id for meta in first.samples}

    abandon = SaveBufferState(step=1, abandoned_batch_request=True)
    for _ in range(20):
        assert exchange(other_learner, abandon) == Ack(accepted=1)
        assert refused(exchange(generator, abandon), "forbidden")
    assert buffer.store.counters["returned_unconsumed"] == 0
    for step in (10**6, 2, -1):
        assert refused(exchange(learner, SaveBufferState(step=step)), "bad_step")
    run_dir = buffer.service.run_dir
    assert list(run_dir.glob("checkpoints/*")) == [checkpoint_dir(run_dir, 1)]

    learner.send_multipart(encode(BatchRequest(policy_version=1)))
    deliver(generator, take_work(generator))
    assert learner.poll(int(REPLY_TIMEOUT_S * 1000))
    second, _ = decode(learner.recv_multipart())
    assert isinstance(second, Trajectories)
    assert trained.isdisjoint(meta.group_id for meta in second.samples)  # none trained twice

    # the learner that abandoned the request for ``second`` hands it back, once
    assert exchange(learner, abandon) == Ack(accepted=1)
    assert exchange(learner, abandon) == Ack(accepted=1)
    assert buffer.store.counters["returned_unconsumed"] == BATCH
    stats = status_stats(buffer, peers)
    assert stats["buffer_abandon_noops"] == 21.0
    assert stats["buffer_rejected_bad_step"] == 3.0


# --------------------------------------------------------------- a live generator's id


def test_another_process_cannot_book_keep_alive_or_hand_back_a_live_generator_s_work(
    make_buffer, peers
):
    """A WorkRequest under a live generator's name once booked groups that were never
    generated nor requeued, and admission stalled the run."""
    timeout_s = 1.0
    buffer = make_buffer(heartbeat_timeout_s=timeout_s, heartbeat_interval_s=0.1)
    real, attacker = peers.generator(buffer), peers.generator(buffer)
    items = take_work(real)
    booked = sorted(item.group_id for item in items)

    for body in (
        WorkRequest("gen-0", BATCH, incarnation=FORGED),
        WorkRequest("gen-0", BATCH, wait_s=1.0),
        Leave("gen-0", incarnation=FORGED),
        Heartbeat("gen-0", incarnation=FORGED),
    ):
        assert refused(exchange(attacker, body), "wrong_incarnation"), body
    assert sorted(buffer.store.in_flight) == booked  # nothing more booked, nothing handed back
    assert buffer.store.cursor == len(booked)
    assert buffer.store.counters["requeued_groups"] == 0

    # the real one falls silent: the attacker's heartbeats do not keep its groups
    deadline = time.monotonic() + 10 * timeout_s
    while buffer.store.counters["requeued_groups"] < len(booked):
        assert time.monotonic() < deadline, "the silent generator's groups were kept"
        exchange(attacker, Heartbeat("gen-0", FORGED))  # refused while the real one lives
        time.sleep(0.1)
    assert buffer.service.rejected["wrong_incarnation"] >= 4 + 5  # 1 s of 0.1 s beats
    # and are handed out again, to whoever asks next (the id is free once expired)
    regrant = exchange(attacker, WorkRequest("gen-1", BATCH))
    assert sorted(item.group_id for item in regrant.items) == booked


def test_a_restarted_process_that_joins_under_its_old_id_replaces_the_old_one(buffer, peers):
    old, new = peers.generator(buffer), peers.generator(buffer)
    assert isinstance(exchange(old, Join("gen-0", incarnation=REAL)), Joined)
    items = take_work(old)
    body, arrays = trajectories(items[0].group_id, range(2), "gen-0", incarnation=REAL)
    assert exchange(old, body, arrays) == Ack(accepted=2)

    assert isinstance(exchange(new, Join("gen-0", incarnation=REAL + 1)), Joined)
    assert buffer.store.counters["generators_replaced"] == 1
    assert buffer.store.counters["requeued_groups"] == 2  # at once, not after a timeout
    assert buffer.store.counters["discarded_requeue"] == 2
    # the old process is not heard any more; the new one gets the requeued groups
    late, late_arrays = trajectories(
        items[0].group_id, range(2, GROUP_SIZE), "gen-0", incarnation=REAL
    )
    assert refused(exchange(old, late, late_arrays), "wrong_incarnation")
    regrant = exchange(new, WorkRequest("gen-0", BATCH, incarnation=REAL + 1))
    assert [item.group_id for item in regrant.items] == [item.group_id for item in items]
    assert status_stats(buffer, peers)["buffer_generators_replaced"] == 1.0


# ----------------------------------------------------------------------- stats


def test_a_generator_s_stats_are_bounded_to_known_finite_counters(buffer, peers):
    """A stats dict of 100,000 keys once made every later metrics line 10 MB; a forged
    ``restarts`` raised generators_restarts_total with no restart."""
    generator, learner = peers.generator(buffer), peers.learner(buffer)
    items = take_work(generator)
    group = items[0].group_id
    for stats, why in [
        ({f"junk_{i}": 1.0 for i in range(20_000)}, "many keys"),
        ({"evil_counter": 1.0}, "unknown"),
        ({"samples_sent": float("nan")}, "not finite"),
        ({"samples_sent": 1e300}, "huge"),
        ({"restarts": 1000.0}, "forged restarts"),
        ({"restarts": 1.0}, "restarts from an id that was never restarted"),
    ]:
        body, arrays = trajectories(group, range(GROUP_SIZE), "gen-0", incarnation=REAL)
        forged = msgspec.structs.replace(body, stats=stats)
        assert refused(exchange(generator, forged, arrays), "bad_stats"), why
    body, arrays = trajectories(group, range(GROUP_SIZE), "gen-0", incarnation=REAL)
    huge = msgspec.structs.replace(body, stats={f"junk_{i}": 1.0 for i in range(100_000)})
    assert refused(exchange(generator, huge, arrays), "oversized")  # a 2 MB header
    for pool in ("x" * 100, "no spaces", "../etc"):
        body, arrays = trajectories(group, range(GROUP_SIZE), "gen-0", incarnation=REAL)
        forged = msgspec.structs.replace(body, pool=pool)
        assert refused(exchange(generator, forged, arrays), "bad_pool"), pool
    assert buffer.store.counters["accepted"] == 0

    honest = {"samples_sent": 8.0, "busy_s": 1.0, "wall_s": 2.0, "restarts": 0.0}
    deliver(generator, items, stats=honest)
    batch = exchange(learner, BatchRequest(policy_version=0))
    assert isinstance(batch, Trajectories)
    assert not [key for key in batch.stats if "junk" in key or "evil" in key]
    assert batch.stats["generators_restarts_total"] == 0.0
    assert batch.stats["generators_samples_sent_total"] == 8.0
    assert batch.stats["buffer_rejected_bad_stats"] == 6.0
    assert len(msgspec.json.encode(batch.stats)) < 20_000


# ---------------------------------------------------------------- headers and queues


def test_a_header_of_100000_dimensions_is_refused_before_any_arithmetic(buffer, peers, capsys):
    """A 0.9 MB header declaring an array of 100,000 dimensions once froze the buffer's
    loop for 20 s (a product of big integers); it is refused while decoding."""
    generator = peers.generator(buffer, REPLY_TIMEOUT_S)
    header = msgspec.msgpack.encode(
        {
            "schema_version": SCHEMA_VERSION,
            "body": {"type": "trajectories", "samples": []},
            "arrays": [["prompt_ids", "int32", [2**33] * 100_000]],
        }
    )
    assert 800_000 < len(header) < 1 << 20  # under the header cap: the shape cap refuses it
    assert isinstance(exchange(generator, StatusRequest()), Status)  # connected, authenticated
    started = time.perf_counter()
    reply, _ = exchange_frames(generator, [header, b""])
    elapsed = time.perf_counter() - started
    assert refused(reply, "bad_array"), reply
    assert "length <= 8" in reply.detail
    with capsys.disabled():
        print(f"\n100,000-dimension header: refused in {elapsed * 1000:.1f} ms over the socket")

    too_big = msgspec.msgpack.encode(
        {
            "schema_version": SCHEMA_VERSION,
            "body": {"type": "heartbeat", "generator_id": "x" * 2**20},
        }
    )  # over the 1 MiB the buffer decodes, under the socket's frame cap (2 MiB)
    assert refused(exchange_frames(generator, [too_big])[0], "oversized")
    assert isinstance(exchange(generator, StatusRequest()), Status)  # still serving


def test_a_peer_that_never_reads_its_replies_cannot_stall_the_buffer(buffer, peers, caplog):
    """Replies to a peer whose queue is full are dropped (``unroutable_reply``), never
    waited for, and logged a line at a time: the buffer goes on serving everyone else."""
    caplog.set_level(logging.WARNING, logger="asyncrl.buffer")
    context = peers.context(buffer.config, "observer")
    greedy = context.socket(zmq.DEALER)
    greedy.setsockopt(zmq.LINGER, 0)
    greedy.setsockopt(zmq.RCVHWM, 1)
    greedy.setsockopt(zmq.RCVBUF, 4096)
    greedy.connect(buffer.endpoint)
    generator = peers.generator(buffer, REPLY_TIMEOUT_S)
    request = encode(StatusRequest())
    deadline = time.monotonic() + 60
    while buffer.service.rejected["unroutable_reply"] <= 100:  # well after its queue filled
        assert time.monotonic() < deadline, "the buffer did not drop the replies it cannot send"
        for _ in range(500):
            greedy.send_multipart(request)
        assert isinstance(exchange(generator, StatusRequest()), Status)  # served meanwhile
    items = take_work(generator)
    deliver(generator, items)
    assert buffer.store.counters["accepted"] == BATCH
    greedy.close(linger=0)
    dropped = [r for r in caplog.records if "could not reply" in r.getMessage()]
    assert 1 <= len(dropped) <= 3  # one line per REJECTION_LOG_EVERY_S, not one per reply


def test_one_generator_cannot_hold_more_work_than_a_replica_could_be_generating(make_buffer, peers):
    """At most ``MAX_IN_FLIGHT_FACTOR * max_active_samples`` samples in flight per id (here
    4 x 2): one generator cannot book the whole admission budget (here 16)."""
    buffer = make_buffer("generators.max_active_samples=2")
    generator = peers.generator(buffer)
    grant = exchange(generator, WorkRequest("gen-0", 100, incarnation=REAL))
    assert sum(item.num_samples for item in grant.items) == 4 * 2
    again = exchange(generator, WorkRequest("gen-0", 100, incarnation=REAL))
    assert again.items == [] and again.retry_after_s > 0
    other = exchange(peers.generator(buffer), WorkRequest("gen-1", 100))
    assert sum(item.num_samples for item in other.items) == 4 * 2  # the rest of the budget
    body, arrays = trajectories(grant.items[0].group_id, range(2), "gen-0", incarnation=REAL)
    assert exchange(generator, body, arrays) == Ack(accepted=2)  # delivered: room again
    stats = status_stats(buffer, peers)
    assert stats["buffer_work_requests_capped"] == 3.0  # 100 > 8, thrice
    assert buffer.store.in_flight_samples("gen-0") == 8 - 2
