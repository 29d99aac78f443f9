"""The buffer's share of a checkpoint: resuming neither repeats nor skips a prompt."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl.buffer.store import BufferStore
from tests.helpers.buffer_samples import group_samples, make_store


def serve_some(store: BufferStore, rng: random.Random, steps: int, served: list[int]) -> None:
    """Random generator progress and learner steps; appends served group ids to ``served``."""
    for _ in range(steps):
        store.dispatch("gen-0", max_samples=rng.choice([2, 4, 6]))
        for group_id in list(store.in_flight):
            if rng.random() < 0.6:
                store.ingest(group_samples(store, group_id, versions=[store.policy_version]))
        batch = store.take_batch()
        if batch is not None:
            served += sorted({s.meta.group_id for s in batch})
            store.set_policy_version(store.policy_version + 1)


def unfinished(store: BufferStore) -> set[int]:
    return set(store.durable_state()["unfinished_groups"])


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), before=st.integers(0, 30), after=st.integers(1, 40))
def test_a_resumed_store_serves_every_prompt_once(seed, before, after):
    rng = random.Random(seed)
    first = make_store(group_size=2, samples_per_step=4, max_staleness=1)
    served_before: list[int] = []
    serve_some(first, rng, before, served_before)
    state = json.loads(json.dumps(first.durable_state()))  # what the checkpoint file holds
    # the crashed run may go on serving after the checkpoint: that work is lost with it
    serve_some(first, rng, 5, [])

    resumed = make_store(group_size=2, samples_per_step=4, max_staleness=1)
    resumed.restore(state)
    served_after: list[int] = []
    serve_some(resumed, rng, after, served_after)

    served = served_before + served_after
    assert len(served) == len(set(served)), "a prompt was trained on twice"
    pending = unfinished(resumed)
    for group_id in range(resumed.cursor):
        assert (group_id in served) != (group_id in pending), f"group {group_id} was skipped"


def test_unfinished_groups_go_out_before_new_prompts_and_admission_carries_over():
    store = make_store(group_size=2, samples_per_step=4, max_staleness=1)
    assert [i.group_id for i in store.dispatch("gen-0", max_samples=8)] == [0, 1, 2, 3]
    store.ingest(group_samples(store, 1, versions=[0]))
    state = store.durable_state()
    assert state == {
        "cursor": 4,
        "policy_version": 0,
        "started_samples": 8,
        "unfinished_groups": [0, 1, 2, 3],
        "stale_evictions": [],
        "skipped_groups": [],
        "trained_ahead": [],
    }
    resumed = make_store(group_size=2, samples_per_step=4, max_staleness=1)
    resumed.restore(state)
    # the four unfinished groups are handed out again; admission (limit 8) allows no new one
    assert [i.group_id for i in resumed.dispatch("gen-1", max_samples=100)] == [0, 1, 2, 3]
    assert resumed.counters["restored_groups"] == 4
    assert resumed.started_samples == 8


def test_a_served_group_is_not_unfinished():
    store = make_store(group_size=2, samples_per_step=4, max_staleness=1)
    store.dispatch("gen-0", max_samples=4)
    for group_id in (0, 1):
        store.ingest(group_samples(store, group_id, versions=[0]))
    assert store.take_batch() is not None
    assert store.durable_state()["unfinished_groups"] == []


def test_restore_refuses_a_used_store_and_a_group_beyond_the_cursor():
    used = make_store()
    used.dispatch("gen-0", max_samples=2)
    with pytest.raises(RuntimeError, match="fresh store"):
        used.restore(
            {"cursor": 1, "policy_version": 0, "started_samples": 0, "unfinished_groups": []}
        )
    with pytest.raises(ValueError, match="not below cursor"):
        make_store().restore(
            {"cursor": 2, "policy_version": 0, "started_samples": 4, "unfinished_groups": [5]}
        )


@pytest.mark.parametrize("max_reuse", [1, 2])
def test_a_batch_the_learner_stopped_before_training_goes_back_to_unfinished(max_reuse):
    store = make_store(group_size=2, samples_per_step=4, max_staleness=1, max_reuse=max_reuse)
    store.dispatch("gen-0", max_samples=8)
    for group_id in (0, 1, 2, 3):
        store.ingest(group_samples(store, group_id, versions=[0]))
    trained = {s.meta.group_id for s in store.take_batch()}
    store.set_policy_version(1)
    abandoned = {s.meta.group_id for s in store.take_batch()}
    assert not trained & abandoned and not unfinished(store) & (trained | abandoned)

    assert store.return_last_batch() == 4
    # with reuse, the abandoned batch may have re-served a trained group: still trained
    assert unfinished(store) == abandoned - trained
    assert store.accounted() == store.counters["accepted"]  # invariant 5 holds
    assert store.counters["served"] - store.counters["served_again"] == 4
    assert store.stats()["buffer_returned_unconsumed"] == 4.0
    assert store.return_last_batch() == 0  # once only
