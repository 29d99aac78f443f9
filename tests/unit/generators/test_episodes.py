"""Multi-turn episodes inside a replica (asyncrl.generators.episodes): the backend's
turns and the environment's replies build one token sequence, across weight loads."""

from __future__ import annotations

import logging
import threading

import pytest
import torch

from asyncrl.config import GeneratorsConfig, load_config
from asyncrl.config.environment import EnvironmentConfig
from asyncrl.core.messages import WorkItem
from asyncrl.generation.envs import Environment, ScoreRequest, StepResult
from asyncrl.generation.envs.formatting import PlainTextFormatter
from asyncrl.generation.models import build_policy
from asyncrl.generation.rewards import ERROR_EXCEPTION, ERROR_TIMEOUT, RewardScorer, Score
from asyncrl.generation.tasks import build_tokenizer
from asyncrl.generators.episode_failures import (
    ERROR_ENVIRONMENT,
    ERROR_ENVIRONMENT_TIMEOUT,
    ERROR_PROMPT_TOO_LONG,
)
from asyncrl.generators.episodes import Episodes
from asyncrl.generators.hf_backend import HFBackend
from tests.helpers.generators import (
    CountdownEnv,
    ScriptedBackend,
    drive,
    item,
    make_episodes,
    said,
)
from tests.helpers.waiting import wait_until as wait_for


@pytest.fixture
def tokenizer():
    return build_tokenizer()


def test_turns_and_replies_make_one_sequence_with_versions_switching_at_chunks(tokenizer):
    episodes = make_episodes(tokenizer, turns=3)
    backend = ScriptedBackend(tokenizer, turn_length=5)
    rollouts = [episodes.start(item(), index, now=0.0) for index in range(2)]
    # not the backend's until the environment has been reset, on the pool
    assert all(r.finished and episodes.owns(r) for r in rollouts)
    prompt = tokenizer.encode("user: 123=\nassistant: ", add_special_tokens=False)

    def publish():  # a new weight version before every chunk
        backend.version += 1

    finished = drive(episodes, backend, rollouts, chunk=4, on_chunk=publish)
    assert {id(r) for r, _ in finished} == {id(r) for r in rollouts}
    for rollout, score in finished:
        assert score.reward == 3.0 and score.error is None
        assert rollout.finish_reason == "stop"
        assert rollout.prompt_ids == prompt  # the prefix never changed
        n = len(rollout.response_ids)
        assert len(rollout.logprobs) == len(rollout.token_versions) == len(rollout.loss_mask) == n
        model = [i for i in range(n) if rollout.loss_mask[i]]
        env = [i for i in range(n) if not rollout.loss_mask[i]]
        assert len(model) == 3 * 6  # three turns of 5 tokens and EOS
        assert env and all(rollout.token_versions[i] == -1 for i in env)
        assert all(rollout.logprobs[i] == 0.0 for i in env)
        assert all(rollout.logprobs[i] == -0.5 for i in model)
        # versions rise chunk by chunk, even across turns: a chunk is 4 model tokens
        versions = [rollout.token_versions[i] for i in model]
        assert versions == sorted(versions) and versions[0] >= 1
        assert len(set(versions)) > 3
        # the environment's replies are exactly its text, rendered and tokenized
        reply = PlainTextFormatter().render_reply([{"role": "tool", "content": "99"}], "1")
        expected = tokenizer.encode(reply, add_special_tokens=False)
        assert [rollout.response_ids[i] for i in env] == expected * 2
    assert episodes.stats["episodes"] == 2 and episodes.stats["turns"] == 6
    assert episodes.stats["tool_calls"] == 4 and episodes.stats["finish_stop"] == 2
    assert not episodes.running and not episodes.waiting  # nothing left behind
    episodes.close()


def test_total_token_limit_ends_the_episode_as_length(tokenizer):
    episodes = make_episodes(tokenizer, turns=10, max_total_tokens=40)
    backend = ScriptedBackend(tokenizer, turn_length=5)
    rollouts = [episodes.start(item(samples=1), 0, now=0.0)]
    [(rollout, score)] = drive(episodes, backend, rollouts, chunk=3)
    assert rollout.finish_reason == "length"
    assert len(rollout.prompt_ids) + len(rollout.response_ids) <= 40
    assert score.reward == 0.0 and score.error is None
    assert episodes.stats["finish_length"] == 1
    episodes.close()


def test_a_raising_environment_scores_zero_with_an_error_tag(tokenizer):
    episodes = make_episodes(tokenizer, turns=3, fail_on=2)
    backend = ScriptedBackend(tokenizer, turn_length=2)
    [(rollout, score)] = drive(episodes, backend, [episodes.start(item(), 0, now=0.0)], chunk=8)
    assert score.reward == 0.0 and score.error == ERROR_ENVIRONMENT
    assert rollout.finished and episodes.stats["env_errors"] == 1
    assert sum(rollout.loss_mask) == 2 * 3  # both turns' tokens are kept
    episodes.close()


def test_real_hf_backend_multi_turn_keeps_the_prefix_and_masks():
    """The tiny random model through the HF engine: turns end at a stop string (a digit
    it emits often) or at the per-turn limit; either way the invariants hold."""
    config = load_config(None, ["model.tiny.hidden_size=32", "model.tiny.num_heads=2"])
    model, tokenizer = build_policy(config.model, seed=0)
    torch.manual_seed(0)
    sampling = GeneratorsConfig(max_new_tokens=12, stop=["<end>", "5", "7"])
    backend = HFBackend(model, tokenizer, sampling)
    episodes = Episodes(
        EnvironmentConfig(name=f"{__name__}:CountdownEnv", formatter="plain"),
        tokenizer,
        max_tokens_per_turn=12,
    )
    rollouts = [episodes.start(item(samples=8), index, now=0.0) for index in range(8)]
    finished = drive(episodes, backend, rollouts, chunk=4)
    assert len(finished) == 8
    prompt = finished[0][0].prompt_ids
    turns_seen = []
    for rollout, score in finished:
        assert rollout.prompt_ids == prompt
        model_tokens = sum(rollout.loss_mask)
        turns = score.reward if rollout.finish_reason == "stop" else None
        turns_seen.append(turns)
        pairs = list(zip(rollout.token_versions, rollout.loss_mask, strict=True))
        assert all(version == (0 if model else -1) for version, model in pairs)
        assert 0 < model_tokens <= 12 * 3
    # with this seed some episodes ran all three turns and some were cut at a turn limit
    assert 3.0 in turns_seen
    assert episodes.stats["turns"] > 8
    episodes.close()


# ---------------------------------------------------------------- what can go wrong

RELEASE = threading.Event()
"""Lets the stuck environments of a test go, so their abandoned threads end."""


class StallingEnv(CountdownEnv):
    """A CountdownEnv whose reset or first step hangs when the prompt says so."""

    def reset(self, row):
        if row["prompt"][0]["content"] == "hang at reset":
            RELEASE.wait(30)
        self.hang = row["prompt"][0]["content"] == "hang"
        return super().reset(row)

    def step(self, response):
        if self.hang:
            RELEASE.wait(30)
        return super().step(response)


@pytest.fixture
def release():
    RELEASE.clear()
    yield RELEASE
    RELEASE.set()


def test_a_stuck_step_or_reset_times_out_and_the_other_episodes_finish(tokenizer, release):
    """One worker thread: every hung call takes it, so the others only finish because
    each abandoned thread is replaced."""
    config = EnvironmentConfig(
        name=f"{__name__}:StallingEnv", formatter="plain", workers=1, step_timeout_s=0.2
    )
    episodes = Episodes(config, tokenizer, max_tokens_per_turn=16)
    backend = ScriptedBackend(tokenizer, turn_length=2)
    items = [said("hang", 1), said("123=", 2), said("hang at reset", 3, samples=1)]
    rollouts = [episodes.start(it, i, now=0.0) for it in items for i in range(it.num_samples)]
    finished = drive(episodes, backend, rollouts, chunk=8)
    assert len(finished) == 5
    scores = {(r.group_id, r.sample_index): score for r, score in finished}
    for key in [(1, 0), (1, 1), (3, 0)]:
        assert scores[key].reward == 0.0 and scores[key].error == ERROR_ENVIRONMENT_TIMEOUT
        assert "environment.step_timeout_s=0.2" in scores[key].detail
    assert scores[(2, 0)] == scores[(2, 1)] == Score(3.0, None)
    never_started = next(r for r, _ in finished if r.group_id == 3)
    assert never_started.prompt_ids == [1, 2, 3] and never_started.response_ids == []
    assert episodes.stats["env_timeouts"] == 3 and episodes.stats["steps_abandoned"] == 3
    assert episodes.stats["stuck_threads"] == 3 and episodes.stats["finish_error"] == 3
    assert episodes.stats["finish_stop"] == 2
    assert not episodes.running and not episodes.waiting
    release.set()  # the stuck calls return: their threads end, their results are dropped
    wait_for(lambda: episodes.pool.stuck == 0)
    assert episodes.collect() == ([], [])
    episodes.close()


def test_with_every_thread_stuck_episodes_still_end(tokenizer, release, monkeypatch):
    """No thread may replace a stuck one: steps that cannot start fail at once, so the
    replica keeps ending episodes instead of waiting for ever."""
    monkeypatch.setattr("asyncrl.generators.episodes.MAX_STUCK_THREADS", 0)
    config = EnvironmentConfig(
        name=f"{__name__}:StallingEnv", formatter="plain", workers=1, step_timeout_s=0.2
    )
    episodes = Episodes(config, tokenizer, max_tokens_per_turn=16)
    backend = ScriptedBackend(tokenizer, turn_length=2)
    rollouts = [episodes.start(said("hang", 1, samples=3), i, now=0.0) for i in range(3)]
    finished = drive(episodes, backend, rollouts, chunk=8)
    assert [score.error for _, score in finished] == [ERROR_ENVIRONMENT_TIMEOUT] * 3
    assert episodes.pool.stalled
    assert episodes.stats["env_timeouts"] == 3 and episodes.stats["steps_abandoned"] == 1
    assert sum("could not start" in score.detail for _, score in finished) == 2
    release.set()
    wait_for(lambda: not episodes.pool.stalled)
    episodes.close()


def test_a_raising_reset_scores_zero_with_an_error_tag(tokenizer):
    episodes = make_episodes(tokenizer)
    rollout = episodes.start(said("123=", 4, samples=1), 0, now=0.0)
    episodes.make_environment = lambda: 1 / 0  # as if the constructor or reset raised
    [(done, score)] = drive(episodes, ScriptedBackend(tokenizer), [rollout], chunk=8)
    assert done is rollout and score.error == ERROR_ENVIRONMENT and score.reward == 0.0
    assert "ZeroDivisionError" in score.detail and rollout.prompt_ids == [1, 2, 3]
    assert episodes.stats["env_errors"] == 1
    episodes.close()


class AskTheScorerEnv(Environment):
    """Pays 0.25 for the first turn, then has the named reward function score the second."""

    def __init__(self, function: str):
        self.function = function

    def reset(self, row):
        self.row, self.taken = row, 0
        return list(row["prompt"])

    def step(self, response):
        self.taken += 1
        if self.taken == 1:
            return StepResult([{"role": "user", "content": "and?"}], reward=0.25)
        row = self.row
        request = ScoreRequest(
            self.function, response, row["data_source"], row["reward_model"]["ground_truth"]
        )
        return StepResult(done=True, score_request=request)


REWARDS = """
import time

def score(data_source, solution_str, ground_truth, extra_info=None):
    if ground_truth == "hang":
        time.sleep(120)
    if ground_truth == "raise":
        raise ValueError("no answer here")
    return {"score": 0.5}
"""


def test_named_reward_functions_are_scored_by_the_replicas_reward_workers(tokenizer, tmp_path):
    """The final answer goes to the RewardScorer: a reward function that hangs or
    raises scores its episode 0 with the scorer's tag, the others are unaffected."""
    (tmp_path / "rewards.py").write_text(REWARDS)
    function = f"{tmp_path / 'rewards.py'}:score"
    config = EnvironmentConfig(
        name=f"{__name__}:AskTheScorerEnv", formatter="plain", kwargs={"function": function}
    )
    with RewardScorer(None, timeout_s=2.0, workers=1) as scorer:
        episodes = Episodes(config, tokenizer, max_tokens_per_turn=16, scorer=scorer)
        backend = ScriptedBackend(tokenizer, turn_length=2)
        items = [
            WorkItem(group, 2, [1], truth, "d", {}, [{"role": "user", "content": "1="}])
            for group, truth in enumerate(["hang", "ok", "raise"])
        ]
        rollouts = [episodes.start(it, i, now=0.0) for it in items for i in range(2)]
        finished = drive(episodes, backend, rollouts, chunk=8)
        by_truth = {truth: [] for truth in ["hang", "ok", "raise"]}
        for rollout, score in finished:
            by_truth[rollout.ground_truth].append(score)
            assert rollout.finish_reason == "stop" and sum(rollout.loss_mask) == 2 * 3
        assert by_truth["ok"] == [Score(0.75, None)] * 2  # 0.25 on the way, 0.5 at the end
        assert [s.error for s in by_truth["hang"]] == [ERROR_TIMEOUT] * 2
        assert [s.error for s in by_truth["raise"]] == [ERROR_EXCEPTION] * 2
        assert all(s.reward == 0.0 for s in by_truth["hang"] + by_truth["raise"])
        assert "no answer here" in by_truth["raise"][0].detail
        assert scorer.counters[ERROR_TIMEOUT] == 2 and scorer.counters[ERROR_EXCEPTION] == 2
        assert scorer.counters["scored"] == 2
        assert episodes.stats["rewards_requested"] == 6 and episodes.stats["finish_stop"] == 6
        episodes.close()


def test_without_a_scorer_the_named_function_runs_in_the_environments_thread(tokenizer, tmp_path):
    (tmp_path / "rewards.py").write_text(REWARDS)
    config = EnvironmentConfig(
        name=f"{__name__}:AskTheScorerEnv",
        formatter="plain",
        kwargs={"function": f"{tmp_path / 'rewards.py'}:score"},
    )
    episodes = Episodes(config, tokenizer, max_tokens_per_turn=16)
    rollouts = [episodes.start(said("1=", 0, samples=1), 0, now=0.0)]
    [(_, score)] = drive(episodes, ScriptedBackend(tokenizer, turn_length=2), rollouts, chunk=8)
    assert score == Score(0.75, None) and "rewards_requested" not in episodes.stats
    episodes.close()


def test_a_prompt_longer_than_max_prompt_tokens_ends_before_its_first_turn(tokenizer, caplog):
    """The tool listing is part of the prompt: the row alone would fit."""
    config = EnvironmentConfig(name="tools", tools=["calculator"], formatter="plain")
    row = said("123=", 5, samples=1)
    fits = Episodes(config, tokenizer, max_tokens_per_turn=16, max_prompt_tokens=2000)
    fits.start(row, 0, now=0.0)
    wait_for(lambda: fits.stepping[0].job.done)
    [rollout], [] = fits.collect()
    assert len(rollout.prompt_ids) > 100 and not rollout.finished  # the listing is in it
    fits.close()

    limit = len(rollout.prompt_ids) - 1
    episodes = Episodes(config, tokenizer, max_tokens_per_turn=16, max_prompt_tokens=limit)
    started = episodes.start(row, 0, now=0.0)
    with caplog.at_level(logging.WARNING, logger="asyncrl.episodes"):
        [(done, score)] = drive(episodes, ScriptedBackend(tokenizer), [started], chunk=8)
    assert done is started and score.error == ERROR_PROMPT_TOO_LONG and score.reward == 0.0
    assert done.finish_reason == "length" and done.response_ids == []
    assert done.prompt_ids == [1, 2, 3]  # the row's own prompt goes out, not the long one
    assert episodes.stats["prompt_too_long"] == 1 and episodes.stats["turns"] == 0
    assert f"data.max_prompt_tokens={limit}" in caplog.text
    episodes.close()
