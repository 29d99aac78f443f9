"""Doubles for the generator's tests: a scripted model backend, a countdown environment,
a scripted buffer and the replica run against them, and rollouts and backends to build.
"""

from __future__ import annotations

import time

import torch
import zmq

from asyncrl.config import GeneratorsConfig, ModelConfig, TinyModelConfig, load_config
from asyncrl.config.environment import EnvironmentConfig
from asyncrl.core.messages import (
    Ack,
    Heartbeat,
    Leave,
    Trajectories,
    TrajectoryMeta,
    WorkGrant,
    WorkItem,
    WorkRequest,
)
from asyncrl.generation.envs import Environment, ScoreRequest, StepResult
from asyncrl.generation.models import build_policy
from asyncrl.generation.tasks import build_tokenizer
from asyncrl.generators.backend import Rollout, StopStrings, append_tokens
from asyncrl.generators.episodes import Episodes
from asyncrl.generators.hf_backend import HFBackend
from asyncrl.generators.worker import GeneratorReplica
from asyncrl.learner.algorithms import token_logprobs


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


class FlakyCountdownEnv(CountdownEnv):
    """For a launched run (tests/integration/test_environment_run.py): a first step hangs
    for ``hang_s`` when the prompt starts with ``hang_prefix``, and a final answer is
    also scored by the reward function named ``score_with``."""

    def __init__(self, turns: int = 3, hang_prefix: str = "", hang_s: float = 0.0, score_with=""):
        super().__init__(turns)
        self.hang_prefix, self.hang_s, self.score_with = hang_prefix, hang_s, score_with

    def reset(self, row):
        self.row = row
        content = row["prompt"][0]["content"]
        self.hang = bool(self.hang_prefix) and content.startswith(self.hang_prefix)
        return super().reset(row)

    def step(self, response):
        if self.hang:
            self.hang = False
            time.sleep(self.hang_s)
        result = super().step(response)
        if result.done and self.score_with:
            truth = self.row["reward_model"]["ground_truth"]
            request = ScoreRequest(self.score_with, response, self.row["data_source"], truth)
            result.score_request = request
        return result


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


def make_episodes(tokenizer, turns=3, fail_on=0, **overrides):
    config = EnvironmentConfig(
        name=f"{__name__}:CountdownEnv",
        formatter="plain",
        kwargs={"turns": turns, "fail_on": fail_on},
        **overrides,
    )
    return Episodes(config, tokenizer, max_tokens_per_turn=16)


def said(text, group_id, samples=2):
    return WorkItem(group_id, samples, [1, 2, 3], "x", "d", {}, [{"role": "user", "content": text}])


MESSAGES = [{"role": "user", "content": "123="}]


EVAL_ITEM = WorkItem(-1, 2, [1, 4, 5, 6, 13], "234", "synthetic/digits", {}, MESSAGES, 3)


TRAIN_ITEM = WorkItem(0, 2, [1, 4, 5, 6, 13], "234", "synthetic/digits", {}, MESSAGES)


class ScriptedBuffer:
    """Grants both items once, then empty grants; stops the replica once all 4 samples
    are in. Speaks the RequestClient interface the replica uses."""

    endpoint = "scripted://buffer"
    timeout_s = 5.0

    def __init__(self):
        self.granted = False
        self.replica: GeneratorReplica | None = None
        self.samples: list[TrajectoryMeta] = []
        self.replies: list[object] = []

    def answer(self, body):
        match body:
            case WorkRequest():
                items = [] if self.granted else [EVAL_ITEM, TRAIN_ITEM]
                self.granted = True
                return WorkGrant(items, policy_version=0, retry_after_s=0.0 if items else 0.01)
            case Trajectories(samples=metas):
                self.samples += metas
                if len(self.samples) == 4:
                    assert self.replica is not None
                    self.replica.stopping = True
                return Ack(accepted=len(metas))
            case Heartbeat() | Leave():
                return Ack(accepted=0)
        raise AssertionError(f"unexpected {body!r}")

    def request(self, body, arrays=None, timeout_s=None):
        return self.answer(body), {}

    def send(self, body, arrays=None):
        self.replies.append(self.answer(body))  # answered in order, as the buffer does

    def receive(self, timeout_s=None):
        if not self.replies:
            raise TimeoutError("nothing sent")
        return self.replies.pop(0), {}


class NoNewWeights:
    def fetch_newer(self, have_version: int):
        return None


def run_replica(*overrides: str) -> list[TrajectoryMeta]:
    config = load_config(
        None,
        ["model.tiny={}", "algorithm.group_size=2", "buffer.heartbeat_interval_s=0.05",
         *overrides],
    )  # fmt: skip
    buffer = ScriptedBuffer()
    backend = ScriptedBackend(build_tokenizer(), turn_length=3)
    context = zmq.Context()
    replica = GeneratorReplica(
        config, "gen-0", backend, context, "default", buffer, "tcp://127.0.0.1:9"
    )
    replica.weights.socket.close(linger=0)  # never asked: no newer weights in this test
    replica.weights = NoNewWeights()
    buffer.replica = replica
    try:
        replica.run_loop()
    finally:
        replica.close()
        context.term()
    return buffer.samples


PROMPT_LEN = 64


RESPONSE_LEN = 2000


def finished_rollout(replica: GeneratorReplica, group_id: int) -> Rollout:
    """Group ``group_id``'s one sample as the backend finished it: a one-turn episode the
    replica started, its turn ended at the token limit."""
    item = WorkItem(group_id, 1, [1] * PROMPT_LEN, "234", "synthetic/digits")
    rollout = replica.episodes.start(item, 0, now=0.0)
    rollout.response_ids = [5] * RESPONSE_LEN
    rollout.logprobs = [-0.5] * RESPONSE_LEN
    rollout.token_versions = [0] * RESPONSE_LEN
    rollout.loss_mask = [1] * RESPONSE_LEN
    rollout.finish_reason = "length"
    return rollout


CHUNK = 3


MAX_NEW = 8


def make_backend(temperature: float = 1.0) -> HFBackend:
    model, tokenizer = build_policy(ModelConfig(tiny=TinyModelConfig()), seed=0)
    sampling = GeneratorsConfig(max_new_tokens=MAX_NEW, chunk_tokens=CHUNK, temperature=temperature)
    return HFBackend(model, tokenizer, sampling)


@torch.no_grad()
def recompute(model: torch.nn.Module, rollout: Rollout, temperature: float) -> torch.Tensor:
    """The learner's view: one forward over prompt + response, log-probs of the response."""
    ids = torch.tensor([rollout.prompt_ids + rollout.response_ids])
    logits = model(input_ids=ids).logits
    logprobs = token_logprobs(logits[:, :-1], ids[:, 1:], temperature)[0]
    return logprobs[len(rollout.prompt_ids) - 1 :]
