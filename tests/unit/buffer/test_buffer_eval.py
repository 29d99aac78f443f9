"""BufferStore with held-out eval rounds: dispatch order, liveness, results, delivery.

Eval groups (negative ids) share dispatch and requeue with training groups but
none of its accounting: they are never admitted, held as ready, evicted or served.
"""

from __future__ import annotations

import math

import pytest

from asyncrl.buffer.evaluation import metric_name
from asyncrl.buffer.store import BufferStore
from asyncrl.core.messages import WorkItem
from tests.helpers.buffer_samples import (
    TIMEOUT,
    eval_sample,
    eval_store,
    group_samples,
    make_store,
    whole,
)


def ids(items: list[WorkItem]) -> list[int]:
    return [item.group_id for item in items]


def fill_batch(store: BufferStore, first_group: int, generator_id: str = "gen-0") -> None:
    """Dispatch and complete two training groups: one batch of 4."""
    items = [i for i in store.dispatch(generator_id, 4, now=0.0) if i.eval_round < 0]
    assert ids(items) == [first_group, first_group + 1]
    for item in items:
        store.ingest(group_samples(store, item.group_id, generator_id))


# --------------------------------------------------------------------- dispatch


def test_eval_groups_go_out_after_requeued_groups_and_before_new_prompts():
    store = eval_store(count=2, max_staleness=3)
    assert ids(store.dispatch("gen-a", 2, now=0.0)) == [0]
    store.heartbeat("gen-b", TIMEOUT)
    assert store.expire_silent(now=TIMEOUT + 1) == ["gen-a"]  # group 0 waits to go again
    assert store.start_eval(1, policy_version=0)
    items = store.dispatch("gen-b", 8, now=TIMEOUT + 1)
    assert ids(items) == [0, -1, -2, 1]
    assert [item.eval_round for item in items] == [-1, 1, 1, -1]


def test_eval_groups_are_not_admitted_and_go_out_under_admission_and_back_pressure():
    store = eval_store(count=2, max_staleness=0, max_held_samples=4)
    fill_batch(store, 0)  # admission full (4 of 4 samples) and back-pressure on (4 held)
    assert store.backpressured()
    assert store.start_eval(1, policy_version=0)
    items = store.dispatch("gen-0", 100, now=0.0)
    assert ids(items) == [-1, -2]
    assert store.started_samples == 4  # eval samples take no admission budget
    assert store.counters["dispatched_groups"] == 2  # training groups only
    assert store.counters["dispatch_refused_backpressure"] == 1


def test_a_round_s_groups_are_each_handed_out_once_and_only_whole():
    store = eval_store(count=3, samples=3)
    assert store.start_eval(0, policy_version=0)
    assert ids(store.dispatch("gen-0", 2)) == []  # 3 samples do not fit in 2
    assert ids(store.dispatch("gen-0", 7)) == [-1, -2]
    assert ids(store.dispatch("gen-1", 3)) == [-3]
    assert [i for i in store.dispatch("gen-1", 100) if i.eval_round >= 0] == []


def test_no_eval_group_goes_out_before_a_round_starts():
    store = eval_store(count=2)
    assert all(item.eval_round == -1 for item in store.dispatch("gen-0", 100))


# ------------------------------------------------------------------- liveness


def test_a_dead_generator_s_eval_groups_go_out_again_first_its_late_samples_dropped():
    store = eval_store(count=3, max_staleness=3)
    assert store.start_eval(2, policy_version=0)
    a = store.dispatch("gen-a", 4, now=0.0)
    assert ids(a) == [-1, -2]
    store.ingest([eval_sample(a[0], 0, "gen-a")])  # half of -1: discarded with the group
    store.heartbeat("gen-b", TIMEOUT)
    assert store.expire_silent(now=TIMEOUT + 1) == ["gen-a"]
    assert store.evaluation.counters["requeued_groups"] == 2
    assert store.evaluation.counters["discarded_requeue"] == 1
    b = store.dispatch("gen-b", 6, now=TIMEOUT + 1)
    assert ids(b) == [-1, -2, -3]  # its two groups first, in order, then the rest
    assert store.ingest(whole(a[0], "gen-a")) == 0  # the dead generator's late samples
    assert store.evaluation.counters["dropped_duplicate"] == 2
    for item in b:
        store.ingest(whole(item, "gen-b"))
    results = store.evaluation.next_results()
    assert results["eval_samples"] == 6


def test_a_leaving_generator_hands_its_eval_groups_back():
    store = eval_store(count=2)
    assert store.start_eval(0, policy_version=0)
    assert ids(store.dispatch("gen-a", 6, now=0.0)) == [-1, -2, 0]
    assert store.leave("gen-a") == 3  # one training group, two eval groups
    assert ids(store.dispatch("gen-b", 6, now=1.0)) == [0, -1, -2]


# ---------------------------------------------------------- not training data


def test_eval_samples_are_never_ready_evicted_served_or_counted_as_training():
    store = eval_store(count=2, max_staleness=0)
    assert store.start_eval(0, policy_version=0)
    items = store.dispatch("gen-0", 8, now=0.0)
    assert ids(items) == [-1, -2, 0, 1]
    for item in items:
        if item.eval_round >= 0:
            assert store.ingest(whole(item, versions=[0])) == 2
        else:
            store.ingest(group_samples(store, item.group_id, versions=[0]))
    assert store.counters["accepted"] == 4  # training samples only
    assert store.evaluation.counters["accepted"] == 4
    store.set_policy_version(5)  # everything held is now far too stale
    assert store.take_batch() is None
    assert store.counters["dropped_stale"] == 4  # the training samples, none of the eval ones
    assert store.accounted() == store.counters["accepted"]
    assert store.durable_state()["unfinished_groups"] == []  # eval groups are never kept


def test_batches_hold_training_groups_only():
    store = eval_store(count=2)
    assert store.start_eval(0, policy_version=0)
    items = store.dispatch("gen-0", 8, now=0.0)
    for item in items:
        if item.eval_round >= 0:
            store.ingest(whole(item))
        else:
            store.ingest(group_samples(store, item.group_id))
    batch = store.take_batch()
    assert batch is not None
    assert sorted({s.meta.group_id for s in batch}) == [0, 1]
    assert all(s.meta.eval_round == -1 for s in batch)


# -------------------------------------------------------------------- results


def test_a_round_s_results_are_computed_from_all_its_samples():
    store = eval_store(count=2, samples=2)
    assert store.start_eval(3, policy_version=6, now=10.0)
    first, second = store.dispatch("gen-0", 4)
    store.ingest([eval_sample(first, 0, reward=1.0, versions=[6, 6, 7])])
    store.ingest([eval_sample(first, 1, reward=0.5, versions=[6], finish_reason="length")])
    store.ingest([eval_sample(second, 0, reward=0.0, versions=[6, 6])])
    assert not store.evaluation.results  # not before the last sample
    store.ingest([eval_sample(second, 1, reward=0.5, versions=[6, -1, 8])], now=12.5)
    results = store.evaluation.next_results()
    assert results == {
        "eval_round": 3.0,
        "eval_policy_version": 6.0,
        "eval_samples": 4.0,
        "eval_reward_mean": 0.5,
        "eval_response_len_mean": 2.25,
        "eval_finish_length_frac": 0.25,
        "eval_reward_errors": 0.0,
        "eval_version_min": 6.0,
        "eval_version_max": 8.0,  # a sample continued on newer weights (partial rollout)
        "eval_duration_s": 2.5,
    }
    assert store.evaluation.current is None
    assert store.stats()["buffer_eval_rounds_completed"] == 1


def test_rewards_per_data_source_when_there_is_more_than_one():
    store = eval_store(count=4, samples=1, sources=("openai/gsm8k", "math"))
    assert store.start_eval(0, policy_version=0)
    for item, reward in zip(store.dispatch("gen-0", 4), [1.0, 0.0, 0.5, 0.0], strict=True):
        store.ingest(whole(item, reward=reward))
    results = store.evaluation.next_results()
    assert results["eval_reward_openai_gsm8k"] == 0.75
    assert results["eval_reward_math"] == 0.0
    assert results["eval_reward_mean"] == 0.375
    assert metric_name("lighteval/MATH-500") == "lighteval_MATH_500"


def test_a_single_data_source_gets_no_per_source_reward():
    store = eval_store(count=2, samples=1)
    assert store.start_eval(0, policy_version=0)
    for item in store.dispatch("gen-0", 2):
        store.ingest(whole(item))
    assert not [key for key in store.evaluation.next_results() if key.startswith("eval_reward_s")]


def test_results_ride_along_with_exactly_one_batch():
    store = eval_store(count=1, samples=2, max_staleness=3)
    assert store.start_eval(0, policy_version=0)
    items = store.dispatch("gen-0", 6, now=0.0)
    assert ids(items) == [-1, 0, 1]
    store.ingest(whole(items[0], reward=0.25))
    for item in items[1:]:
        store.ingest(group_samples(store, item.group_id))
    assert store.take_batch() is not None
    assert store.batch_eval_results["eval_reward_mean"] == 0.25
    fill_batch(store, 2)
    assert store.take_batch() is not None
    assert store.batch_eval_results == {}  # delivered once, not again


def test_a_batch_taken_back_gives_its_eval_results_back():
    store = eval_store(count=1, samples=1, max_staleness=3)
    assert store.start_eval(0, policy_version=0)
    item = store.dispatch("gen-0", 1)[0]
    store.ingest(whole(item, reward=0.75))
    fill_batch(store, 0)
    assert store.take_batch() is not None and store.batch_eval_results["eval_round"] == 0
    store.return_last_batch()  # the learner stopped before logging it
    assert store.batch_eval_results == {}
    assert store.take_batch() is not None
    assert store.batch_eval_results["eval_reward_mean"] == 0.75


def test_rounds_that_finish_between_two_batches_are_delivered_one_per_batch_in_order():
    store = eval_store(count=1, samples=1, max_staleness=5)
    for number in (1, 2):
        assert store.start_eval(number, policy_version=number)
        store.ingest(whole(store.dispatch("gen-0", 1)[0]))
    delivered = []
    for first_group in (0, 2, 4):
        fill_batch(store, first_group)
        assert store.take_batch() is not None
        delivered.append(store.batch_eval_results.get("eval_round"))
    assert delivered == [1.0, 2.0, None]


# ------------------------------------------------------------- skipped rounds


def test_a_round_due_while_one_runs_is_skipped_and_counted_not_queued():
    store = eval_store(count=2)
    assert store.start_eval(1, policy_version=10)
    assert not store.start_eval(2, policy_version=20)
    assert store.stats()["eval_rounds_skipped_total"] == 1
    items = store.dispatch("gen-0", 4)
    assert {item.eval_round for item in items if item.group_id < 0} == {1}
    for item in items:
        if item.group_id < 0:
            store.ingest(whole(item))
    assert store.evaluation.next_results()["eval_policy_version"] == 10
    assert store.start_eval(3, policy_version=30)  # the next one due runs
    assert store.stats()["buffer_eval_rounds_started"] == 2


def test_a_repeated_start_is_ignored_without_counting_a_skip():
    store = eval_store(count=1, samples=1)
    assert store.start_eval(4, policy_version=40)
    store.ingest(whole(store.dispatch("gen-0", 1)[0]))
    assert not store.start_eval(4, policy_version=40)
    assert store.evaluation.counters["rounds_repeated"] == 1
    assert store.stats()["eval_rounds_skipped_total"] == 0


def test_a_sample_of_an_earlier_round_is_dropped_and_counted():
    store = eval_store(count=1, samples=2)
    assert store.start_eval(1, policy_version=0)
    old = store.dispatch("gen-0", 2)[0]
    store.ingest(whole(old))
    assert store.start_eval(2, policy_version=1)
    new = store.dispatch("gen-0", 2)[0]
    assert store.ingest([eval_sample(old, 0)]) == 0  # tagged round 1, group in flight for 2
    assert store.evaluation.counters["dropped_other_round"] == 1
    assert store.ingest([eval_sample(new, 0)]) == 1


def test_eval_is_off_without_eval_items():
    store = make_store()
    assert not store.evaluation.enabled
    assert not [key for key in store.stats() if "eval" in key]
    with pytest.raises(ValueError, match="no eval prompts"):
        store.start_eval(0, policy_version=0)


def test_version_range_is_unknown_when_no_sample_has_a_model_token():
    store = eval_store(count=1, samples=1)
    assert store.start_eval(0, policy_version=0)
    store.ingest(whole(store.dispatch("gen-0", 1)[0], versions=[-1]))
    results = store.evaluation.next_results()
    assert math.isnan(results["eval_version_min"]) and math.isnan(results["eval_version_max"])


def test_a_running_round_is_not_durable_and_a_resumed_store_can_run_it_again():
    store = eval_store(count=2, max_staleness=3)
    assert store.start_eval(1, policy_version=4)
    items = store.dispatch("gen-0", 6, now=0.0)
    assert ids(items) == [-1, -2, 0]
    store.ingest([eval_sample(items[0], 0)])  # the round is half done
    state = store.durable_state()
    assert state["unfinished_groups"] == [0]  # training groups only
    resumed = eval_store(count=2, max_staleness=3)
    resumed.restore(state)
    assert resumed.evaluation.current is None  # the unfinished round is dropped
    assert ids(resumed.dispatch("gen-1", 2, now=1.0)) == [0]
    assert resumed.start_eval(1, policy_version=4)  # the learner starts it again
    assert ids(resumed.dispatch("gen-1", 4, now=1.0)) == [-1, -2]
