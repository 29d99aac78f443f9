"""The deadline of the collective path: a replica stopped (SIGSTOP) in the middle of a
broadcast is cut off at the deadline, the learner goes on serving the others, and the
stopped replica, once resumed, falls back to ZeroMQ and ends with one whole version."""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import time
from functools import partial

import pytest
import torch

from asyncrl.core.transport import free_port, tcp
from asyncrl.weights import WeightPublisher
from asyncrl.weights.collective.sender import CollectiveSender
from tests.helpers.collective import (
    LEARNER_KEY,
    REPLICA_KEY,
    command,
    replica_main,
    version_tensors,
)
from tests.helpers.waiting import came_true

pytestmark = pytest.mark.slow

WIDTH, LAYERS = 512, 40  # 40 square layers of 1 MiB: about 41 MiB a version
BUCKET_BYTES = 1 << 20  # one layer's weight per bucket: about 80 broadcasts a version
DEADLINE_S = 3.0
PAUSE_AFTER = 4  # buckets received before the replica is stopped


def assert_holds(pipe, version: int) -> None:
    status, state, held = command(pipe, "params")
    assert status == "ok" and held == version
    expected = version_tensors(version, WIDTH, LAYERS)
    assert set(state) == set(expected)
    mixed = [name for name, tensor in expected.items() if not torch.equal(state[name], tensor)]
    assert mixed == [], f"tensors not of v{version}: {mixed[:5]}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("homing", [False, True], ids=["staging", "into-the-model"])
def test_a_replica_stopped_mid_broadcast_is_cut_off_and_falls_back_to_zmq(caplog, homing):
    """``homing``: the replica receives straight into its module's tensors, so the broken
    transfer leaves a mix, said (``partial``) and replaced whole by ZeroMQ."""
    caplog.set_level(logging.WARNING, logger="asyncrl.weights")
    publisher = WeightPublisher(tcp("127.0.0.1", free_port()))
    sender = CollectiveSender(
        publisher.snapshots,
        "127.0.0.1",
        0,
        LEARNER_KEY,
        bucket_bytes=BUCKET_BYTES,
        deadline_s=DEADLINE_S,
    )
    spawn = multiprocessing.get_context("spawn")
    pipes, processes = [], []
    for name, pause in (("stalled-0", PAUSE_AFTER), ("steady-1", None)):
        here, there = spawn.Pipe()
        target = partial(replica_main, name=name, layers=LAYERS, pause=pause, homing=homing)
        process = spawn.Process(
            target=target,
            args=(sender.address, REPLICA_KEY, BUCKET_BYTES, WIDTH, there),
            daemon=True,
        )
        process.start()
        pipes.append(here)
        processes.append(process)
    stalled, steady = pipes
    stopped = False
    try:
        publisher.publish(version_tensors(1, WIDTH, LAYERS), 1)
        assert command(steady, "sync", 60.0) == ("ok", 1, 1)

        stalled.send(("sync", 30.0))  # the replica's own deadline: far beyond the sender's
        assert stalled.poll(60) and stalled.recv() == ("in_broadcast", PAUSE_AFTER)
        os.kill(processes[0].pid, signal.SIGSTOP)
        stopped = True
        stopped_at = time.monotonic()

        # the learner goes on: the next version is published and reaches the other replica
        publish_s = time.perf_counter()
        publisher.publish(version_tensors(2, WIDTH, LAYERS), 2)
        assert time.perf_counter() - publish_s < DEADLINE_S
        assert command(steady, "sync", 60.0) == ("ok", 2, 2)
        assert_holds(steady, 2)

        # the stopped member is cut off at the sender's deadline, counted and logged
        missed = "weights_collective_deadline_missed_total"
        assert came_true(lambda: sender.stats().get(missed) == 1, DEADLINE_S + 30)
        assert time.monotonic() - stopped_at >= DEADLINE_S - 1.5  # not before its deadline
        assert sender.stats()["weights_collective_members"] == 1  # only the steady one left
        logged = [r.getMessage() for r in caplog.records if "missed the deadline" in r.getMessage()]
        assert len(logged) == 1 and "v1" in logged[0] and "stalled-0" in logged[0], logged

        os.kill(processes[0].pid, signal.SIGCONT)
        stopped = False
        reply = stalled.recv() if stalled.poll(60) else None
        assert reply is not None and reply[0] == "error", reply
        _, kind, message, partial_load, _, trace, held = reply
        assert kind == "WeightTransferError", trace
        assert held == 0, message  # the version is not claimed
        if homing:
            assert partial_load is True, message  # v1's first buckets are in the model
            assert_holds_mix(stalled)
        else:
            assert partial_load is False, message
            assert_holds_initial(stalled)  # the old weights, untouched

        # the chain's next path: ZeroMQ brings one whole version, the newest
        assert command(stalled, "zmq", publisher.endpoint) == ("ok", 2, 2)
        assert_holds(stalled, 2)

        # and the collective path comes back: a new group, the next version over it
        publisher.publish(version_tensors(3, WIDTH, LAYERS), 3)
        assert command(stalled, "sync", 60.0) == ("ok", 3, 3)
        assert_holds(stalled, 3)
        stats = sender.stats()
        assert stats["weights_collective_joins_accepted_total"] == 3  # 2 + the re-join
        assert stats["weights_collective_deadline_missed_total"] == 1
        assert stats["weights_collective_transfers_finished_total"] == 3  # v1, v2 steady; v3
    finally:
        if stopped:
            os.kill(processes[0].pid, signal.SIGCONT)
        for pipe in pipes:
            pipe.send(("stop",))
        for process in processes:
            process.join(30)
            if process.is_alive():
                process.kill()
        sender.close()
        publisher.close()


def assert_holds_initial(pipe) -> None:
    """The replica still holds the weights it started with (seed 0): nothing of v1 in them."""
    status, state, held = command(pipe, "params")
    assert status == "ok" and held == 0
    initial = version_tensors(0, WIDTH, LAYERS)
    assert all(torch.equal(state[name], tensor) for name, tensor in initial.items())


def assert_holds_mix(pipe) -> None:
    """The replica's module has some tensors of v1 and some of the initial weights."""
    status, state, _ = command(pipe, "params")
    assert status == "ok"
    initial, first = version_tensors(0, WIDTH, LAYERS), version_tensors(1, WIDTH, LAYERS)
    new = [name for name, tensor in first.items() if torch.equal(state[name], tensor)]
    old = [name for name, tensor in initial.items() if torch.equal(state[name], tensor)]
    assert new and old and len(new) + len(old) == len(first), (len(new), len(old))
