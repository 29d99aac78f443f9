"""No prompt given up on without a name: stale retries, skipped ids, trained-since on restore.

A group evicted as stale before it was ever served has its prompt handed out
again (same group id) up to ``buffer.stale_retries`` times; after that, and for
a filtered group at once, the prompt is recorded by id with its reason in the
store, the checkpoint's ``buffer.json`` and ``RUN_DIR/skipped_prompts.jsonl``.
"""

from __future__ import annotations

import json
import random
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl.buffer.durable import Skip, unfinished_groups
from asyncrl.buffer.main import build_store, restore_from
from asyncrl.buffer.service import BufferService
from asyncrl.buffer.skips import SKIPPED_PROMPTS
from asyncrl.buffer.store import BufferStore
from asyncrl.config import load_config
from asyncrl.core.paths import BUFFER_STATE
from tests.helpers.buffer_samples import group_samples, make_store


def ids(items) -> list[int]:
    return [item.group_id for item in items]


def go_stale(store: BufferStore, group_id: int, generator: str = "gen-0") -> None:
    """Complete ``group_id`` at the current version, then move the version past its reach."""
    store.ingest(group_samples(store, group_id, generator, versions=[store.policy_version]))
    store.set_policy_version(store.policy_version + store.config.max_staleness + 1)
    assert store.take_batch() is None


def roundtrip(state: dict) -> dict:
    """What a checkpoint file gives back."""
    return json.loads(json.dumps(state))


def base_state(**fields) -> dict:
    state = {"cursor": 4, "policy_version": 2, "started_samples": 8, "unfinished_groups": [1, 3]}
    return state | fields


# ------------------------------------------------------------------ stale retries


def test_a_stale_group_s_prompt_goes_out_again_under_its_own_id_before_new_prompts():
    store = make_store(group_size=2, samples_per_step=2, max_staleness=0, stale_retries=2)
    assert ids(store.dispatch("gen-0", 2)) == [0]
    go_stale(store, 0)
    assert store.counters["dropped_stale"] == 2  # its samples are still counted as evicted
    assert store.counters["stale_requeued_groups"] == 1
    assert store.started_samples == 2  # it keeps its admission budget, like any requeue
    assert store.durable_state()["unfinished_groups"] == [0]
    assert ids(store.dispatch("gen-1", 4)) == [0, 1]  # the retry first, then a new prompt
    store.ingest(group_samples(store, 0, "gen-1", versions=[1]))
    store.ingest(group_samples(store, 1, "gen-1", versions=[1]))
    assert {s.meta.group_id for s in store.take_batch()} == {0}
    assert store.skipped == []
    assert store.accounted() == store.counters["accepted"]
    stats = store.stats()
    assert stats["buffer_stale_requeued_groups"] == 1.0
    assert stats["buffer_prompts_skipped_stale"] == 0.0


def test_a_prompt_out_of_stale_retries_is_skipped_by_id_and_frees_its_budget():
    store = make_store(group_size=2, samples_per_step=2, max_staleness=0, stale_retries=1)
    store.dispatch("gen-0", 2)
    go_stale(store, 0)  # version 1: the one retry
    assert ids(store.dispatch("gen-0", 2)) == [0]
    go_stale(store, 0)  # version 2: out of retries
    assert store.skipped == [Skip(0, "stale", 2)]
    assert store.started_samples == 0
    assert store.prompts.stale_evictions == {}
    state = store.durable_state()
    assert state["unfinished_groups"] == []
    assert state["skipped_groups"] == [{"group_id": 0, "reason": "stale", "step": 2}]
    assert ids(store.dispatch("gen-0", 100)) == [1, 2, 3]  # never group 0 again
    stats = store.stats()
    assert stats["buffer_prompts_skipped_stale"] == 1.0
    assert stats["buffer_prompts_skipped"] == 1.0
    assert stats["buffer_dropped_stale"] == 4.0


def test_with_no_stale_retries_a_stale_prompt_is_skipped_at_once_and_named():
    store = make_store(group_size=2, samples_per_step=2, max_staleness=0)  # stale_retries=0
    store.dispatch("gen-0", 2)
    go_stale(store, 0)
    assert not store.requeue
    assert store.skipped == [Skip(0, "stale", 1)]


def test_retries_used_before_a_checkpoint_count_after_the_resume():
    store = make_store(group_size=2, samples_per_step=2, max_staleness=0, stale_retries=1)
    store.dispatch("gen-0", 2)
    go_stale(store, 0)  # its one retry is used: group 0 waits to go out again
    state = roundtrip(store.durable_state())
    assert state["stale_evictions"] == [[0, 1]]

    resumed = make_store(group_size=2, samples_per_step=2, max_staleness=0, stale_retries=1)
    resumed.restore(state)
    assert ids(resumed.dispatch("gen-1", 2)) == [0]
    go_stale(resumed, 0, "gen-1")
    assert resumed.skipped == [Skip(0, "stale", 2)]  # no second retry


def test_a_batch_handed_back_keeps_its_groups_stale_retries():
    store = make_store(group_size=2, samples_per_step=2, max_staleness=0, stale_retries=1)
    store.dispatch("gen-0", 2)
    go_stale(store, 0)
    store.dispatch("gen-0", 2)
    store.ingest(group_samples(store, 0, versions=[1]))
    assert store.take_batch() is not None
    assert store.return_last_batch() == 2  # the learner stopped before training it
    store.set_policy_version(2)
    assert store.take_batch() is None
    assert store.skipped == [Skip(0, "stale", 2)]  # the retry was used before the hand-back


def test_skipped_prompts_stay_skipped_across_a_resume():
    store = make_store(group_size=2, samples_per_step=2, max_staleness=0)
    store.dispatch("gen-0", 4)
    go_stale(store, 0)
    resumed = make_store(group_size=2, samples_per_step=2, max_staleness=0)
    resumed.restore(roundtrip(store.durable_state()))
    assert resumed.skipped == store.skipped
    assert resumed.stats()["buffer_prompts_skipped_stale"] == 1.0
    assert ids(resumed.dispatch("gen-1", 100)) == [1, 2]


# ---------------------------------------------------------------------- filtered


@pytest.mark.parametrize(
    ("option", "fields", "reason"),
    [
        ("filter_equal_rewards", {"reward": 1.0}, "filtered_equal_rewards"),
        ("filter_truncated", {"finish_reason": "length"}, "filtered_truncated"),
    ],
)
def test_a_filtered_group_s_prompt_is_skipped_by_id_with_the_filter_as_reason(
    option, fields, reason
):
    store = make_store(group_size=2, samples_per_step=2, max_staleness=1, **{option: True})
    store.dispatch("gen-0", 4)
    store.ingest(group_samples(store, 1, **fields))
    assert store.skipped == [Skip(1, reason, 0)]
    assert store.durable_state()["unfinished_groups"] == [0]
    assert store.stats()[f"buffer_prompts_skipped_{reason}"] == 1.0


# ------------------------------------------------------------ trained since a state


def test_groups_trained_since_the_state_are_never_handed_out_again():
    store = make_store(group_size=2, samples_per_step=4, max_staleness=1)
    # cursor 4, groups 1 and 3 unfinished; the learner trained 3, 4 and 6 after it was written
    store.restore(base_state(trained_since=[3, 4, 6]))
    assert ids(store.dispatch("gen-0", 100)) == [1, 5, 7]
    assert store.counters["restored_skipped_trained"] == 3  # 3 (unfinished), 4 and 6
    assert store.counters["restored_groups"] == 1
    # 8 started + 4 and 6 (trained: their samples count) + 5 and 7 = 16, the limit at v2
    assert store.started_samples == store.admission_limit() == 16
    stats = store.stats()
    assert stats["buffer_restored_skipped_trained"] == 3.0


def test_a_trained_group_past_the_cursor_not_reached_yet_is_kept_in_the_next_state():
    store = make_store(group_size=2, samples_per_step=4, max_staleness=1)
    store.restore(base_state(trained_since=[9]))
    assert ids(store.dispatch("gen-0", 4)) == [1, 3]
    state = roundtrip(store.durable_state())
    assert state["trained_ahead"] == [9]
    resumed = make_store(group_size=2, samples_per_step=4, max_staleness=1, admission_control=False)
    resumed.restore(state)
    handed_out = ids(resumed.dispatch("gen-1", 100))
    assert 9 not in handed_out and 10 in handed_out  # passed over
    assert resumed.new_prompts.trained_ahead == set()


def test_a_state_without_the_new_fields_restores_as_before():
    store = make_store(group_size=2, samples_per_step=4, max_staleness=1)
    store.restore(base_state())
    assert ids(store.dispatch("gen-0", 100)) == [1, 3, 4, 5, 6, 7]
    assert (
        store.skipped == []
        and store.prompts.stale_evictions == {}
        and store.new_prompts.trained_ahead == set()
    )


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"cursor": -1}, "cursor: expected an int >= 0"),
        ({"cursor": "4"}, "cursor: expected an int >= 0"),
        ({"started_samples": True}, "started_samples: expected an int >= 0"),
        ({"policy_version": None}, "policy_version: expected an int >= 0"),
        ({"unfinished_groups": [1, 4]}, "unfinished_groups: group 4 is not below cursor 4"),
        ({"unfinished_groups": [1, 1]}, "unfinished_groups: a group id appears twice"),
        ({"unfinished_groups": [1.5]}, "unfinished_groups: group ids are ints >= 0"),
        ({"unfinished_groups": {"1": 1}}, "unfinished_groups: expected a list"),
        ({"trained_since": [-2]}, "trained_since: group ids are ints >= 0"),
        ({"trained_since": [1 << 62]}, "trained_since: group 4611686018427387904 is not below"),
        ({"trained_ahead": ["7"]}, "trained_ahead: group ids are ints >= 0"),
        ({"stale_evictions": [[2, 1]]}, "stale_evictions: group 2 is not in unfinished_groups"),
        ({"stale_evictions": [[1, 0]]}, "stale_evictions: group 1: times must be >= 1"),
        ({"stale_evictions": [[1]]}, "stale_evictions: expected [group_id, times] pairs"),
        ({"skipped_groups": [{"group_id": 0}]}, "skipped_groups: expected {group_id, reason"),
        (
            {"skipped_groups": [{"group_id": 1, "reason": "stale", "step": 0}]},
            "skipped_groups: group 1 is also in unfinished_groups",
        ),
        (
            {"skipped_groups": [{"group_id": 0, "reason": "bored", "step": 0}]},
            "skipped_groups: group 0: reason 'bored' is not one of",
        ),
        (
            {"skipped_groups": [{"group_id": 9, "reason": "stale", "step": 0}]},
            "skipped_groups: group 9 is not an int below cursor 4",
        ),
        (
            {"skipped_groups": [{"group_id": 0, "reason": "stale", "step": -1}]},
            "skipped_groups: group 0: step -1",
        ),
    ],
)
def test_restore_refuses_a_malformed_state_naming_buffer_json_and_the_field(fields, message):
    store = make_store()
    with pytest.raises(ValueError, match="^" + re.escape(f"buffer.json: {message}")):
        store.restore(base_state(**fields))
    assert store.cursor == 0 and not store.requeue  # nothing was restored


def test_restore_refuses_a_state_missing_a_field():
    state = base_state()
    del state["unfinished_groups"]
    with pytest.raises(ValueError, match=r"^buffer\.json: unfinished_groups: missing$"):
        make_store().restore(state)


# ------------------------------------------------------------- every prompt named


def run_randomly(store: BufferStore, rng: random.Random, steps: int, trained: list[int]) -> None:
    """Generators that lag behind the learner (so groups go stale), learner steps;
    appends trained group ids to ``trained``."""
    for _ in range(steps):
        generator = rng.choice(["gen-0", "gen-1"])
        store.dispatch(generator, max_samples=rng.choice([2, 4, 6]), now=0.0)
        for group_id, group in list(store.in_flight.items()):
            if rng.random() < 0.6:
                version = max(0, store.policy_version - rng.choice([0, 0, 1, 2, 3]))
                equal = rng.choice([{}, {}, {"reward": 1.0}])  # equal rewards: filtered
                store.ingest(
                    group_samples(store, group_id, group.generator_id, versions=[version], **equal)
                )
        batch = store.take_batch()
        if batch is not None:
            trained += sorted({s.meta.group_id for s in batch})
            store.set_policy_version(store.policy_version + 1)


def assert_every_prompt_named(store: BufferStore, trained: list[int]) -> None:
    """Invariant 8: below the cursor, each prompt is trained, unfinished or skipped, once."""
    unfinished = unfinished_groups(store)
    skipped = [skip.group_id for skip in store.skipped]
    everything = trained + unfinished + skipped
    assert sorted(everything) == list(range(store.cursor)), "a prompt lost or counted twice"
    assert store.accounted() == store.counters["accepted"]


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    retries=st.integers(0, 2),
    before=st.integers(0, 30),
    after=st.integers(1, 30),
)
def test_every_prompt_is_trained_unfinished_or_skipped_by_id_across_a_resume(
    seed, retries, before, after
):
    rng = random.Random(seed)
    options = {"max_staleness": 1, "stale_retries": retries, "filter_equal_rewards": True}
    first = make_store(group_size=2, samples_per_step=4, **options)
    trained: list[int] = []
    run_randomly(first, rng, before, trained)
    assert_every_prompt_named(first, trained)
    assert all(times <= retries for times in first.prompts.stale_evictions.values())
    state = roundtrip(first.durable_state())
    run_randomly(first, rng, 5, [])  # lost with the crash

    resumed = make_store(group_size=2, samples_per_step=4, **options)
    resumed.restore(state)
    run_randomly(resumed, rng, after, trained)
    assert_every_prompt_named(resumed, trained)
    stale = [skip for skip in resumed.skipped if skip.reason == "stale"]
    assert len(stale) == resumed.stats()["buffer_prompts_skipped_stale"]


# ------------------------------------------------------------------- the service


@pytest.fixture
def service(tmp_path):
    config = load_config(None, ["model.tiny={}", "buffer.stale_retries=0"])
    store = make_store(group_size=2, samples_per_step=2, max_staleness=0)
    made = BufferService(config, store, "inproc://skips", tmp_path)
    yield made
    made.socket.close(linger=0)
    made.context.term()


def read_record(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / SKIPPED_PROMPTS).read_text().splitlines()]


def test_the_service_appends_each_skipped_prompt_to_skipped_prompts_jsonl(
    service, tmp_path, caplog
):
    service.skips.start(service.store.skipped)
    assert not (tmp_path / SKIPPED_PROMPTS).exists()  # a new run that skipped nothing
    service.store.dispatch("gen-0", 2)
    go_stale(service.store, 0)
    service.skips.record(service.store.skipped, stale_retries=0)
    assert ids(service.store.dispatch("gen-0", 2)) == [1]
    go_stale(service.store, 1)
    service.skips.record(service.store.skipped, stale_retries=0)
    service.skips.record(
        service.store.skipped, stale_retries=0
    )  # nothing new: nothing written twice
    assert read_record(tmp_path) == [
        {"group_id": 0, "reason": "stale", "step": 1},
        {"group_id": 1, "reason": "stale", "step": 2},
    ]
    warnings = [r.getMessage() for r in caplog.records if "skipped as stale" in r.getMessage()]
    assert len(warnings) == 2 and "(1)" in warnings[1] and SKIPPED_PROMPTS in warnings[1]


def test_a_resumed_service_rewrites_the_record_from_the_checkpoint(service, tmp_path):
    (tmp_path / SKIPPED_PROMPTS).write_text('{"group_id": 7, "reason": "stale", "step": 9}\n')
    skip = {"group_id": 2, "reason": "filtered_truncated", "step": 1}
    service.store.restore(base_state(skipped_groups=[skip]))
    service.skips.start(
        service.store.skipped
    )  # the skip of group 7 came after the checkpoint: undone
    assert read_record(tmp_path) == [skip]


def test_build_store_takes_stale_retries_from_the_config():
    config = load_config(None, ["model.tiny={}", "buffer.stale_retries=5"])
    assert build_store(config, lambda index: None, eval_items=[]).config.stale_retries == 5


@pytest.mark.parametrize("text", ["{not json", json.dumps(base_state(cursor=-3))])
def test_resuming_from_a_bad_buffer_json_stops_with_one_line_naming_it(tmp_path, text):
    (tmp_path / BUFFER_STATE).write_text(text)
    with pytest.raises(SystemExit) as stopped:
        restore_from(make_store(), tmp_path)
    message = str(stopped.value)
    assert message.startswith(f"cannot resume from {tmp_path / BUFFER_STATE}: ")
    assert "\n" not in message
