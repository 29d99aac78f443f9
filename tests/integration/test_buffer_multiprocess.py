"""The buffer in its own process, generators in theirs: heartbeat loss and back-pressure.

The buffer is started as ``asyncrl launch`` starts it (the local
``Supervisor`` runs ``python -m asyncrl.run.roles buffer RUN_DIR`` on the
``config.yaml`` it reads). Each generator-like client is a separate process
(multiprocessing spawn) speaking the real protocol over TCP on 127.0.0.1:
``WorkRequest``, ``Trajectories`` and ``Heartbeat`` in, ``WorkGrant`` and
``Ack`` out. A client reports what it sees to the test through a pipe, each
event stamped with ``time.monotonic()`` (one clock for every process on
Linux). The test process plays the learner (``BatchRequest``) and reads the
buffer's counters from the ``stats`` every batch carries.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import time
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from pathlib import Path

import pytest

from asyncrl.config import ClusterConfig, Config, save_config
from asyncrl.core.messages import Ack, BatchRequest, Heartbeat, Trajectories, WorkGrant, WorkRequest
from asyncrl.core.security import GENERATOR, LEARNER, client_context
from asyncrl.core.transport import client_socket, tcp
from asyncrl.run.launch import Supervisor, make_run_dir
from tests.helpers.buffer_wire import buffer_config, exchange, send_samples

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

GROUP_SIZE = 4
BATCH = 2 * GROUP_SIZE  # samples_per_step: two groups
TIMEOUT_S = 1.0
HEARTBEAT_S = 0.2
REPLY_TIMEOUT_S = 20.0  # the first request also waits for the buffer process to start
EVENT_TIMEOUT_S = 20.0
SPAWN = multiprocessing.get_context("spawn")
SAMPLE = {"response_len": 4, "reward": lambda i: 0.25 * i, "generate_time_s": 0.1}
"""How the clients' samples look (``trajectories`` options; quickstart's
``generators.max_new_tokens`` is 4, and each sample carries its group's prompt)."""


# --------------------------------------------------------------------------
# client processes (module level: spawn imports this module in the child)


def item_key(item) -> tuple:
    """What identifies a prompt handed out: its group, sample count, tokens and answer."""
    return (item.group_id, item.num_samples, tuple(item.prompt_ids), item.ground_truth)


def stalling_generator(
    endpoint: str, cluster: ClusterConfig, generator_id: str, conn: Connection
) -> None:
    """Take two groups, deliver half of the first, then only heartbeat until told otherwise.

    On ``"send_rest"`` it delivers the rest of its work late and reports the acks.
    """
    context = client_context(cluster, GENERATOR)
    sock = client_socket(context, endpoint, REPLY_TIMEOUT_S)
    grant = exchange(sock, WorkRequest(generator_id, max_samples=BATCH))
    assert isinstance(grant, WorkGrant), grant
    groups = [item.group_id for item in grant.items]
    half = list(range(GROUP_SIZE // 2))
    ack = send_samples(sock, groups[0], half, generator_id, **SAMPLE)
    conn.send(("granted", time.monotonic(), [item_key(i) for i in grant.items], ack))
    while True:
        if conn.poll(HEARTBEAT_S):
            assert conn.recv() == "send_rest"
            rest = list(range(GROUP_SIZE // 2, GROUP_SIZE))
            late = [send_samples(sock, groups[0], rest, generator_id, **SAMPLE)]
            late += [
                send_samples(sock, group, range(GROUP_SIZE), generator_id, **SAMPLE)
                for group in groups[1:]
            ]
            conn.send(("late", time.monotonic(), late))
            return
        assert exchange(sock, Heartbeat(generator_id)) == Ack(accepted=0)


def steady_generator(
    endpoint: str, cluster: ClusterConfig, generator_id: str, conn: Connection, groups: int
) -> None:
    """Ask for work as a replica does (waiting ``retry_after_s`` when refused) and finish every
    group it is given at once, until it has finished ``groups`` groups."""
    context = client_context(cluster, GENERATOR)
    sock = client_socket(context, endpoint, REPLY_TIMEOUT_S)
    finished = 0
    while finished < groups:
        grant = exchange(sock, WorkRequest(generator_id, max_samples=BATCH))
        assert isinstance(grant, WorkGrant), grant
        if not grant.items:
            time.sleep(grant.retry_after_s)
            continue
        conn.send(("granted", time.monotonic(), [item_key(i) for i in grant.items]))
        for item in grant.items:
            ack = send_samples(sock, item.group_id, range(item.num_samples), generator_id, **SAMPLE)
            conn.send(("ack", time.monotonic(), item.group_id, ack))
            finished += 1
    conn.send(("done", time.monotonic()))


def fast_sender(endpoint: str, cluster: ClusterConfig, generator_id: str, conn: Connection) -> None:
    """Ask for work again and again and send each group as soon as it is granted; report
    every grant, refusal and ack, until the test says ``"stop"``."""
    context = client_context(cluster, GENERATOR)
    sock = client_socket(context, endpoint, REPLY_TIMEOUT_S)
    while not conn.poll(0):
        grant = exchange(sock, WorkRequest(generator_id, max_samples=BATCH))
        assert isinstance(grant, WorkGrant), grant
        if not grant.items:
            conn.send(("refused", time.monotonic(), grant.retry_after_s))
            time.sleep(grant.retry_after_s)
            continue
        conn.send(("granted", time.monotonic(), [item_key(i) for i in grant.items]))
        for item in grant.items:
            ack = send_samples(sock, item.group_id, range(item.num_samples), generator_id, **SAMPLE)
            conn.send(("ack", time.monotonic(), item.group_id, ack))
    assert conn.recv() == "stop"
    conn.send(("stopped", time.monotonic()))


# --------------------------------------------------------------------------
# the test side


class Run:
    """A buffer process, the client processes of one test, and the learner's socket."""

    def __init__(self, config: Config, run_dir: Path):
        self.config = config
        self.run_dir = make_run_dir(config, run_dir)
        save_config(config, self.run_dir / "config.yaml")
        self.endpoint = tcp("127.0.0.1", config.cluster.buffer_port)
        self.supervisor = Supervisor(config, self.run_dir)
        self.clients: list[multiprocessing.Process] = []
        self.context = client_context(config.cluster, LEARNER)
        self.learner = client_socket(self.context, self.endpoint, REPLY_TIMEOUT_S)

    def start_client(self, target: Callable, generator_id: str, *args) -> tuple:
        ours, theirs = SPAWN.Pipe()
        process = SPAWN.Process(
            target=target,
            args=(self.endpoint, self.config.cluster, generator_id, theirs, *args),
            daemon=True,
        )
        process.start()
        theirs.close()
        self.clients.append(process)
        return process, ours

    def batch(self) -> tuple[Trajectories, float]:
        """The learner asks for a batch at version 0; the batch and how long it took."""
        start = time.monotonic()
        batch = exchange(self.learner, BatchRequest(policy_version=0))
        assert isinstance(batch, Trajectories), batch
        return batch, time.monotonic() - start

    def buffer_log(self) -> str:
        return (self.run_dir / "logs" / "buffer.log").read_text()

    def close(self) -> None:
        for process in self.clients:
            if process.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signal.SIGCONT)  # a stopped process cannot die
                process.kill()
            process.join(10)
        self.learner.close(linger=0)
        self.context.term()
        self.supervisor.stop_all()


@contextlib.contextmanager
def buffer_run(tmp_path: Path, *overrides: str) -> Iterator[Run]:
    config = buffer_config(
        "tracking.aim=false",
        *overrides,
        group_size=GROUP_SIZE,
        heartbeat_timeout_s=TIMEOUT_S,
        heartbeat_interval_s=HEARTBEAT_S,
    )
    run = Run(config, tmp_path / "run")
    try:
        run.supervisor.start("buffer", "buffer")
        yield run
        assert run.supervisor.failure() is None, run.supervisor.failure()
    finally:
        run.close()
    buffer = run.supervisor.processes["buffer"]
    assert buffer.returncode == 0, f"buffer did not stop cleanly:\n{run.buffer_log()}"


def next_event(conn: Connection, kind: str, timeout_s: float = EVENT_TIMEOUT_S) -> tuple:
    """The next event of ``kind`` from a client; the events before it are returned with it."""
    deadline = time.monotonic() + timeout_s
    while conn.poll(max(0.0, deadline - time.monotonic())):
        event = conn.recv()
        if event[0] == kind:
            return event
    raise AssertionError(f"no '{kind}' event within {timeout_s}s")


def events_until(conn: Connection, kind: str, timeout_s: float = EVENT_TIMEOUT_S) -> list[tuple]:
    """Every event up to and including the next one of ``kind``."""
    events, deadline = [], time.monotonic() + timeout_s
    while conn.poll(max(0.0, deadline - time.monotonic())):
        events.append(conn.recv())
        if events[-1][0] == kind:
            return events
    raise AssertionError(f"no '{kind}' event within {timeout_s}s; got {events}")


def pending_events(conn: Connection) -> list[tuple]:
    events = []
    while conn.poll(0):
        events.append(conn.recv())
    return events


def granted_groups(events: list[tuple]) -> list[int]:
    return [key[0] for event in events if event[0] == "granted" for key in event[2]]


def acks_of(events: list[tuple]) -> dict[int, Ack]:
    return {event[2]: event[3] for event in events if event[0] == "ack"}


# --------------------------------------------------------------------------
# heartbeat loss


@pytest.mark.parametrize("failure", ["killed", "stalled"])
def test_a_lost_generator_s_groups_go_to_another_process_and_late_samples_are_dropped(
    tmp_path, failure
):
    """gen-a takes groups 0 and 1, delivers half of group 0, heartbeats, then goes silent:
    SIGKILL (a crash) or SIGSTOP (a stall; it is resumed later and delivers its work late)."""
    with buffer_run(tmp_path) as run:
        a, a_conn = run.start_client(stalling_generator, "gen-a")
        _, taken_at, a_items, a_ack = next_event(a_conn, "granted")
        assert [key[0] for key in a_items] == [0, 1]
        assert a_ack == Ack(accepted=GROUP_SIZE // 2)

        # gen-b gets new work up to the admission limit ((0 + 1 + 1) * BATCH = 4 groups)
        b, b_conn = run.start_client(steady_generator, "gen-b", 4)
        assert granted_groups([next_event(b_conn, "granted")]) == [2, 3]

        # gen-a keeps heartbeating past the timeout: its groups stay its own
        time.sleep(1.5 * TIMEOUT_S)
        assert a.is_alive()
        assert time.monotonic() - taken_at > TIMEOUT_S
        assert granted_groups(pending_events(b_conn)) == []

        os.kill(a.pid, signal.SIGKILL if failure == "killed" else signal.SIGSTOP)
        silent_from = time.monotonic()
        regrant = next_event(b_conn, "granted")
        # the same prompts, handed out again once gen-a was silent for the timeout
        assert regrant[2] == a_items
        waited = regrant[1] - silent_from
        assert TIMEOUT_S - HEARTBEAT_S - 0.1 <= waited <= TIMEOUT_S + 1.5, waited
        b_events = events_until(b_conn, "done")
        assert acks_of(b_events) == dict.fromkeys([0, 1], Ack(accepted=GROUP_SIZE))
        b.join(10)
        assert b.exitcode == 0

        late_rejected = 0
        if failure == "stalled":
            a_conn.send("send_rest")
            os.kill(a.pid, signal.SIGCONT)
            _, _, late = next_event(a_conn, "late")
            # presumed dead: what it finished after its groups went to gen-b is refused
            assert late == [Ack(0, GROUP_SIZE // 2), Ack(0, GROUP_SIZE)]
            late_rejected = GROUP_SIZE // 2 + GROUP_SIZE
            a.join(10)
            assert a.exitcode == 0
        else:
            a.join(10)
            assert a.exitcode == -signal.SIGKILL

        first, _ = run.batch()
        second, _ = run.batch()
        served = [(m.group_id, m.sample_index, m.generator_id) for m in first.samples]
        served += [(m.group_id, m.sample_index, m.generator_id) for m in second.samples]
        assert sorted(served) == [(g, i, "gen-b") for g in range(4) for i in range(GROUP_SIZE)]
        stats = second.stats
        assert stats["buffer_requeued_groups"] == 2.0
        assert stats["buffer_discarded_requeue"] == GROUP_SIZE // 2  # gen-a's half group
        assert stats["buffer_dropped_duplicate"] == late_rejected
        assert stats["buffer_accepted"] == GROUP_SIZE // 2 + 4 * GROUP_SIZE
        assert stats["buffer_served"] == 2 * BATCH
        assert stats["buffer_held"] == 0.0
        assert stats["buffer_in_flight_groups"] == 0.0
    assert "generator gen-a silent for over 1.0s" in run.buffer_log()


# --------------------------------------------------------------------------
# back-pressure


def test_back_pressure_holds_a_fast_sender_without_dropping_and_the_learner_is_served(tmp_path):
    held_bound = 2 * BATCH  # four groups
    overrides = [f"buffer.max_held_samples={held_bound}", "buffer.max_staleness=3"]
    with buffer_run(tmp_path, *overrides) as run:
        sender, conn = run.start_client(fast_sender, "gen-fast")

        # it fills the buffer to the bound, then is told to wait, again and again
        filling = events_until(conn, "refused")
        assert granted_groups(filling) == [0, 1, 2, 3]
        assert acks_of(filling) == dict.fromkeys(range(4), Ack(accepted=GROUP_SIZE))
        refusals = [next_event(conn, "refused") for _ in range(5)]
        assert all(event[2] > 0 for event in refusals)  # retry_after_s
        assert not [e for e in pending_events(conn) if e[0] != "refused"]

        # the learner is answered at once while the buffer is full
        batch, latency = run.batch()
        assert latency < 1.0, latency
        assert [(m.group_id, m.sample_index) for m in batch.samples] == [
            (g, i) for g in (0, 1) for i in range(GROUP_SIZE)
        ]
        refused_so_far = batch.stats["buffer_backpressure_refusals"]
        assert refused_so_far >= 6
        assert batch.stats["buffer_admission_refusals"] == 0.0
        assert batch.stats["buffer_accepted"] == held_bound
        assert batch.stats["buffer_held"] == BATCH

        # room again: the sender is given the next prompts, and fills up to the bound again
        assert granted_groups([next_event(conn, "granted")]) == [4, 5]
        refilling = events_until(conn, "refused")
        assert granted_groups(refilling) == []
        assert acks_of(refilling) == dict.fromkeys([4, 5], Ack(accepted=GROUP_SIZE))

        conn.send("stop")
        next_event(conn, "stopped")
        sender.join(10)
        assert sender.exitcode == 0

        # nothing it sent was dropped: the learner gets every group, in order
        rest = [run.batch()[0] for _ in range(2)]
        served = [m.group_id for b in rest for m in b.samples]
        assert served == [g for g in (2, 3, 4, 5) for _ in range(GROUP_SIZE)]
        stats = rest[-1].stats
        assert stats["buffer_accepted"] == stats["buffer_served"] == 6 * GROUP_SIZE
        assert stats["buffer_backpressure_refusals"] > refused_so_far
        for counter in ("dropped_stale", "dropped_duplicate", "dropped_unknown", "filtered"):
            assert stats[f"buffer_{counter}"] == 0.0, counter
        assert stats["buffer_held"] == 0.0
