"""benchmarks/learning_curve.py reads eval rounds from metrics.jsonl records."""

from __future__ import annotations

import json

import pytest

from tests.helpers.scripts import benchmark

learning_curve = benchmark("learning_curve")
beside_runs, eval_rounds = learning_curve.beside_runs, learning_curve.eval_rounds
summarise = learning_curve.summarise


def _step(step, reward=None, version=None, samples=0):
    record = {"step": step, "time_s": 60.0 * (step + 1), "samples_total": samples}
    if reward is not None:
        record |= {"eval_reward_mean": reward, "eval_policy_version": version, "eval_samples": 8}
    return record


RECORDS = [
    _step(0, samples=32),
    _step(1, 0.10, 0, samples=64),
    _step(2, samples=96),
    _step(3, 0.20, 2, samples=128),
    _step(4, 0.30, 4, samples=160),
    {"step": 5, "time_s": 400.0, "eval_only": True, "eval_final": True}
    | {"eval_reward_mean": 0.28, "eval_policy_version": 5, "eval_samples": 8},
]


def test_rounds_carry_their_version_time_and_the_samples_trained_by_then():
    rounds = eval_rounds(RECORDS)
    assert [r["version"] for r in rounds] == [0, 2, 4, 5]
    assert [r["trained_samples"] for r in rounds] == [64, 128, 160, 160]  # eval-only: last count
    assert rounds[-1]["final"] and not rounds[0]["final"]
    assert rounds[1]["minutes"] == pytest.approx(4.0)


def test_summary_names_first_best_and_the_first_round_that_rose_enough():
    summary = summarise(eval_rounds(RECORDS), rise=0.15)
    assert summary["first"]["reward"] == 0.10
    assert summary["best"]["version"] == 4
    assert summary["rise"] == pytest.approx(0.20)
    assert summary["first_round_up_0.15"]["version"] == 4  # 0.20 is only +0.10


def test_a_run_without_eval_is_an_error():
    with pytest.raises(ValueError, match="no eval round"):
        summarise(eval_rounds([_step(0), _step(1)]), rise=0.15)


def test_another_run_beside_is_read_from_its_summary_and_a_bad_spec_is_named(tmp_path):
    summary = tmp_path / "full.json"
    summary.write_text(json.dumps(summarise(eval_rounds(RECORDS), rise=0.15)))
    beside = beside_runs([f"full fine-tuning={summary}"])
    assert [r["version"] for r in beside["full fine-tuning"]] == [0, 2, 4, 5]
    with pytest.raises(SystemExit, match="LABEL=PATH"):
        beside_runs([str(summary)])
