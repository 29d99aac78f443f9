"""The final policy's eval (``eval.at_end``): results that reach the learner without a
batch (EvalResultsRequest), the learner's final round, and where its result shows."""

from __future__ import annotations

import asyncio
import io
import json
import math
import time

import msgspec
import pytest
from rich.console import Console

from asyncrl.config import load_config, save_config
from asyncrl.core.messages import (
    SCHEMA_VERSION,
    Ack,
    BatchRequest,
    EvalResults,
    EvalResultsRequest,
    StartEval,
    Trajectories,
    WireError,
    WorkRequest,
    decode,
    encode,
)
from asyncrl.learner.final_eval import FINAL_EVAL, FinalEval, final_round
from asyncrl.run.console import LiveConsole, PlainConsole
from asyncrl.run.launch import closing_message
from asyncrl.run.status import read_metrics, read_records, show
from tests.helpers.buffer_service import LEARNER, Recorded, samples_of
from tests.helpers.console import append, record

EVAL = ("eval.every_steps=1", "eval.max_prompts=2")


@pytest.fixture
def service():
    """Buffer services whose replies are recorded (closed after the test)."""
    made: list[Recorded] = []

    def make(*overrides: str) -> Recorded:
        made.append(Recorded(*overrides))
        return made[-1]

    yield make
    for recorded in made:
        recorded.close()


# ------------------------------------------------------------------------ wire


def test_eval_results_messages_round_trip():
    assert decode(encode(EvalResultsRequest(wait_s=2.5)))[0] == EvalResultsRequest(2.5)
    reply = EvalResults([{"eval_round": 3.0, "eval_reward_mean": 0.5}], running_round=4)
    assert decode(encode(reply))[0] == reply
    assert decode(encode(EvalResults([])))[0].running_round == -1


@pytest.mark.parametrize("wait_s", [-1.0, math.nan, math.inf, 3601.0, "5"])
def test_a_bad_wait_is_rejected_as_bad_header(wait_s):
    body = {"type": "eval_results_request", "wait_s": wait_s}
    head = msgspec.msgpack.encode({"schema_version": SCHEMA_VERSION, "body": body, "arrays": []})
    with pytest.raises(WireError) as caught:
        decode([head])
    assert caught.value.reason == "bad_header"


# ---------------------------------------------------------------------- buffer


def run_round(buffer, number: int, reward: float = 0.5) -> None:
    """Start round ``number`` and send all its samples (two) from one generator."""
    buffer.handle(LEARNER, StartEval(round=number, policy_version=number))
    buffer.handle(b"g", WorkRequest("gen-g", 2))
    for item in buffer.last(b"g").items:
        assert item.eval_round == number
        buffer.handle(b"g", *samples_of(item, "gen-g", reward=reward, version=number))


def test_with_no_round_the_request_is_answered_at_once_saying_so(service):
    buffer = service(*EVAL)
    buffer.handle(LEARNER, EvalResultsRequest(wait_s=30.0))
    assert buffer.last(LEARNER) == EvalResults([], running_round=-1)
    assert buffer.held.results is None


def test_a_request_is_held_until_the_running_round_completes(service):
    buffer = service(*EVAL)
    buffer.store.set_policy_version(5)  # the learner's steps up to it (one at a time)
    buffer.handle(LEARNER, StartEval(round=5, policy_version=5))
    buffer.handle(LEARNER, EvalResultsRequest(wait_s=30.0))
    assert buffer.replies[LEARNER] == [Ack(accepted=1)]  # held: nothing to say yet
    buffer.handle(b"g", WorkRequest("gen-g", 2))
    first, second = buffer.last(b"g").items
    buffer.handle(b"g", *samples_of(first, "gen-g", reward=1.0))
    assert len(buffer.replies[LEARNER]) == 1  # half a round: still held
    buffer.handle(b"g", *samples_of(second, "gen-g", reward=0.0))
    reply = buffer.last(LEARNER)
    assert isinstance(reply, EvalResults) and reply.running_round == -1
    (results,) = reply.results
    assert (results["eval_round"], results["eval_policy_version"]) == (5.0, 5.0)
    assert results["eval_reward_mean"] == 0.5 and results["eval_samples"] == 2
    assert buffer.held.results is None


def test_results_no_batch_carried_are_handed_over_once(service):
    buffer = service(*EVAL)
    run_round(buffer, 1, reward=0.25)
    buffer.handle(LEARNER, EvalResultsRequest())
    assert [r["eval_round"] for r in buffer.last(LEARNER).results] == [1.0]
    buffer.handle(LEARNER, EvalResultsRequest())
    assert buffer.last(LEARNER) == EvalResults([], running_round=-1)

    buffer.handle(LEARNER, BatchRequest(policy_version=1))  # nor does a batch carry them
    buffer.handle(b"g", WorkRequest("gen-g", 4))
    assert [item.eval_round for item in buffer.last(b"g").items] == [-1, -1]
    for item in buffer.last(b"g").items:
        buffer.handle(b"g", *samples_of(item, "gen-g", version=1))
    batch = buffer.last(LEARNER)
    assert isinstance(batch, Trajectories) and "eval_reward_mean" not in batch.stats


def test_a_held_request_is_answered_at_its_deadline_with_the_round_still_running(service):
    buffer = service(*EVAL)
    buffer.store.set_policy_version(2)  # the learner's steps up to it (one at a time)
    buffer.handle(LEARNER, StartEval(round=2, policy_version=2))
    buffer.handle(LEARNER, EvalResultsRequest(wait_s=0.5))
    assert buffer.held.results is not None
    assert buffer.held.poll_timeout_ms(100_000, time.monotonic()) <= 500  # wakes for it
    asyncio.run(buffer.learner.serve_results(buffer.held.results.deadline))
    assert buffer.last(LEARNER) == EvalResults([], running_round=2)


def test_a_newer_request_answers_the_held_one_first(service):
    buffer = service(*EVAL)
    buffer.store.set_policy_version(2)  # the learner's steps up to it (one at a time)
    buffer.handle(LEARNER, StartEval(round=2, policy_version=2))
    buffer.handle(b"old", EvalResultsRequest(wait_s=30.0))
    buffer.handle(LEARNER, EvalResultsRequest(wait_s=30.0))
    assert buffer.last(b"old") == EvalResults([], running_round=2)
    assert buffer.held.results.identity == LEARNER


def test_a_request_for_results_is_refused_when_the_run_has_no_eval(service):
    buffer = service()
    with pytest.raises(WireError) as caught:
        buffer.handle(LEARNER, EvalResultsRequest())
    assert caught.value.reason == "bad_field"


# --------------------------------------------------------------------- learner


class FakeBuffer:
    """The buffer as the final eval sees it: ``answers`` are its EvalResults, in order."""

    def __init__(self, *answers: EvalResults, accept: bool = True):
        self.answers = list(answers)
        self.accept = accept
        self.started: list[tuple[int, int]] = []
        self.waits: list[float] = []

    def start_eval(self, number: int, policy_version: int) -> bool:
        self.started.append((number, policy_version))
        return self.accept

    def eval_results(self, wait_s, stop):
        self.waits.append(wait_s)
        if not self.answers:
            return None if stop() else EvalResults([], running_round=self.started[-1][0])
        return self.answers.pop(0)


def results(number: int, version: int, reward: float = 0.5) -> dict[str, float]:
    return {
        "eval_round": float(number), "eval_policy_version": float(version),
        "eval_reward_mean": reward, "eval_samples": 8.0, "eval_version_min": math.nan,
    }  # fmt: skip


def final_eval(tmp_path, buffer, *overrides, stop=lambda: False):
    config = load_config(
        None, ["model.tiny={}", "run.total_steps=10", "eval.every_steps=4", *overrides]
    )
    logged: list[tuple[dict, bool]] = []

    def log_eval(values: dict, final: bool) -> dict:
        logged.append((values, final))
        return {"step": 9 + len(logged), "eval_only": True, **values}

    return FinalEval(config, tmp_path / "final", buffer, log_eval, stop), logged


def test_the_final_round_is_numbered_past_every_round_during_training():
    def number(steps: int, every: int) -> int:
        config = load_config(
            None, ["model.tiny={}", f"run.total_steps={steps}", f"eval.every_steps={every}"]
        )
        return final_round(config)

    assert number(10, 5) == 2  # rounds 1 (v5) during training; none at v10
    assert number(12, 5) == 3  # rounds 1 (v5) and 2 (v10)
    assert number(3, 1) == 3


def test_with_no_round_running_the_final_round_starts_at_once_and_is_written(tmp_path):
    buffer = FakeBuffer(EvalResults([]), EvalResults([results(3, 10, 0.75)]))
    evaluation, logged = final_eval(tmp_path, buffer)
    evaluation.begin()
    assert buffer.started == [(3, 10)] and buffer.waits == [0.0]
    line = evaluation.finish()
    assert [(values["eval_round"], final) for values, final in logged] == [(3.0, True)]
    assert line is not None and line["eval_reward_mean"] == 0.75
    written = json.loads((tmp_path / "final" / FINAL_EVAL).read_text())
    assert written == {**line, "eval_version_min": None}  # NaN as null, as in metrics.jsonl


def test_a_round_running_at_the_end_is_logged_then_the_final_round_runs(tmp_path):
    buffer = FakeBuffer(
        EvalResults([], running_round=2),
        EvalResults([results(2, 8, 0.25)]),
        EvalResults([results(3, 10, 0.5)]),
    )
    evaluation, logged = final_eval(tmp_path, buffer)
    evaluation.begin()
    assert buffer.started == []  # rounds never overlap
    line = evaluation.finish()
    assert buffer.started == [(3, 10)]
    assert [(values["eval_round"], final) for values, final in logged] == [
        (2.0, False),
        (3.0, True),
    ]
    assert line["eval_round"] == 3.0


def test_a_round_finished_but_not_carried_is_logged_and_the_final_round_still_runs(tmp_path):
    buffer = FakeBuffer(EvalResults([results(2, 8)]), EvalResults([results(3, 10)]))
    evaluation, logged = final_eval(tmp_path, buffer)
    evaluation.begin()
    assert buffer.started == [(3, 10)]
    assert evaluation.finish() is not None
    assert [final for _, final in logged] == [False, True]


@pytest.mark.parametrize(
    ("why", "stop", "accept", "deadline"),
    [
        ("stopped by a signal", True, True, math.inf),
        ("no result within eval.final_timeout_s=600", False, True, 0.0),
        ("the buffer neither runs round 3 nor has its results", False, False, math.inf),
    ],
    ids=["stop", "timeout", "refused"],
)
def test_a_final_eval_that_cannot_finish_is_skipped_and_says_why(
    tmp_path, why, stop, accept, deadline
):
    buffer = FakeBuffer(EvalResults([]), accept=accept)
    evaluation, logged = final_eval(tmp_path, buffer, stop=lambda: stop)
    evaluation.begin()
    evaluation.deadline = deadline  # 0: past it, whatever the clock says
    assert evaluation.finish() is None
    assert logged == []
    written = json.loads((tmp_path / "final" / FINAL_EVAL).read_text())
    assert written == {"eval_final": True, "skipped": why}


def test_a_buffer_that_does_not_answer_skips_the_final_eval(tmp_path):
    class Silent(FakeBuffer):
        def eval_results(self, wait_s, stop):
            raise TimeoutError("no reply from tcp://127.0.0.1:1 within 30s")

    evaluation, _ = final_eval(tmp_path, Silent())
    evaluation.begin()
    assert evaluation.finish() is None
    skipped = json.loads((tmp_path / "final" / FINAL_EVAL).read_text())["skipped"]
    assert skipped.startswith("the buffer did not answer: no reply")


# --------------------------------------------------------------------- readers


def final_line(step: int = 2, reward: float = 0.875) -> dict:
    return {
        "step": step, "version": 2, "eval_only": True, "eval_final": True,
        "eval_round": 1.0, "eval_policy_version": 2.0, "eval_reward_mean": reward,
        "eval_samples": 64.0, "time_s": 3.0,
    }  # fmt: skip


def test_readers_of_steps_skip_the_eval_only_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("")
    out = io.StringIO()
    plain = PlainConsole(path, 2, out=out)
    config = load_config(None, ["model.tiny.hidden_size=64", "run.total_steps=2"])
    live = LiveConsole(path, config, tmp_path)
    live.live.stop()
    append(path, record(0), record(1), final_line())

    assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1]
    assert read_records(tmp_path)[-1] == final_line()
    plain.update([])
    lines = out.getvalue().splitlines()
    assert [line.split()[1] for line in lines] == ["1/2", "2/2"]  # no line of its own
    assert plain.latest_eval == final_line()
    live.update([])
    assert live.last["step"] == 1 and live.progress.tasks[0].completed == 2
    assert live.latest_eval == final_line()


def test_status_shows_the_final_eval_and_counts_training_steps_only(tmp_path):
    config = load_config(
        None, ["model.tiny.hidden_size=64", "eval.every_steps=1", "run.total_steps=2"]
    )
    save_config(config, tmp_path / "config.yaml")
    append(tmp_path / "metrics.jsonl", record(0), record(1), final_line())
    out = io.StringIO()
    assert show(tmp_path, Console(file=out, width=200)) == 0
    text = out.getvalue()
    assert "step 2/2, version 2" in text
    assert (
        "final eval (the final policy): round 1 of version 2, reward 0.875 over 64 held-out "
        "samples (logged after training)"
    ) in text


def test_the_closing_message_reports_the_final_eval_or_why_there_is_none(tmp_path):
    final = tmp_path / "final"
    assert closing_message(tmp_path, 0, None, 66.2) == f"done in 66.2s; final policy in {final}"
    final.mkdir()
    (final / FINAL_EVAL).write_text(json.dumps(final_line(reward=0.93)))
    assert closing_message(tmp_path, 0, None, 66.2) == (
        f"done in 66.2s; final eval reward 0.930 over 64 held-out samples; final policy in {final}"
    )
    (final / FINAL_EVAL).write_text(json.dumps({"eval_final": True, "skipped": "stopped"}))
    assert "; no final eval (stopped); final policy in" in closing_message(tmp_path, 0, None, 1.0)


def test_a_run_stopped_after_saving_its_final_policy_says_where_it_is(tmp_path):
    final = tmp_path / "final"
    final.mkdir()
    (final / "config.json").write_text("{}")
    assert closing_message(tmp_path, 130, None, 60.0).splitlines() == [
        "asyncrl: stopped",
        f"asyncrl: training had finished; the final policy is in {final}",
    ]
    # a final policy from before this launch says nothing about this one
    assert "cannot be resumed" in closing_message(tmp_path, 130, None, -60.0)
