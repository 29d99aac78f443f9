"""Held-out evaluation in a launched quickstart: the generators run the rounds between
training work, the learner logs their results, no eval prompt is trained on, and the
final policy is evaluated after the last step (``eval.at_end``)."""

from __future__ import annotations

import json
import signal
import time

import pytest
import yaml

from asyncrl.config import config_from_dict, load_config
from asyncrl.generation.tasks import eval_work_items, work_item_factory
from asyncrl.run.launch import stop_timeout_s
from asyncrl.run.status import read_metrics, read_records
from tests.helpers.launches import launch, start
from tests.helpers.run_processes import processes_of

pytestmark = pytest.mark.slow

STEPS, EVERY, PROMPTS, SAMPLES = 201, 25, 64, 2
"""Round 8 starts at version 200, right before the last step: it may report with the
last batch or after training; either way once. The final round, 9, is of version 201."""


def test_eval_rounds_report_once_each_measure_learning_and_never_train(tmp_path):
    run_dir = tmp_path / "run"
    result = launch(
        run_dir, f"run.total_steps={STEPS}", "learner.lr=1e-3", f"eval.every_steps={EVERY}",
        "eval.before_training=true", f"eval.max_prompts={PROMPTS}",
        f"eval.samples_per_prompt={SAMPLES}", "tracking.aim=false",
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    steps = read_metrics(run_dir)
    assert [r["version"] for r in steps] == list(range(1, STEPS + 1))

    records = read_records(run_dir)
    rounds = [r for r in records if r.get("eval_reward_mean") is not None]
    # one round at version 0, every EVERY versions during training, and the final
    # policy's after it: each reported on exactly one line, whole
    during = list(range(0, STEPS, EVERY))
    assert [r["eval_round"] for r in rounds] == list(range(len(during) + 1))
    assert [r["eval_policy_version"] for r in rounds] == [*during, STEPS]
    assert all(r["eval_samples"] == PROMPTS * SAMPLES for r in rounds)
    # generated with the weights of the version it evaluates (or newer, mid-sample)
    assert all(r["eval_version_min"] >= r["eval_policy_version"] for r in rounds)
    assert all(r["eval_version_max"] >= r["eval_version_min"] for r in rounds)
    assert steps[-1]["eval_rounds_skipped_total"] == 0
    first, last = rounds[0]["eval_reward_mean"], rounds[-2]["eval_reward_mean"]
    assert last >= 0.2 and last >= 3 * first, [r["eval_reward_mean"] for r in rounds]

    # the final policy's round: the last line, after every step, written to final/ too
    final = records[-1]
    assert final is rounds[-1] and final["eval_final"] and final["eval_only"]
    assert final["step"] >= STEPS and final["version"] == STEPS
    assert final["eval_round"] == -(-STEPS // EVERY)
    assert final["eval_reward_mean"] >= 3 * first
    assert json.loads((run_dir / "final" / "eval.json").read_text()) == final
    assert [r for r in records if r.get("eval_final")] == [final]
    assert f"final eval reward {final['eval_reward_mean']:.3f} over {PROMPTS * SAMPLES}" in (
        result.stdout + result.stderr
    )

    # no eval prompt among the trained groups, by id and by prompt
    config = config_from_dict(yaml.safe_load((run_dir / "config.yaml").read_text()))
    trained = [
        group
        for line in (run_dir / "trained_groups.jsonl").read_text().splitlines()
        for group in json.loads(line)["group_ids"]
    ]
    assert trained and min(trained) >= 0
    held_out = {tuple(item.prompt_ids) for item in eval_work_items(config)}
    assert len(held_out) == PROMPTS
    make_item = work_item_factory(config)
    assert not [g for g in trained if tuple(make_item(g).prompt_ids) in held_out]

    # the plain console line carries the latest eval reward; the final one gets no line
    reported = [r for r in steps if r.get("eval_reward_mean") is not None][-1]
    step = reported["step"] + 1
    line = next(x for x in result.stdout.splitlines() if x.startswith(f"step {step:>4}/"))
    assert line.endswith(
        f"eval {reported['eval_reward_mean']:.3f} @v{reported['eval_policy_version']:.0f}"
    )
    assert sum(x.startswith("step ") for x in result.stdout.splitlines()) == STEPS
    assert processes_of(run_dir) == [], "the launcher left processes behind"


def test_with_eval_off_nothing_is_evaluated_at_the_end(tmp_path):
    run_dir = tmp_path / "run"
    result = launch(run_dir, "run.total_steps=8", "tracking.aim=false")
    assert result.returncode == 0, result.stdout + result.stderr
    records = read_records(run_dir)
    assert [r["step"] for r in records] == list(range(8))
    assert not [key for r in records for key in r if key.startswith("eval_")]
    assert not (run_dir / "final" / "eval.json").exists()
    closing = (result.stdout + result.stderr).splitlines()[-1]
    assert closing.startswith("done in ") and "final eval" not in closing
    assert processes_of(run_dir) == []


def test_a_stop_during_the_final_wait_skips_the_final_eval_and_stops_in_time(tmp_path):
    # a final round of 500 x 64 samples: seconds of generation, time enough to stop in
    run = start(
        tmp_path, "run.total_steps=3", "eval.every_steps=1000", "eval.max_prompts=500",
        "eval.samples_per_prompt=64",
    )  # fmt: skip
    learner_log = run.run_dir / "logs" / "learner.log"
    try:
        deadline = time.monotonic() + 120
        while "final eval: round 1 of version 3 started" not in _text(learner_log):
            assert run.process.poll() is None, run.stderr()
            assert time.monotonic() < deadline, "the final round did not start"
            time.sleep(0.1)
        run.process.send_signal(signal.SIGINT)
        limit_s = stop_timeout_s(load_config(run.run_dir / "config.yaml")) + 5
        assert run.wait(timeout_s=limit_s) == 130, run.stderr()
    finally:
        run.kill()

    # the learner stopped waiting by itself (a killed one would not have said so)
    assert "final eval of version 3 skipped: stopped by a signal" in _text(learner_log)
    final = run.run_dir / "final"
    assert (final / "config.json").exists()  # saved before the wait
    assert json.loads((final / "eval.json").read_text()) == {
        "eval_final": True,
        "skipped": "stopped by a signal",
    }
    assert not [r for r in read_records(run.run_dir) if r.get("eval_only")]
    assert f"training had finished; the final policy is in {final}" in run.stderr()
    assert processes_of(run.run_dir) == []


def _text(path) -> str:
    return path.read_text() if path.exists() else ""
