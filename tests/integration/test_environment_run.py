"""A launched run with a multi-turn environment: episodes of several turns reach the
learner, with the environment's reward and its counters in the metrics."""

from __future__ import annotations

import pytest

from asyncrl.run.status import read_metrics
from tests.helpers.launches import REPO, launch
from tests.helpers.run_processes import processes_of

pytestmark = pytest.mark.slow


def test_multi_turn_episodes_train_end_to_end(tmp_path):
    """Some first steps hang past environment.step_timeout_s (prompts starting with 0);
    every final answer is also scored by a named reward function, in the reward workers."""
    run_dir = tmp_path / "run"
    env = REPO / "tests/helpers/generators.py"
    result = launch(
        run_dir, "run.total_steps=3", "tracking.aim=false",
        f"environment.name={env}:FlakyCountdownEnv", "environment.formatter=plain",
        "environment.max_turns=3", "environment.max_total_tokens=100",
        "environment.step_timeout_s=0.5", 'environment.kwargs.hang_prefix="0"',
        "environment.kwargs.hang_s=1.5",
        "environment.kwargs.score_with=asyncrl.generation.tasks:digits_score",
        "generators.max_new_tokens=6", 'generators.stop=["5"]',
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    records = read_metrics(run_dir)
    assert [r["version"] for r in records] == [1, 2, 3]
    last = records[-1]
    # turns end at the stop string or the 6-token turn limit; some episodes go on
    episodes = last["generators_env_episodes_total"]
    assert episodes >= 3 * 256
    assert last["generators_env_turns_total"] > episodes
    assert last["generators_env_tool_calls_total"] > 0
    # a tenth of the prompts start with 0: their episodes time out, scored 0 and counted
    assert last["generators_env_env_timeouts_total"] > 0
    assert last["generators_env_steps_abandoned_total"] > 0
    assert last["buffer_reward_errors"] > 0
    assert last["generators_env_rewards_requested_total"] > 0
    # the turns it saw (cut episodes get 0) plus digits_score of the last answer (<= 1)
    assert 0 < max(r["reward_mean"] for r in records) <= 4
    assert not processes_of(run_dir)
