"""What a replica tells the buffer about its episodes: each sample's counts (turns, tool
calls, tool errors) and the seconds its environments took (``env_tool_s``)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import msgspec
import pytest

from asyncrl.config.environment import EnvironmentConfig
from asyncrl.core.messages import MAX_EPISODE_COUNT, EpisodeCounts
from asyncrl.generation.envs.threads import StepPool
from asyncrl.generation.tasks import build_tokenizer
from asyncrl.generators.episode_failures import ERROR_ENVIRONMENT
from asyncrl.generators.episodes import Episodes, episode_counts
from tests.helpers.generators import (
    CountdownEnv,
    ScriptedBackend,
    drive,
    item,
    make_episodes,
    run_replica,
    said,
)

STEP_S = 0.05


@pytest.fixture
def tokenizer():
    return build_tokenizer()


class SlowCountdownEnv(CountdownEnv):
    """A CountdownEnv whose every step takes at least ``STEP_S``: a slow tool."""

    def step(self, response):
        time.sleep(STEP_S)
        return super().step(response)


def test_a_finished_episode_s_rollout_carries_its_counts(tokenizer):
    episodes = make_episodes(tokenizer, turns=3)
    rollouts = [episodes.start(item(), index, now=0.0) for index in range(2)]
    finished = drive(episodes, ScriptedBackend(tokenizer), rollouts, chunk=8)
    assert [r.episode for r, _ in finished] == [EpisodeCounts(3, 2, 0)] * 2
    episodes.close()


def test_an_episode_that_failed_after_a_turn_keeps_its_counts(tokenizer):
    episodes = make_episodes(tokenizer, turns=3, fail_on=2)  # the second step raises
    [(rollout, score)] = drive(
        episodes, ScriptedBackend(tokenizer), [episodes.start(item(), 0, now=0.0)], chunk=8
    )
    assert score.error == ERROR_ENVIRONMENT
    assert rollout.episode == EpisodeCounts(turns=2, tool_calls=1, tool_errors=0)
    episodes.close()


def test_an_episode_that_never_took_a_turn_sends_no_counts(tokenizer):
    episodes = make_episodes(tokenizer)
    rollout = episodes.start(said("123=", 4, samples=1), 0, now=0.0)
    episodes.make_environment = lambda: 1 / 0  # no runner: its reset raised
    [(done, score)] = drive(episodes, ScriptedBackend(tokenizer), [rollout], chunk=8)
    assert score.error == ERROR_ENVIRONMENT and done.episode is None
    episodes.close()
    assert episode_counts(SimpleNamespace(num_turns=0, tool_calls=0, tool_errors=0)) is None


def test_an_environment_s_odd_counts_are_clamped_to_what_the_buffer_accepts():
    def runner(turns, calls, errors):
        return SimpleNamespace(num_turns=turns, tool_calls=calls, tool_errors=errors)

    assert episode_counts(runner(2, 1, 3)) == EpisodeCounts(2, 1, 1)
    assert episode_counts(runner(2, -4, -1)) == EpisodeCounts(2, 0, 0)
    huge = MAX_EPISODE_COUNT * 8
    assert episode_counts(runner(huge, huge, 0)) == EpisodeCounts(
        MAX_EPISODE_COUNT, MAX_EPISODE_COUNT, 0
    )


@pytest.mark.parametrize("multi_turn", [True, False], ids=["multi-turn", "one turn"])
def test_the_replica_sends_each_sample_s_counts_and_none_for_a_single_turn(multi_turn):
    environment = [
        "environment.name=tests.helpers.generators:CountdownEnv",
        "environment.formatter=plain",
        "environment.kwargs={turns: 2}",
    ]
    samples = run_replica(*(environment if multi_turn else []))
    assert len(samples) == 4
    expected = EpisodeCounts(2, 1, 0) if multi_turn else msgspec.UNSET
    assert [meta.episode for meta in samples] == [expected] * 4


def test_time_in_environment_calls_is_counted(tokenizer):
    config = EnvironmentConfig(
        name=f"{__name__}:SlowCountdownEnv", formatter="plain", kwargs={"turns": 3}
    )
    episodes = Episodes(config, tokenizer, max_tokens_per_turn=16)
    assert episodes.collect() == ([], []) and episodes.stats["tool_s"] == 0.0
    rollouts = [episodes.start(item(), index, now=0.0) for index in range(2)]
    drive(episodes, ScriptedBackend(tokenizer), rollouts, chunk=8)
    assert episodes.stats["turns"] == 6
    assert episodes.stats["tool_s"] >= 6 * STEP_S  # six steps, each sleeping STEP_S
    episodes.close()


def test_a_pool_counts_its_calls_time_before_their_results_are_seen():
    pool = StepPool(2, name="test-busy")
    try:
        slow = [pool.submit(time.sleep, STEP_S) for _ in range(3)]
        for job in slow:
            job.future.result(timeout=30)
        assert pool.busy_s >= 3 * STEP_S

        def fails():
            time.sleep(STEP_S)
            raise ValueError("a tool broke")

        before = pool.busy_s
        failed = pool.submit(fails)
        assert isinstance(failed.future.exception(timeout=30), ValueError)
        assert pool.busy_s - before >= STEP_S  # a call that raised took its time too
    finally:
        pool.close()
