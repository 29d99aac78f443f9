"""BufferStore: admission control, ingest, staleness eviction and batches."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncrl.buffer.store import BufferStore, Sample
from tests.helpers.buffer_samples import make_sample, make_store


def complete_group(store: BufferStore, group_id: int, versions: list[int]) -> int:
    size = store.make_item(group_id).num_samples
    return store.ingest([make_sample(group_id, i, versions) for i in range(size)])


def keys(batch: list[Sample]) -> list[tuple[int, int]]:
    return [(s.meta.group_id, s.meta.sample_index) for s in batch]


# --------------------------------------------------------------------- dispatch


def test_admission_control_caps_started_samples_and_opens_up_with_the_policy_version():
    store = make_store(group_size=2, samples_per_step=4, max_staleness=1)
    # V = 0, k = 1: limit (0 + 1 + 1) * 4 = 8 samples = 4 groups of 2
    items = store.dispatch("gen-0", max_samples=100)
    assert [item.group_id for item in items] == [0, 1, 2, 3]
    assert store.started_samples == 8
    assert store.dispatch("gen-1", max_samples=100) == []
    assert store.counters["dispatch_refused_admission"] == 2
    store.set_policy_version(1)
    # V = 1: limit (1 + 1 + 1) * 4 = 12, so 4 more samples = 2 more groups
    items = store.dispatch("gen-1", max_samples=100)
    assert [item.group_id for item in items] == [4, 5]
    assert store.started_samples == 12


def test_dispatch_without_admission_control_is_bounded_only_by_max_samples():
    store = make_store(group_size=2, samples_per_step=4, max_staleness=0, admission_control=False)
    # limit would be 4, but it is off: 20 // 2 = 10 groups
    assert len(store.dispatch("gen-0", max_samples=20)) == 10
    assert store.counters["dispatch_refused_admission"] == 0


def test_dispatch_never_splits_a_group():
    store = make_store(group_size=3, samples_per_step=6, max_staleness=5)
    # 5 samples fit one group of 3, not two
    items = store.dispatch("gen-0", max_samples=5)
    assert len(items) == 1
    assert items[0].num_samples == 3
    # 2 samples fit no group of 3
    assert store.dispatch("gen-0", max_samples=2) == []
    # the cursor only moved past what was handed out
    assert store.cursor == 1
    assert [item.group_id for item in store.dispatch("gen-0", max_samples=6)] == [1, 2]


def test_a_version_that_goes_backwards_is_ignored():
    store = make_store()
    store.set_policy_version(3)
    store.set_policy_version(1)
    assert store.policy_version == 3


# ----------------------------------------------------------------------- ingest


def test_a_duplicate_sample_is_dropped_and_counted():
    store = make_store(group_size=2)
    store.dispatch("gen-0", max_samples=2)
    first = make_sample(0, 0, [0], logprob=-1.0)
    again = make_sample(0, 0, [0], logprob=-9.0)
    assert store.ingest([first]) == 1
    assert store.ingest([again]) == 0
    assert store.counters["dropped_duplicate"] == 1
    assert store.counters["accepted"] == 1
    assert store.in_flight[0].samples[0] is first


def test_a_sample_for_an_unknown_group_is_dropped_and_counted():
    store = make_store(group_size=2)
    store.dispatch("gen-0", max_samples=2)
    assert store.ingest([make_sample(99, 0, [0])]) == 0
    assert store.counters["dropped_unknown_group"] == 1
    assert store.counters["accepted"] == 0


def test_a_sample_index_outside_the_group_is_dropped_and_counted():
    store = make_store(group_size=2)
    store.dispatch("gen-0", max_samples=2)
    assert store.ingest([make_sample(0, 2, [0]), make_sample(0, -1, [0])]) == 0
    assert store.counters["dropped_bad_index"] == 2


def test_an_incomplete_group_is_never_served():
    store = make_store(group_size=2, samples_per_step=2, max_staleness=3)
    store.dispatch("gen-0", max_samples=8)
    # one sample of each of the 4 groups: 4 samples held, no group complete
    assert store.ingest([make_sample(g, 0, [0]) for g in range(4)]) == 4
    assert store.take_batch() is None
    assert store.held_samples() == 0
    # completing group 2 makes exactly that group servable
    store.ingest([make_sample(2, 1, [0])])
    assert keys(store.take_batch()) == [(2, 0), (2, 1)]


# ---------------------------------------------------------------------- batches


def test_take_batch_waits_for_samples_per_step_samples_in_complete_groups():
    store = make_store(group_size=2, samples_per_step=4, max_staleness=1)
    store.dispatch("gen-0", max_samples=8)
    assert store.take_batch() is None
    complete_group(store, 1, [0])
    assert store.take_batch() is None
    store.ingest([make_sample(0, 1, [0])])
    assert store.take_batch() is None
    store.ingest([make_sample(0, 0, [0])])
    batch = store.take_batch()
    assert batch is not None
    assert len(batch) == 4
    assert sorted(keys(batch)) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert store.counters["served"] == 4
    assert store.take_batch() is None


def test_batches_are_served_oldest_version_first():
    store = make_store(group_size=2, samples_per_step=2, max_staleness=3)
    store.dispatch("gen-0", max_samples=6)
    store.set_policy_version(2)
    # completed in the order: group 0 at v2, group 1 at v0, group 2 at v1
    complete_group(store, 0, [2, 2])
    complete_group(store, 1, [0, 1])
    complete_group(store, 2, [1, 2])
    served = [keys(store.take_batch()) for _ in range(3)]
    assert served == [[(1, 0), (1, 1)], [(2, 0), (2, 1)], [(0, 0), (0, 1)]]
    assert store.take_batch() is None


def test_a_stale_group_is_evicted_whole_counted_and_frees_admission_budget():
    store = make_store(group_size=2, samples_per_step=4, max_staleness=1)
    store.dispatch("gen-0", max_samples=8)  # groups 0..3, started 8 = limit at V=0
    complete_group(store, 0, [0])
    store.set_policy_version(2)
    # V = 2: limit (2 + 1 + 1) * 4 = 16, so 8 more samples = groups 4..7
    assert len(store.dispatch("gen-0", max_samples=100)) == 4
    assert store.started_samples == 16
    assert store.dispatch("gen-0", max_samples=100) == []
    # group 0 has version 0: staleness 2 - 0 = 2 > k = 1, so it is evicted whole
    assert store.take_batch() is None
    assert store.counters["dropped_stale"] == 2
    assert store.held_samples() == 0
    assert store.started_samples == 14
    # without stale retries (the store's default) its prompt is given up on, by id
    assert [(skip.group_id, skip.reason) for skip in store.skipped] == [(0, "stale")]
    # the 2 freed samples admit exactly one more group
    assert [item.group_id for item in store.dispatch("gen-0", max_samples=100)] == [8]


def test_a_group_at_exactly_max_staleness_is_still_served():
    store = make_store(group_size=2, samples_per_step=2, max_staleness=1)
    store.dispatch("gen-0", max_samples=2)
    complete_group(store, 0, [0])
    store.set_policy_version(1)
    # staleness 1 - 0 = 1 <= k = 1
    batch = store.take_batch()
    assert keys(batch) == [(0, 0), (0, 1)]
    assert store.batches.served_staleness == [1, 1]


def test_a_sample_is_as_old_as_its_oldest_token():
    store = make_store(group_size=2, samples_per_step=2, max_staleness=1)
    store.dispatch("gen-0", max_samples=4)
    store.set_policy_version(2)
    # group 0: one sample has a single token from v0 (2 - 0 = 2 > 1), the rest from v2
    store.ingest([make_sample(0, 0, [2, 2]), make_sample(0, 1, [0, 2, 2])])
    # group 1: a partial rollout v1 -> v2, oldest token 2 - 1 = 1 <= 1
    store.ingest([make_sample(1, 0, [1, 2]), make_sample(1, 1, [2])])
    batch = store.take_batch()
    assert keys(batch) == [(1, 0), (1, 1)]
    assert store.counters["dropped_stale"] == 2
    assert all(store.policy_version - s.version <= store.config.max_staleness for s in batch)


def test_no_served_sample_is_staler_than_max_staleness():
    k = 2
    store = make_store(group_size=2, samples_per_step=2, max_staleness=k, admission_control=False)
    store.dispatch("gen-0", max_samples=10)  # groups 0..4
    store.set_policy_version(5)
    # complete groups at versions 0..4 (staleness 5, 4, 3, 2, 1); only 3 and 4 are fresh enough
    for version in range(5):
        complete_group(store, version, [version])
    served = []
    while (batch := store.take_batch()) is not None:
        served += batch
    assert sorted({s.version for s in served}) == [3, 4]
    assert all(5 - s.version <= k for s in served)
    assert store.counters["dropped_stale"] == 6  # versions 0, 1, 2: 3 groups of 2


# -------------------------------------------------------------- property test

GENERATORS = ["gen-0", "gen-1"]


@settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    group_size=st.integers(1, 3),
    prompts_per_step=st.integers(1, 2),
    max_staleness=st.integers(0, 2),
    data=st.data(),
)
def test_random_operation_sequences_keep_the_buffer_invariants(
    group_size, prompts_per_step, max_staleness, data
):
    samples_per_step = group_size * prompts_per_step
    store = make_store(group_size, samples_per_step, max_staleness)

    known_version = dict.fromkeys(GENERATORS, 0)  # the version each generator was last told
    owner: dict[int, str] = {}  # group id -> generator it was dispatched to
    pending: set[tuple[int, int]] = set()  # dispatched, not yet ingested
    ingested: dict[tuple[int, int], Sample] = {}  # first accepted copy of each sample
    open_groups: set[int] = set()  # dispatched groups not yet complete
    served: set[tuple[int, int]] = set()
    next_unknown = 10_000

    for _ in range(data.draw(st.integers(1, 40), label="steps")):
        op = data.draw(st.sampled_from(["dispatch", "ingest", "advance", "take"]), label="op")

        if op == "dispatch":
            generator = data.draw(st.sampled_from(GENERATORS), label="generator")
            max_samples = data.draw(st.integers(0, 3 * group_size), label="max_samples")
            items = store.dispatch(generator, max_samples)
            assert sum(item.num_samples for item in items) <= max_samples
            assert store.started_samples <= store.admission_limit()
            known_version[generator] = store.policy_version
            for item in items:
                assert item.num_samples == group_size
                assert item.group_id not in owner
                owner[item.group_id] = generator
                open_groups.add(item.group_id)
                pending.update((item.group_id, i) for i in range(group_size))

        elif op == "ingest":
            fresh = data.draw(
                st.lists(st.sampled_from(sorted(pending)), unique=True) if pending else st.just([]),
                label="new",
            )
            repeats = data.draw(
                st.lists(st.sampled_from(sorted(ingested)), max_size=2)
                if ingested
                else st.just([]),
                label="repeats",
            )
            unknown = data.draw(st.integers(0, 1), label="unknown")
            batch = []
            for group_id, index in fresh:
                low = known_version[owner[group_id]]
                versions = sorted(
                    data.draw(
                        st.lists(st.integers(low, store.policy_version), min_size=1, max_size=3),
                        label="versions",
                    )
                )
                batch.append(make_sample(group_id, index, versions, owner[group_id]))
            for group_id, index in repeats:
                batch.append(make_sample(group_id, index, [store.policy_version], logprob=-7.0))
            for _ in range(unknown):
                batch.append(make_sample(next_unknown, 0, [store.policy_version]))
                next_unknown += 1
            order = data.draw(st.permutations(range(len(batch))), label="order")
            batch = [batch[i] for i in order]

            before = store.counters.copy()
            accepted = store.ingest(batch)
            assert accepted == len(fresh)
            dropped = sum(
                store.counters[reason] - before[reason]
                for reason in ("dropped_duplicate", "dropped_unknown_group", "dropped_bad_index")
            )
            assert dropped == len(repeats) + unknown
            for sample in batch:
                key = (sample.meta.group_id, sample.meta.sample_index)
                if key in pending:
                    pending.discard(key)
                    ingested[key] = sample
            for group_id in list(open_groups):
                if all((group_id, i) in ingested for i in range(group_size)):
                    open_groups.discard(group_id)

        elif op == "advance":
            store.set_policy_version(store.policy_version + 1)

        else:
            batch = store.take_batch()
            if batch is not None:
                version = store.policy_version
                assert len(batch) == samples_per_step
                batch_keys = keys(batch)
                assert len(set(batch_keys)) == len(batch_keys)
                # whole groups only
                groups = {g for g, _ in batch_keys}
                assert set(batch_keys) == {(g, i) for g in groups for i in range(group_size)}
                for sample, key in zip(batch, batch_keys, strict=True):
                    assert version - sample.version <= max_staleness
                    assert key not in served
                    assert sample is ingested[key]  # the first copy, never a duplicate
                    served.add(key)
                # oldest first: no group left waiting is older than a group that was served
                # (a group's version is the oldest of its samples')
                served_group_versions = [
                    min(s.version for s in batch if s.meta.group_id == g) for g in groups
                ]
                for group in store.ready:
                    assert group.version >= max(served_group_versions)

        # invariants after every operation
        partial = sum(len(g.samples) for g in store.in_flight.values())
        counters = store.counters
        assert counters["accepted"] == (
            counters["served"] + counters["dropped_stale"] + store.held_samples() + partial
        )
        assert counters["accepted"] == len(ingested)
        assert counters["served"] == len(served)
        assert set(store.in_flight) == open_groups
        assert store.started_samples <= store.admission_limit()
        for group in store.ready:
            assert group.complete


def test_environment_tokens_do_not_make_a_sample_stale():
    """Multi-turn samples: tool tokens carry version -1 and are not the sample's version."""
    assert make_sample(0, 0, [-1, -1, 4, 5]).version == 4
    assert make_sample(0, 0, [3, -1, 5]).version == 3
    store = make_store(group_size=1, samples_per_step=1, max_staleness=0)
    store.dispatch("gen-0", max_samples=1)
    store.set_policy_version(4)
    store.ingest([make_sample(0, 0, [4, -1, -1, 4])])
    assert store.take_batch() is not None  # served at staleness 0, not 5


def test_samples_whose_reward_function_failed_are_counted_by_tag():
    store = make_store(group_size=2, samples_per_step=2)
    store.dispatch("gen-0", max_samples=2)
    failed = make_sample(0, 0, [0])
    failed.meta.reward_error = "error:timeout"
    store.ingest([failed, make_sample(0, 1, [0])])
    stats = store.stats()
    assert stats["buffer_reward_errors"] == 1.0
    assert stats["buffer_reward_error_timeout"] == 1.0


def test_generator_counters_are_averaged_and_summed_over_generators():
    from asyncrl.buffer.metrics import generators_summary

    summary = generators_summary(
        {
            "gen-0": {"weight_swap_latency_s": 0.2, "weight_swaps": 3.0},
            "gen-1": {"weight_swaps": 5.0},
        }
    )
    assert summary["generators_weight_swap_latency_s"] == pytest.approx(0.2)
    assert summary["generators_weight_swaps"] == 4.0
    assert summary["generators_weight_swaps_total"] == 8.0


def test_a_peak_is_the_largest_over_generators_and_a_latency_has_no_total():
    # the longest chunk of any replica, not the mean of each one's longest
    from asyncrl.buffer.metrics import generators_summary, pools_summary

    per_generator = {
        "gen-0": {"chunk_s_max": 9.0, "weight_swap_latency_s": 0.2, "chunks": 4.0},
        "gen-1": {"chunk_s_max": 1.0, "weight_swap_latency_s": 0.4, "chunks": 6.0},
    }
    summary = generators_summary(per_generator)
    assert summary["generators_chunk_s_max"] == 9.0
    assert "generators_chunk_s_max_total" not in summary
    assert summary["generators_weight_swap_latency_s"] == pytest.approx(0.3)
    assert "generators_weight_swap_latency_s_total" not in summary
    assert summary["generators_chunks_total"] == 10.0
    pools = pools_summary(per_generator, {"gen-0": "main", "gen-1": "main"})
    assert pools["pool_main_chunk_s_max"] == 9.0
    assert pools["pool_main_weight_swap_latency_s"] == pytest.approx(0.3)
    assert pools["pool_main_chunks_total"] == 10.0 and pools["pool_main_replicas"] == 2.0


def test_generator_counters_are_summed_per_pool():
    from asyncrl.buffer.metrics import pools_summary

    per_generator = {
        "fast-0": {"samples_sent": 10.0, "restarts": 1.0},
        "fast-1": {"samples_sent": 5.0},
        "gen-0": {"samples_sent": 2.0},
    }
    summary = pools_summary(per_generator, {"fast-0": "fast", "fast-1": "fast"})
    assert summary["pool_fast_samples_sent_total"] == 15.0
    assert summary["pool_fast_restarts_total"] == 1.0
    assert summary["pool_fast_replicas"] == 2.0
    assert summary["pool_default_samples_sent_total"] == 2.0  # a generator of no named pool


def test_a_sample_without_model_tokens_is_never_stale():
    """An episode over before the model spoke (its prompt filled the token budget) has
    only environment tokens, version -1: it must not count as version 0 and go stale."""
    store = make_store(group_size=2, samples_per_step=2, max_staleness=0)
    [item] = store.dispatch("gen-0", 2, now=0.0)
    store.set_policy_version(1)
    samples = [make_sample(item.group_id, i, versions=[-1, -1]) for i in range(2)]
    assert store.ingest(samples) == 2
    batch = store.take_batch()
    assert batch is not None and keys(batch) == [(item.group_id, 0), (item.group_id, 1)]
    assert store.stats()["buffer_dropped_stale"] == 0
