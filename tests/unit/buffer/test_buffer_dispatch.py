"""BufferStore: heartbeats and requeue, duplicates, reuse, filters, back-pressure, stats.

Time is passed in as ``now`` everywhere, so these tests drive the clock.
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncrl.buffer.durable import unfinished_groups
from asyncrl.buffer.store import BufferStore, Sample
from asyncrl.core.messages import Heartbeat, WorkItem, decode, encode
from tests.helpers.buffer_samples import TIMEOUT, group_samples, make_sample, make_store


def ids(items: list[WorkItem]) -> list[int]:
    return [item.group_id for item in items]


def keys(batch: list[Sample]) -> list[tuple[int, int]]:
    return [(s.meta.group_id, s.meta.sample_index) for s in batch]


def assert_accounting(store: BufferStore) -> None:
    """Invariants 5 and 6 of the store, spelled out from the counters."""
    c = store.counters
    held_unserved = sum(len(g.samples) for g in store.ready if not g.times_served)
    partial = sum(len(g.samples) for g in store.in_flight.values())
    assert c["accepted"] == (
        c["served"]
        - c["served_again"]
        + c["dropped_stale"]
        + c["filtered"]
        + c["discarded_requeue"]
        + held_unserved
        + partial
    )
    assert store.accounted() == c["accepted"]
    assert c["dispatched_groups"] == (
        c["completed_groups"] + c["requeued_groups"] + len(store.in_flight)
    )
    requeued = c["requeued_groups"] + c["stale_requeued_groups"]
    assert len(store.requeue) == requeued - c["redispatched_groups"]


def assert_every_prompt_named(store: BufferStore, trained: set[int]) -> None:
    """Invariant 8: below the cursor each prompt is trained, unfinished or skipped by id."""
    named = [*trained, *unfinished_groups(store), *(skip.group_id for skip in store.skipped)]
    assert sorted(named) == list(range(store.cursor))


# ------------------------------------------------------- heartbeats and requeue


def test_a_silent_generator_s_groups_are_requeued_and_handed_out_before_new_prompts():
    store = make_store(group_size=2, samples_per_step=4, max_staleness=3)
    assert ids(store.dispatch("gen-a", 4, now=0.0)) == [0, 1]
    assert ids(store.dispatch("gen-b", 2, now=0.0)) == [2]
    store.heartbeat("gen-b", 9.0)

    assert store.expire_silent(now=TIMEOUT) == []  # exactly at the timeout: not yet
    assert store.expire_silent(now=TIMEOUT + 0.1) == ["gen-a"]

    assert store.counters["requeued_groups"] == 2
    assert set(store.in_flight) == {2}
    assert "gen-a" not in store.last_seen
    # the requeued groups come first, in order, then new prompts
    assert ids(store.dispatch("gen-b", 6, now=TIMEOUT + 0.2)) == [0, 1, 3]
    assert store.in_flight[0].generator_id == "gen-b"
    assert_accounting(store)


def test_partial_samples_of_a_requeued_group_are_discarded_and_counted():
    store = make_store(group_size=3, samples_per_step=3)
    store.dispatch("gen-a", 3, now=0.0)
    assert store.ingest([make_sample(0, 0, generator_id="gen-a")], now=1.0) == 1

    store.expire_silent(now=1.0 + TIMEOUT + 0.1)

    assert store.counters["discarded_requeue"] == 1
    assert store.held_bytes() == 0
    assert [item.group_id for item in store.requeue] == [0]
    assert_accounting(store)


def test_any_message_from_a_generator_counts_as_a_heartbeat():
    store = make_store(group_size=2, samples_per_step=4, max_staleness=3)
    store.dispatch("gen-a", 4, now=0.0)  # asking for work counts
    store.heartbeat("gen-a", 8.0)  # so does a heartbeat
    store.ingest([make_sample(0, 0, generator_id="gen-a")], now=16.0)  # and a trajectory

    assert store.expire_silent(now=16.0 + TIMEOUT) == []
    assert set(store.in_flight) == {0, 1}
    assert store.expire_silent(now=16.0 + TIMEOUT + 0.1) == ["gen-a"]


def test_requeued_groups_keep_their_admission_budget():
    store = make_store(group_size=2, samples_per_step=2, max_staleness=0)
    # limit (0 + 0 + 1) * 2 = 2 samples: one group
    assert ids(store.dispatch("gen-a", 10, now=0.0)) == [0]
    store.expire_silent(now=TIMEOUT + 1)
    assert store.started_samples == 2
    # the requeued group is handed out again although the limit is reached
    assert ids(store.dispatch("gen-b", 10, now=TIMEOUT + 1)) == [0]
    assert store.started_samples == 2
    assert store.started_samples <= store.admission_limit()
    assert store.dispatch("gen-b", 10, now=TIMEOUT + 1) == []


def test_a_requeued_group_that_does_not_fit_blocks_new_prompts_too():
    store = make_store(group_size=2, samples_per_step=4, max_staleness=3)
    store.dispatch("gen-a", 2, now=0.0)
    store.expire_silent(now=TIMEOUT + 1)
    assert store.dispatch("gen-b", 1, now=TIMEOUT + 1) == []
    assert store.cursor == 1


def test_a_generator_that_speaks_again_after_expiring_is_tracked_again():
    store = make_store()
    store.dispatch("gen-a", 2, now=0.0)
    store.expire_silent(now=TIMEOUT + 1)
    store.heartbeat("gen-a", TIMEOUT + 2)
    assert store.last_seen["gen-a"] == TIMEOUT + 2
    assert store.stats()["buffer_generators_alive"] == 1.0


# --------------------------------------------------------- duplicates and reuse


def test_late_samples_of_a_requeued_group_are_duplicates_whoever_holds_it_now():
    store = make_store(group_size=2, samples_per_step=2, max_staleness=3)
    store.dispatch("gen-a", 4, now=0.0)  # groups 0, 1
    store.expire_silent(now=TIMEOUT + 1)
    store.dispatch("gen-b", 2, now=TIMEOUT + 1)  # group 0 to gen-b; group 1 still waiting

    late = group_samples(store, 0, "gen-a") + group_samples(store, 1, "gen-a")
    assert store.ingest(late, now=TIMEOUT + 2) == 0
    assert store.counters["dropped_duplicate"] == 4
    assert store.counters["dropped_unknown_group"] == 0
    # gen-b's samples of the same group are accepted and served
    assert store.ingest(group_samples(store, 0, "gen-b"), now=TIMEOUT + 3) == 2
    batch = store.take_batch()
    assert keys(batch) == [(0, 0), (0, 1)]
    assert {s.meta.generator_id for s in batch} == {"gen-b"}
    assert_accounting(store)


def test_a_sample_for_a_completed_group_is_a_duplicate_and_never_dispatched_is_unknown():
    store = make_store(group_size=2, samples_per_step=2)
    store.dispatch("gen-0", 2)
    store.ingest(group_samples(store, 0))
    assert store.ingest([make_sample(0, 1)]) == 0
    assert store.ingest([make_sample(5, 0)]) == 0
    assert store.counters["dropped_duplicate"] == 1
    assert store.counters["dropped_unknown_group"] == 1


def test_by_default_a_served_sample_is_never_served_again():
    store = make_store(group_size=2, samples_per_step=2, max_staleness=3)
    store.dispatch("gen-0", 2)
    store.ingest(group_samples(store, 0))
    assert keys(store.take_batch()) == [(0, 0), (0, 1)]
    assert store.take_batch() is None
    assert store.held_samples() == 0
    assert store.counters["served_again"] == 0


def test_with_max_reuse_a_fresh_group_is_served_that_many_times_never_twice_in_a_batch():
    store = make_store(group_size=2, samples_per_step=4, max_staleness=3, max_reuse=2)
    store.dispatch("gen-0", 4)
    store.ingest(group_samples(store, 0) + group_samples(store, 1))
    served = Counter()
    while (batch := store.take_batch()) is not None:
        assert len(set(keys(batch))) == len(batch)
        served.update(keys(batch))
    assert served == dict.fromkeys([(0, 0), (0, 1), (1, 0), (1, 1)], 2)
    assert store.counters["served"] == 8
    assert store.counters["served_again"] == 4
    assert_accounting(store)


def test_a_group_kept_for_reuse_retires_when_stale_without_counting_as_dropped():
    store = make_store(group_size=2, samples_per_step=2, max_staleness=0, max_reuse=3)
    store.dispatch("gen-0", 2)
    store.ingest(group_samples(store, 0))
    assert store.take_batch() is not None
    store.set_policy_version(1)
    assert store.take_batch() is None
    assert store.counters["dropped_stale"] == 0
    assert store.counters["retired_stale_after_serving"] == 2
    assert store.held_samples() == 0
    assert_accounting(store)


# ---------------------------------------------------------------------- filters


def test_a_group_with_equal_rewards_is_filtered_counted_and_frees_admission_budget():
    store = make_store(group_size=2, samples_per_step=2, max_staleness=0, filter_equal_rewards=True)
    store.dispatch("gen-0", 2)
    assert store.dispatch("gen-0", 2) == []  # at the limit
    store.ingest(group_samples(store, 0, reward=1.0))
    assert store.counters["filtered_equal_rewards"] == 2
    assert store.counters["filtered"] == 2
    assert store.held_samples() == 0
    assert store.started_samples == 0
    assert ids(store.dispatch("gen-0", 2)) == [1]
    # different rewards pass
    store.ingest(group_samples(store, 1))
    assert store.held_samples() == 2
    assert_accounting(store)


def test_a_group_with_any_truncated_sample_is_filtered_whole():
    store = make_store(group_size=3, samples_per_step=3, filter_truncated=True)
    store.dispatch("gen-0", 6)
    samples = group_samples(store, 0)
    samples[1] = make_sample(0, 1, finish_reason="length")
    store.ingest(samples + group_samples(store, 1))
    assert store.counters["filtered_truncated"] == 3
    assert store.held_samples() == 3
    assert [g.item.group_id for g in store.ready] == [1]
    stats = store.stats()
    assert stats["buffer_filtered"] == 3.0
    assert stats["buffer_filtered_truncated"] == 3.0
    assert_accounting(store)


def test_filters_are_off_by_default():
    store = make_store(group_size=2, samples_per_step=2)
    store.dispatch("gen-0", 2)
    store.ingest(group_samples(store, 0, reward=0.0, finish_reason="length"))
    assert store.held_samples() == 2
    assert store.counters["filtered"] == 0


# ----------------------------------------------------------------- back-pressure


def test_back_pressure_refuses_work_drops_nothing_and_never_blocks_a_batch():
    store = make_store(group_size=2, samples_per_step=2, max_staleness=3, admission_control=False)
    assert store.max_held_samples == 8  # 0 derives 4 * samples_per_step
    store.dispatch("gen-0", 10)  # groups 0..4
    for group_id in range(4):
        store.ingest(group_samples(store, group_id))
    assert store.held_samples() == 8

    assert store.dispatch("gen-0", 10) == []
    assert store.counters["dispatch_refused_backpressure"] == 1
    assert store.counters["dropped_stale"] == 0
    assert store.held_samples() == 8
    # the in-flight group still completes, and the learner is served
    assert store.ingest(group_samples(store, 4)) == 2
    assert store.take_batch() is not None
    assert store.take_batch() is not None
    assert store.held_samples() == 6
    assert len(store.dispatch("gen-0", 10)) == 5
    assert_accounting(store)


def test_back_pressure_on_held_bytes():
    store = make_store(group_size=2, samples_per_step=2, max_staleness=3, max_held_bytes=1)
    store.dispatch("gen-0", 4)
    store.ingest(group_samples(store, 0)[:1])
    # bytes over the bound, but no batch can be formed yet: refusing would stall everything
    assert store.held_bytes() > 1
    assert store.dispatch("gen-0", 2)
    store.ingest(group_samples(store, 0)[1:])
    assert store.dispatch("gen-0", 2) == []
    assert store.counters["dispatch_refused_backpressure"] == 1


def test_back_pressure_bound_below_a_batch_does_not_starve_the_learner():
    store = make_store(group_size=2, samples_per_step=4, max_staleness=3, max_held_samples=2)
    store.dispatch("gen-0", 2)
    store.ingest(group_samples(store, 0))
    # 2 samples held reach the bound, but a batch needs 4: keep handing out work
    assert ids(store.dispatch("gen-0", 2)) == [1]


# ------------------------------------------------------------------------- stats

REQUIRED_STATS = [
    "buffer_held",
    "buffer_held_bytes",
    "buffer_dropped_stale",
    "buffer_dropped_duplicate",
    "buffer_filtered",
    "buffer_evicted_frac",
    "buffer_requeued_groups",
    "buffer_ingest_rate",
    "buffer_response_len_served_mean",
    "buffer_response_len_evicted_mean",
    # kept from before
    "buffer_in_flight_groups",
    "buffer_dropped_unknown",
    "buffer_cursor",
    "buffer_admission_refusals",
]


def test_stats_has_every_required_key_as_a_float():
    store = make_store(max_staleness=2)
    stats = store.stats()
    for key in [*REQUIRED_STATS, "buffer_staleness_0", "buffer_staleness_1", "buffer_staleness_2"]:
        assert isinstance(stats[key], float), key
    assert "buffer_staleness_3" not in stats


def test_stats_report_staleness_histogram_and_response_lengths_of_served_and_evicted():
    store = make_store(group_size=2, samples_per_step=4, max_staleness=1, admission_control=False)
    store.dispatch("gen-0", 6)
    store.set_policy_version(2)
    # group 0: long and from v0, evicted; groups 1 and 2: short, v1 and v2, served
    store.ingest([make_sample(0, i, [0, 0, 0, 0, 2]) for i in range(2)])
    store.ingest([make_sample(1, i, [1]) for i in range(2)])
    store.ingest([make_sample(2, i, [2, 2]) for i in range(2)])
    assert store.take_batch() is not None

    stats = store.stats()
    assert stats["buffer_staleness_0"] == 2.0
    assert stats["buffer_staleness_1"] == 2.0
    assert stats["buffer_response_len_evicted_mean"] == 5.0
    assert stats["buffer_response_len_served_mean"] == 1.5
    assert stats["buffer_evicted_frac"] == pytest.approx(2 / 6)
    assert stats["buffer_dropped_stale"] == 2.0


def test_ingest_rate_is_samples_per_second_since_the_previous_stats_call():
    store = make_store(group_size=2, samples_per_step=4, max_staleness=3)
    store.dispatch("gen-0", 8, now=100.0)
    store.ingest(group_samples(store, 0), now=101.0)
    assert store.stats(now=102.0)["buffer_ingest_rate"] == pytest.approx(1.0)  # 2 in 2 s
    store.ingest(group_samples(store, 1) + group_samples(store, 2), now=102.5)
    assert store.stats(now=103.0)["buffer_ingest_rate"] == pytest.approx(4.0)  # 4 in 1 s
    assert store.stats()["buffer_ingest_rate"] == pytest.approx(4.0)  # no clock: unchanged


def test_held_bytes_counts_partial_and_ready_samples():
    store = make_store(group_size=2, samples_per_step=4)
    store.dispatch("gen-0", 4)
    samples = group_samples(store, 0) + group_samples(store, 1)[:1]
    store.ingest(samples)
    assert store.held_bytes() == sum(s.nbytes for s in samples)
    assert store.stats()["buffer_held_bytes"] == float(store.held_bytes())


# -------------------------------------------------------------- property test

OPS = ["dispatch", "ingest", "heartbeat", "tick", "advance", "take", "ingest", "take"]
"""What the property test interleaves; ingest and take twice as often as the rest."""


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    group_size=st.integers(1, 3),
    prompts_per_step=st.integers(1, 2),
    max_staleness=st.integers(0, 2),
    max_reuse=st.integers(1, 3),
    num_generators=st.integers(2, 3),
    filter_equal_rewards=st.sampled_from([False, False, True]),
    filter_truncated=st.sampled_from([False, False, True]),
    held_batches=st.integers(0, 3),
    stale_retries=st.integers(0, 2),
    data=st.data(),
)
def test_random_interleavings_with_generator_deaths_keep_the_buffer_invariants(
    group_size,
    prompts_per_step,
    max_staleness,
    max_reuse,
    num_generators,
    filter_equal_rewards,
    filter_truncated,
    held_batches,
    stale_retries,
    data,
):
    samples_per_step = group_size * prompts_per_step
    store = make_store(
        group_size,
        samples_per_step,
        max_staleness,
        max_reuse=max_reuse,
        filter_equal_rewards=filter_equal_rewards,
        filter_truncated=filter_truncated,
        max_held_samples=held_batches * samples_per_step,
        stale_retries=stale_retries,
    )
    generators = [f"gen-{i}" for i in range(num_generators)]
    now = 0.0
    dispatched_at: dict[int, int] = {}  # group id -> policy version when last dispatched
    lost: set[tuple[int, str]] = set()  # (group id, generator that lost it to a requeue)
    served: Counter[tuple[int, int]] = Counter()

    for _ in range(data.draw(st.integers(1, 60), label="steps")):
        op = data.draw(st.sampled_from(OPS), label="op")

        if op == "dispatch":
            generator = data.draw(st.sampled_from(generators), label="generator")
            max_samples = data.draw(st.integers(0, 3 * group_size), label="max_samples")
            requeued = list(store.requeue)
            refused = store.backpressured()
            items = store.dispatch(generator, max_samples, now)
            assert sum(item.num_samples for item in items) <= max_samples
            assert store.started_samples <= store.admission_limit()
            if refused:
                assert items == []
            # requeued groups first, in order
            assert ids(items[: len(requeued)]) == ids(requeued[: len(items)])
            for item in items:
                assert store.in_flight[item.group_id].generator_id == generator
                dispatched_at[item.group_id] = store.policy_version

        elif op == "ingest":
            pending = sorted(
                (group_id, index)
                for group_id, group in store.in_flight.items()
                for index in range(group_size)
                if index not in group.samples
            )
            fresh = data.draw(
                st.lists(st.sampled_from(pending), unique=True) if pending else st.just([]),
                label="fresh",
            )
            late = sorted(
                (group_id, generator)
                for group_id, generator in lost
                if not (
                    group_id in store.in_flight
                    and store.in_flight[group_id].generator_id == generator
                )
            )
            late = data.draw(
                st.lists(st.sampled_from(late), max_size=3) if late else st.just([]),
                label="late",
            )
            batch = []
            for group_id, index in fresh:
                low = dispatched_at[group_id]
                versions = data.draw(
                    st.lists(st.integers(low, store.policy_version), min_size=1, max_size=3),
                    label="versions",
                )
                batch.append(
                    make_sample(
                        group_id,
                        index,
                        versions,
                        store.in_flight[group_id].generator_id,
                        reward=data.draw(st.sampled_from([0.0, 1.0]), label="reward"),
                        finish_reason=data.draw(
                            st.sampled_from(["stop", "stop", "length"]), label="finish"
                        ),
                    )
                )
            for group_id, generator in late:
                index = data.draw(st.integers(0, group_size - 1), label="late_index")
                batch.append(make_sample(group_id, index, [0], generator))
            order = data.draw(st.permutations(range(len(batch))), label="order")
            batch = [batch[i] for i in order]

            before = store.counters.copy()
            assert store.ingest(batch, now) == len(fresh)
            assert store.counters["dropped_duplicate"] - before["dropped_duplicate"] == len(late)

        elif op == "heartbeat":
            store.heartbeat(data.draw(st.sampled_from(generators), label="generator"), now)

        elif op == "tick":
            now += data.draw(
                st.one_of(st.floats(0.0, 1.0), st.floats(0.0, 1.5 * TIMEOUT)), label="dt"
            )
            owners = {gid: g.generator_id for gid, g in store.in_flight.items()}
            seen = dict(store.last_seen)
            expired = store.expire_silent(now)
            for generator, last in seen.items():
                assert (generator in expired) == (now - last > TIMEOUT)
            for group_id, owner in owners.items():
                if owner in expired:
                    assert group_id not in store.in_flight
                    assert group_id in ids(store.requeue)
                    lost.add((group_id, owner))
                else:
                    assert store.in_flight[group_id].generator_id == owner

        elif op == "advance":
            store.set_policy_version(store.policy_version + 1)

        else:
            batch = store.take_batch()
            if batch is not None:
                assert len(batch) == samples_per_step
                batch_keys = keys(batch)
                assert len(set(batch_keys)) == len(batch_keys)
                groups = {g for g, _ in batch_keys}
                assert set(batch_keys) == {(g, i) for g in groups for i in range(group_size)}
                for sample in batch:
                    assert store.policy_version - sample.version <= max_staleness
                served.update(batch_keys)

        # invariants after every operation
        assert all(count <= max_reuse for count in served.values())
        assert sum(served.values()) == store.counters["served"]
        assert_accounting(store)
        assert store.started_samples <= store.admission_limit()
        # what leaves for good frees its budget: filtered groups and prompts skipped as stale
        skipped_stale = sum(skip.reason == "stale" for skip in store.skipped)
        assert store.started_samples == (
            group_size * (store.cursor - skipped_stale) - store.counters["filtered"]
        )
        assert_every_prompt_named(store, {group for group, _ in served})
        assert all(times <= stale_retries for times in store.prompts.stale_evictions.values())
        assert not set(store.in_flight) & set(ids(store.requeue))
        for group in store.in_flight.values():
            assert all(s.meta.generator_id == group.generator_id for s in group.samples.values())
        for group in store.ready:
            assert group.complete
            assert group.times_served < max_reuse
        assert store.held_bytes() == sum(
            s.nbytes for g in [*store.ready, *store.in_flight.values()] for s in g.samples.values()
        )


def test_a_heartbeat_round_trips_on_the_wire():
    body, arrays = decode(encode(Heartbeat("gen-3")))
    assert body == Heartbeat(generator_id="gen-3")
    assert arrays == {}
