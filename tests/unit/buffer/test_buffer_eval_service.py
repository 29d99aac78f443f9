"""The buffer service's side of eval: StartEval, held requests, results with a batch.

Messages go straight into ``BufferService._handle`` and replies are recorded
instead of sent, so the order of events is the test's, not a socket's.
"""

from __future__ import annotations

import time

import pytest

from asyncrl.core.messages import (
    Ack,
    BatchRequest,
    StartEval,
    Trajectories,
    WireError,
    WorkGrant,
    WorkRequest,
)
from tests.helpers.buffer_service import LEARNER, Recorded, samples_of


@pytest.fixture
def service():
    made: list[Recorded] = []

    def make(*overrides: str) -> Recorded:
        made.append(Recorded(*overrides))
        return made[-1]

    yield make
    for recorded in made:
        recorded.close()


def test_a_held_work_request_gets_the_eval_round_the_moment_it_starts(service):
    buffer = service("eval.every_steps=1", "eval.max_prompts=2")
    buffer.handle(b"a", WorkRequest("gen-a", 4))
    assert [i.group_id for i in buffer.last(b"a").items] == [0, 1]  # admission is full now
    buffer.handle(b"b", WorkRequest("gen-b", 4, wait_s=5.0))
    assert b"b" not in buffer.replies and "gen-b" in buffer.held  # nothing to give: held

    buffer.handle(LEARNER, StartEval(round=1, policy_version=0))
    assert buffer.last(LEARNER) == Ack(accepted=1)
    grant = buffer.last(b"b")
    assert isinstance(grant, WorkGrant)
    assert [(i.group_id, i.eval_round) for i in grant.items] == [(-1, 1), (-2, 1)]
    assert not buffer.held
    assert buffer.counters["work_requests_held_granted"] == 1


def test_a_round_due_while_one_runs_is_answered_not_started(service):
    buffer = service("eval.every_steps=1", "eval.max_prompts=2")
    buffer.handle(LEARNER, StartEval(round=1, policy_version=1))
    buffer.handle(LEARNER, StartEval(round=2, policy_version=2))
    assert buffer.replies[LEARNER] == [Ack(accepted=1), Ack(accepted=0)]
    assert buffer._status(time.monotonic()).stats["eval_rounds_skipped_total"] == 1


def test_results_ride_along_with_the_next_batch_once(service):
    buffer = service("eval.every_steps=1", "eval.max_prompts=1", "eval.samples_per_prompt=2")
    buffer.handle(LEARNER, StartEval(round=0, policy_version=0))
    buffer.handle(b"a", WorkRequest("gen-a", 6))
    items = buffer.last(b"a").items
    assert [(i.group_id, i.eval_round) for i in items] == [(-1, 0), (0, -1), (1, -1)]
    buffer.handle(b"a", *samples_of(items[0], "gen-a", reward=0.5))
    assert buffer.last(b"a") == Ack(accepted=2)
    for item in items[1:]:
        buffer.handle(b"a", *samples_of(item, "gen-a"))
    buffer.handle(LEARNER, BatchRequest(policy_version=0))
    batch = buffer.last(LEARNER)
    assert isinstance(batch, Trajectories)
    assert sorted({s.group_id for s in batch.samples}) == [0, 1]  # no eval sample
    assert batch.stats["eval_reward_mean"] == 0.5 and batch.stats["eval_samples"] == 2
    assert batch.stats["eval_round"] == 0

    buffer.handle(LEARNER, BatchRequest(policy_version=1))  # opens admission, waits
    buffer.handle(b"a", WorkRequest("gen-a", 4))
    assert [i.group_id for i in buffer.last(b"a").items] == [2, 3]
    for item in buffer.last(b"a").items:
        buffer.handle(b"a", *samples_of(item, "gen-a", version=1))
    again = buffer.last(LEARNER)
    assert isinstance(again, Trajectories) and again is not batch
    assert "eval_reward_mean" not in again.stats  # delivered once
    assert again.stats["buffer_eval_rounds_completed"] == 1


def test_start_eval_is_refused_when_the_run_has_no_eval(service):
    buffer = service()
    with pytest.raises(WireError) as caught:
        buffer.handle(LEARNER, StartEval(round=0, policy_version=0))
    assert caught.value.reason == "bad_field"
