"""Multi-turn episodes inside a replica (asyncrl.generators.episodes): the backend's
turns and the environment's replies build one token sequence, across weight loads."""

from __future__ import annotations

import time

import pytest
import torch

from asyncrl.config import GeneratorsConfig, load_config
from asyncrl.envs import Environment, StepResult
from asyncrl.envs.config import EnvironmentConfig
from asyncrl.envs.formatting import PlainTextFormatter
from asyncrl.generators.backend import Rollout, StopStrings, append_tokens
from asyncrl.generators.episodes import ERROR_ENVIRONMENT, Episodes
from asyncrl.generators.hf_backend import HFBackend
from asyncrl.messages import WorkItem
from asyncrl.models import build_policy
from asyncrl.tasks import build_tokenizer


class CountdownEnv(Environment):
    """Answers ``turns - 1`` model turns with a digit reply, then ends; reward = turns taken."""

    def __init__(self, turns: int = 3, fail_on: int = 0):
        self.turns, self.fail_on = turns, fail_on

    def reset(self, row):
        self.taken = 0
        self.seen: list[str] = []
        return list(row["prompt"])

    def step(self, response):
        self.taken += 1
        self.seen.append(response)
        if self.taken == self.fail_on:
            raise RuntimeError("the environment broke")
        if self.taken >= self.turns:
            return StepResult(done=True, reward=float(self.taken))
        return StepResult([{"role": "tool", "content": "99"}], tool_calls=1)


class ScriptedBackend:
    """A scripted model: each turn is ``turn_length`` tokens of "1" then EOS."""

    def __init__(self, tokenizer, turn_length: int = 5, max_new_tokens: int = 64):
        self.tokenizer = tokenizer
        self.version = 0
        self.last_load_s = 0.0
        self.turn_length = turn_length
        self.max_new_tokens = max_new_tokens
        self.one = tokenizer.convert_tokens_to_ids("1")

    def generate_chunk(self, rollouts, max_tokens):
        for rollout in rollouts:
            if rollout.finished:
                continue
            run = 0  # tokens of the current model turn so far
            for mask in reversed(rollout.loss_mask):
                if not mask:
                    break
                run += 1
            tokens = [self.one] * max(0, self.turn_length - run) + [self.tokenizer.eos_token_id]
            tokens = tokens[:max_tokens]
            append_tokens(
                rollout,
                tokens,
                [-0.5] * len(tokens),
                self.version,
                eos_token_id=self.tokenizer.eos_token_id,
                max_new_tokens=self.max_new_tokens,
                stop=StopStrings(self.tokenizer, []),
            )


def item(group_id=7, samples=2):
    messages = [{"role": "user", "content": "123="}]
    return WorkItem(group_id, samples, [1, 4, 5, 6, 13], "234", "synthetic/digits", {}, messages)


def drive(episodes: Episodes, backend, rollouts: list[Rollout], chunk: int, on_chunk=None):
    """The replica's loop, reduced to generation and episodes: returns finished pairs."""
    active, finished = list(rollouts), []
    for _ in range(500):
        if on_chunk is not None:
            on_chunk()
        backend.generate_chunk(active, chunk)
        for rollout in [r for r in active if r.finished]:
            episodes.end_turn(rollout)
        active = [r for r in active if not r.finished]
        deadline = time.monotonic() + 5
        while episodes.waiting and not active and time.monotonic() < deadline:
            continuing, done = episodes.collect()
            active += continuing
            finished += done
            time.sleep(0.001)
        continuing, done = episodes.collect()
        active += continuing
        finished += done
        if not active and not episodes.waiting:
            return finished
    raise AssertionError("episodes never finished")


@pytest.fixture
def tokenizer():
    return build_tokenizer()


def make_episodes(tokenizer, turns=3, fail_on=0, **overrides):
    config = EnvironmentConfig(
        name=f"{__name__}:CountdownEnv",
        formatter="plain",
        kwargs={"turns": turns, "fail_on": fail_on},
        **overrides,
    )
    return Episodes(config, tokenizer, max_tokens_per_turn=16)


def test_turns_and_replies_make_one_sequence_with_versions_switching_at_chunks(tokenizer):
    episodes = make_episodes(tokenizer, turns=3)
    backend = ScriptedBackend(tokenizer, turn_length=5)
    rollouts = [episodes.start(item(), index, now=0.0) for index in range(2)]
    prompt = list(rollouts[0].prompt_ids)
    assert prompt == tokenizer.encode("user: 123=\nassistant: ", add_special_tokens=False)

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
    assert not episodes.turns  # nothing left behind
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
    prompt = list(rollouts[0].prompt_ids)
    finished = drive(episodes, backend, rollouts, chunk=4)
    assert len(finished) == 8
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
