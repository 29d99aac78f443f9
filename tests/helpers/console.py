"""Metrics records as a run writes them, for the console's tests."""

from __future__ import annotations

import json

RECORD = {
    "step": 9, "version": 10, "reward_mean": 0.5, "staleness_mean": 0.75, "staleness_max": 1,
    "samples_per_s": 123.4, "learner_wait_frac": 0.25, "buffer_held": 128.0,
}  # fmt: skip


def record(step: int, eval_reward: float | None = None) -> dict:
    line = {
        "step": step, "version": step + 1, "reward_mean": 0.5, "staleness_mean": 1.0,
        "staleness_max": 1, "samples_per_s": 100.0, "learner_wait_frac": 0.25,
        "buffer_held": 0.0, "eval_rounds_skipped_total": 0.0,
    }  # fmt: skip
    if eval_reward is not None:
        line |= {
            "eval_round": 2.0, "eval_policy_version": 10.0, "eval_reward_mean": eval_reward,
            "eval_samples": 64.0,
        }  # fmt: skip
    return line


def append(path, *records: dict) -> None:
    with path.open("a") as file:
        file.writelines(json.dumps(r) + "\n" for r in records)
