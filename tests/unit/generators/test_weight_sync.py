"""The weight-sync chain: fallback in order, deadlines, counters, partial loads."""

from __future__ import annotations

import time

import pytest
import zmq

from asyncrl.core.weight_messages import WEIGHT_SYNC_STATS
from asyncrl.generators.weight_sync import WeightSync
from asyncrl.weights import WeightClient
from asyncrl.weights.checks import WeightsRefused
from asyncrl.weights.source import Loaded, PathUnavailable, WeightTransferError
from asyncrl.weights.zmq.source import ZmqSource


class Engine:
    def __init__(self, version: int = 3):
        self.version = version
        self.last_load_s = 0.0


class Loads:
    """A path that loads ``version`` (or claims to, with ``lie``)."""

    def __init__(self, name: str, version: int | None, lie: bool = False):
        self.name, self.version, self.lie = name, version, lie
        self.asked: list[int] = []

    def sync_into(self, backend, have_version, deadline):
        self.asked.append(have_version)
        if self.version is None or self.version <= have_version:
            return None
        if not self.lie:
            backend.version = self.version
        return Loaded(self.version, 100.0, self.name, 0.01)

    def close(self):
        pass


class Fails:
    def __init__(self, name: str, partial: bool = False, unavailable: bool = False):
        self.name, self.partial, self.unavailable = name, partial, unavailable

    def sync_into(self, backend, have_version, deadline):
        if self.unavailable:
            raise PathUnavailable(f"{self.name}: not here")
        raise WeightTransferError(f"{self.name} v4: broken", partial=self.partial)

    def close(self):
        pass


def test_a_failing_path_falls_back_to_the_next_and_is_counted():
    zmq_path = Loads("zmq", 4)
    chain = WeightSync([Fails("shm"), zmq_path], deadline_s=5.0, replica="gen-0")
    engine = Engine(3)
    loaded = chain.sync(engine)
    assert (loaded.version, loaded.path, engine.version) == (4, "zmq", 4)
    assert zmq_path.asked == [3]
    assert chain.stats() == {
        "weights_transfer_failures": 1.0,
        "weights_failures_shm": 1.0,
        "weights_fallbacks": 1.0,
        "weights_loads_zmq": 1.0,
    }
    assert set(chain.stats()) <= WEIGHT_SYNC_STATS


def test_an_unavailable_path_is_passed_over_without_counting():
    chain = WeightSync(
        [Fails("shm", unavailable=True), Loads("zmq", 4)], deadline_s=5.0, replica="gen-0"
    )
    assert chain.sync(Engine(3)).path == "zmq"
    assert chain.stats() == {"weights_loads_zmq": 1.0}


def test_a_silent_publisher_misses_the_deadline_and_the_next_path_loads():
    context = zmq.Context()
    silent = context.socket(zmq.ROUTER)  # takes requests, never answers
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    client = WeightClient(context, f"tcp://127.0.0.1:{port}", timeout_s=60.0)
    chain = WeightSync([ZmqSource(client), Loads("shm", 4)], deadline_s=0.3, replica="gen-0")
    try:
        started = time.monotonic()
        loaded = chain.sync(Engine(3))
        waited = time.monotonic() - started
    finally:
        client.close()
        silent.close(linger=0)
        context.term()
    assert loaded.path == "shm" and waited < 5.0  # the deadline, not the 60 s reply timeout
    assert chain.counters["weights_deadline_missed"] == 1
    assert chain.counters["weights_failures_zmq"] == 1
    assert chain.counters["weights_fallbacks"] == 1
    assert client.deadline is None  # the deadline is one fetch's, not the client's


def test_after_a_partial_load_the_next_path_reloads_whatever_the_engine_claims():
    zmq_path = Loads("zmq", 4)
    chain = WeightSync([Fails("shm", partial=True), zmq_path], deadline_s=5.0, replica="gen-0")
    engine = Engine(4)  # the torn load already set v4
    assert chain.sync(engine).version == 4
    assert zmq_path.asked == [-1]  # not "have 4": that would leave the mix in place


def test_a_partial_load_and_every_path_failing_raises():
    chain = WeightSync([Fails("shm", partial=True), Fails("zmq")], deadline_s=5.0, replica="gen-0")
    with pytest.raises(WeightTransferError, match=r"every weight path failed.*partial") as caught:
        chain.sync(Engine(3))
    assert caught.value.partial
    assert chain.counters["weights_transfer_failures"] == 2


def test_a_partial_load_the_last_path_cannot_repair_raises():
    chain = WeightSync(
        [Fails("shm", partial=True), Loads("zmq", None)], deadline_s=5.0, replica="gen-0"
    )
    with pytest.raises(WeightTransferError) as caught:
        chain.sync(Engine(3))
    assert caught.value.partial


def test_a_path_whose_claim_the_engine_does_not_back_is_a_failure():
    chain = WeightSync(
        [Loads("shm", 5, lie=True), Loads("zmq", 4)], deadline_s=5.0, replica="gen-0"
    )
    engine = Engine(3)
    loaded = chain.sync(engine)
    assert (loaded.version, engine.version) == (4, 4)  # tokens will say v4: what is loaded
    assert chain.counters["weights_failures_shm"] == 1


def test_nothing_newer_on_the_first_path_ends_the_sync():
    zmq_path = Loads("zmq", 9)
    chain = WeightSync([Loads("shm", 3), zmq_path], deadline_s=5.0, replica="gen-0")
    assert chain.sync(Engine(3)) is None
    assert zmq_path.asked == [] and chain.stats() == {}


def test_a_path_that_loads_past_its_deadline_is_kept_and_counted():
    class Slow(Loads):
        def sync_into(self, backend, have_version, deadline):
            time.sleep(max(0.0, deadline - time.monotonic()) + 0.05)
            return super().sync_into(backend, have_version, deadline)

    chain = WeightSync([Slow("shm", 4), Loads("zmq", 4)], deadline_s=0.1, replica="gen-0")
    assert chain.sync(Engine(3)).path == "shm"  # whole and checked: no reason to drop it
    assert chain.counters["weights_deadline_missed"] == 1


class CountingShm(Loads):
    """The shm path, with the counters ShmSource keeps, one the buffer does not accept."""

    def __init__(self):
        super().__init__("shm", 4)
        self.counters = {"overlaps": 2, "followed": 1, "unheard_of": 5}


def test_the_shm_paths_overlaps_and_follows_reach_the_stats_the_buffer_accepts():
    chain = WeightSync([CountingShm(), Loads("zmq", 4)], deadline_s=5.0, replica="gen-0")
    chain.sync(Engine(3))
    assert chain.stats() == {
        "weights_loads_shm": 1.0,
        "weights_shm_overlaps": 2.0,
        "weights_shm_followed": 1.0,
    }
    assert set(chain.stats()) <= WEIGHT_SYNC_STATS


class Refuses:
    """A path whose version fails the replica's checks (a slot holding NaN)."""

    def __init__(self, name: str, partial: bool = False):
        self.name, self.partial = name, partial
        self.counters = {"refused_nonfinite": 1}  # counted by the path, as the real ones do

    def sync_into(self, backend, have_version, deadline):
        raise WeightsRefused(
            f"{self.name} v4: refused: tensor 'w' holds NaN",
            reason="nonfinite",
            partial=self.partial,
        )

    def close(self):
        pass


def test_a_version_every_path_refuses_leaves_the_replica_serving_what_it_holds():
    chain = WeightSync([Refuses("shm"), Refuses("zmq")], deadline_s=5.0, replica="gen-0")
    engine = Engine(3)
    assert chain.sync(engine) is None  # no exit, so no restart and no crash loop
    assert engine.version == 3
    stats = chain.stats()
    assert stats["weights_refused"] == 2.0 and stats["weights_zmq_refused_nonfinite"] == 1.0
    assert stats["weights_fallbacks"] == 1.0 and "weights_transfer_failures" not in stats
    assert set(stats) <= WEIGHT_SYNC_STATS


def test_a_version_one_path_refuses_is_loaded_from_the_next():
    chain = WeightSync([Refuses("shm"), Loads("zmq", 4)], deadline_s=5.0, replica="gen-0")
    loaded = chain.sync(Engine(3))
    assert (loaded.version, loaded.path) == (4, "zmq")
    assert chain.stats()["weights_shm_refused_nonfinite"] == 1.0


def test_a_refusal_that_left_a_mix_no_path_repairs_still_raises():
    chain = WeightSync(
        [Refuses("collective", partial=True), Refuses("zmq")], deadline_s=5.0, replica="gen-0"
    )
    with pytest.raises(WeightTransferError, match="every weight path failed") as caught:
        chain.sync(Engine(3))
    assert caught.value.partial  # never generate with a mix: the replica exits
