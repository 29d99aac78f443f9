"""Multi-turn episodes at the buffer: their counts are checked (asyncrl.buffer.validation),
reduced per batch (``episode_*``, asyncrl.buffer.metrics) and per eval round
(``eval_turns_mean``, ..., asyncrl.buffer.evaluation)."""

from __future__ import annotations

import msgspec
import pytest

from asyncrl.buffer.metrics import episode_metrics, generators_summary
from asyncrl.buffer.validation import check_stats
from asyncrl.core.messages import (
    BatchRequest,
    EpisodeCounts,
    Trajectories,
    TrajectoryMeta,
    WireError,
    WorkRequest,
)
from tests.helpers.buffer_samples import episodes_of, eval_sample, eval_store, whole
from tests.helpers.buffer_service import LEARNER, Recorded, samples_of
from tests.helpers.buffer_validation import check, held_store, message


def episode_meta(turns: int, calls: int, errors: int, finish_reason: str = "stop"):
    return TrajectoryMeta(
        0, 0, 2, 1, 0.0, finish_reason, "gen-0", episode=EpisodeCounts(turns, calls, errors)
    )


# ------------------------------------------------------------------ validation


def test_possible_counts_pass():
    samples = check(*message(episode=EpisodeCounts(2, 3, 3)), store=held_store())
    assert [s.meta.episode for s in samples] == [EpisodeCounts(2, 3, 3)] * 2


@pytest.mark.parametrize(
    ("counts", "named"),
    [
        (EpisodeCounts(turns=0, tool_calls=0, tool_errors=0), "episode.turns"),
        (EpisodeCounts(turns=2, tool_calls=1, tool_errors=2), "episode.tool_errors"),
    ],
    ids=["no_turn", "more_errors_than_calls"],
)
def test_impossible_counts_refuse_the_message_naming_the_field(counts, named):
    body, arrays = message(group_ids=(0, 1))
    metas = list(body.samples)
    metas[3] = msgspec.structs.replace(metas[3], episode=counts)  # one sample of four
    with pytest.raises(WireError) as caught:
        check(msgspec.structs.replace(body, samples=metas), arrays, store=held_store())
    assert caught.value.reason == "bad_field"
    assert named in str(caught.value)


def test_a_replica_s_time_in_its_environments_is_a_counter_it_may_report():
    check_stats({"busy_s": 4.0, "env_tool_s": 2.5}, "gen-0")  # accepted like env_turns
    summary = generators_summary({"gen-0": {"env_tool_s": 2.5}, "gen-1": {"env_tool_s": 1.0}})
    assert summary["generators_env_tool_s_total"] == 3.5


# ------------------------------------------------------------------- per batch


def test_a_batch_s_episode_figures():
    metas = [
        episode_meta(1, 0, 0),  # answered at once: no tool
        episode_meta(3, 2, 1),  # one call worked
        episode_meta(4, 2, 2, "length"),  # every call failed, and it ran out of tokens
        episode_meta(4, 4, 0, "max_turns"),
    ]
    assert episode_metrics(metas) == {
        "episode_turns_mean": 3.0,
        "episode_tool_calls_mean": 2.0,
        "episode_tool_success_frac": 0.5,
        "episode_tool_error_frac": 3 / 8,
        "episode_truncated_frac": 0.5,
    }


def test_samples_without_counts_are_left_out_and_a_single_turn_batch_has_no_figures():
    single = TrajectoryMeta(0, 1, 2, 1, 0.0, "length", "gen-0")
    assert episode_metrics([single, single]) == {}
    figures = episode_metrics([single, episode_meta(2, 0, 0)])
    assert figures["episode_turns_mean"] == 2.0
    assert figures["episode_truncated_frac"] == 0.0  # the single turn's "length" is not counted
    assert figures["episode_tool_error_frac"] == 0.0  # no call: 0, not NaN


@pytest.mark.parametrize("episodes", [True, False], ids=["episodes", "single_turn"])
def test_the_batch_served_to_the_learner_carries_its_episode_figures(episodes):
    buffer = Recorded()
    try:
        buffer.handle(b"g", WorkRequest("gen-g", 4))
        first, second = buffer.last(b"g").items
        if episodes:
            buffer.handle(b"g", *episodes_of(first, "gen-g", EpisodeCounts(2, 1, 0)))
            buffer.handle(b"g", *episodes_of(second, "gen-g", EpisodeCounts(4, 3, 3)))
        else:
            buffer.handle(b"g", *samples_of(first, "gen-g"))
            buffer.handle(b"g", *samples_of(second, "gen-g"))
        buffer.handle(LEARNER, BatchRequest(policy_version=0))
        batch = buffer.last(LEARNER)
        assert isinstance(batch, Trajectories) and len(batch.samples) == 4
        assert "buffer_held" in batch.stats  # the buffer's own metrics ride along as before
        figures = {k: v for k, v in batch.stats.items() if k.startswith("episode_")}
        expected = {
            "episode_turns_mean": 3.0,
            "episode_tool_calls_mean": 2.0,
            "episode_tool_success_frac": 0.5,
            "episode_tool_error_frac": 0.75,
            "episode_truncated_frac": 0.0,
        }
        assert figures == (expected if episodes else {})
    finally:
        buffer.close()


# ------------------------------------------------------------------ eval rounds


def test_an_episode_round_reports_turns_and_tool_use():
    store = eval_store(count=2, samples=2)
    assert store.start_eval(1, policy_version=2)
    first, second = store.dispatch("gen-0", 4)
    for index, counts in enumerate([EpisodeCounts(1, 0, 0), EpisodeCounts(3, 2, 0)]):
        sample = eval_sample(first, index)
        sample.meta = msgspec.structs.replace(sample.meta, episode=counts)
        store.ingest([sample])
    for index, counts in enumerate([EpisodeCounts(2, 1, 1), EpisodeCounts(2, 1, 0)]):
        sample = eval_sample(second, index)
        sample.meta = msgspec.structs.replace(sample.meta, episode=counts)
        store.ingest([sample])
    results = store.evaluation.next_results()
    assert results["eval_samples"] == 4.0
    assert results["eval_turns_mean"] == 2.0
    assert results["eval_tool_calls_mean"] == 1.0
    assert results["eval_tool_success_frac"] == 0.5
    assert results["eval_tool_error_frac"] == 0.25


def test_a_single_turn_round_has_no_episode_results():
    store = eval_store(count=1, samples=2)
    assert store.start_eval(0, policy_version=0)
    (item,) = store.dispatch("gen-0", 2)
    store.ingest(whole(item))
    results = store.evaluation.next_results()
    assert results["eval_samples"] == 2.0
    assert not [key for key in results if "turns" in key or "tool" in key]
