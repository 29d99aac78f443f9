"""Held-out evaluation in a launched quickstart: the generators run the rounds between
training work, the learner logs their results, and no eval prompt is trained on."""

from __future__ import annotations

import json

import pytest
import yaml
from test_launch_end_to_end import launch, processes_of

from asyncrl.config import config_from_dict
from asyncrl.status import read_metrics
from asyncrl.tasks import eval_work_items, work_item_factory

pytestmark = pytest.mark.slow

STEPS, EVERY, PROMPTS, SAMPLES = 200, 25, 64, 2


def test_eval_rounds_report_once_each_measure_learning_and_never_train(tmp_path):
    run_dir = tmp_path / "run"
    result = launch(
        run_dir, f"run.total_steps={STEPS}", "learner.lr=1e-3", f"eval.every_steps={EVERY}",
        "eval.before_training=true", f"eval.max_prompts={PROMPTS}",
        f"eval.samples_per_prompt={SAMPLES}", "tracking.aim=false",
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    records = read_metrics(run_dir)
    assert [r["version"] for r in records] == list(range(1, STEPS + 1))

    rounds = [r for r in records if r.get("eval_reward_mean") is not None]
    # one round at version 0 and every EVERY versions up to the last (none at STEPS),
    # each reported at exactly one step, whole
    assert [r["eval_round"] for r in rounds] == list(range(STEPS // EVERY))
    assert [r["eval_policy_version"] for r in rounds] == list(range(0, STEPS, EVERY))
    assert all(r["eval_samples"] == PROMPTS * SAMPLES for r in rounds)
    # generated with the weights of the version it evaluates (or newer, mid-sample)
    assert all(r["eval_version_min"] >= r["eval_policy_version"] for r in rounds)
    assert all(r["eval_version_max"] >= r["eval_version_min"] for r in rounds)
    assert records[-1]["eval_rounds_skipped_total"] == 0
    first, last = rounds[0]["eval_reward_mean"], rounds[-1]["eval_reward_mean"]
    assert last >= 0.2 and last >= 3 * first, [r["eval_reward_mean"] for r in rounds]

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

    # the plain console line carries the latest eval reward
    last_step = next(line for line in result.stdout.splitlines() if line.startswith("step  200"))
    assert last_step.endswith(f"eval {last:.3f} @v{STEPS - EVERY}")
    assert processes_of(run_dir) == [], "the launcher left processes behind"
