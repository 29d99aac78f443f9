"""The multi-turn driver: model turns and environment replies as one token sequence.

The trajectory is a single token list that only ever grows:

- it starts with the prompt ids (given, or the environment's ``reset``
  messages rendered by the turn formatter and tokenized);
- a model turn appends the ids the model generated, exactly as generated:
  loss mask 1, with the log-probs and weight versions the model reported;
- an environment reply is rendered to text by the formatter, tokenized on its
  own, and appended: loss mask 0, log-prob 0, version -1.

Nothing already in the list is ever decoded-and-re-encoded, so the prefix
never changes between turns (no re-tokenization drift) and the learner scores
exactly the tokens the model produced.

The driver is backend-agnostic. :func:`run_episode` takes any callable
``generate(token_ids, max_new_tokens, stop) -> (new_ids, logprobs, versions)``
(optionally a fourth item, the backend's finish reason ``"stop"`` or
``"length"``). A backend that batches many episodes uses
:class:`EpisodeRunner` directly: ``request()`` for each unfinished episode,
generate them together, ``submit(...)`` each result.

Limits: ``max_turns`` model turns, and ``max_total_tokens`` for the whole
list, prompt included. A model turn is given at most the tokens left (and at
most ``max_tokens_per_turn``); a turn cut off there, or an environment reply
that would leave no room for another model token, ends the episode with
finish reason ``"length"``. The finish reason is ``"stop"`` when the
environment ended the episode, ``"max_turns"`` when the turns ran out.

An episode that ends with a :class:`~asyncrl.generation.envs.base.ScoreRequest` is
scored in place (the named function is called in the thread that called
``submit``), unless the runner is made with ``defer_scoring=True``: then the
request waits in ``score_request`` for the caller to score it (the generator
replica's reward workers) and add the score to ``reward``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from asyncrl.core.trajectory import ENV_VERSION, trajectory_version
from asyncrl.generation.envs.base import Environment, ScoreRequest
from asyncrl.generation.envs.formatting import ChatMLFormatter, Codec, TurnFormatter

Generate = Callable[[list[int], int, list[str]], tuple]


@dataclass
class Trajectory:
    token_ids: list[int]
    """Prompt and every turn after it: the one sequence the learner scores."""
    loss_mask: list[int]
    """Per token of the response, ``token_ids[prompt_len:]``: 1 model, 0 environment."""
    logprobs: list[float]
    """Behavior log-probs of the response tokens; 0 for environment tokens."""
    versions: list[int]
    """Weight version of each response token; ``ENV_VERSION`` (-1) for environment tokens."""
    prompt_len: int
    num_turns: int
    """Model turns taken."""
    finish_reason: str
    """``stop`` (the environment ended it), ``length`` or ``max_turns``."""
    reward: float
    tool_calls: int
    tool_errors: int
    spans: list[tuple[int, int, str]] = field(default_factory=list)
    """``(start, end, "model" | "env")`` ranges of ``token_ids`` after the prompt."""

    @property
    def prompt_ids(self) -> list[int]:
        return self.token_ids[: self.prompt_len]

    @property
    def response_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len :]

    @property
    def min_version(self) -> int:
        """Oldest weight version among the model's tokens, by the one rule the buffer and
        the learner use too (:func:`asyncrl.core.trajectory.trajectory_version`): environment
        tokens carry ``ENV_VERSION`` and do not count; ``UNVERSIONED`` if it has none."""
        return trajectory_version(self.versions)


@dataclass(frozen=True)
class TurnRequest:
    token_ids: list[int]
    max_new_tokens: int
    stop: list[str]


class EpisodeRunner:
    """One episode as a state machine: ``request()`` then ``submit(...)`` until ``done``."""

    def __init__(
        self,
        env: Environment,
        row: Mapping[str, Any],
        codec: Codec,
        formatter: TurnFormatter | None = None,
        *,
        prompt_ids: Sequence[int] | None = None,
        max_turns: int = 4,
        max_total_tokens: int = 2048,
        max_tokens_per_turn: int | None = None,
        stop: Sequence[str] = (),
        defer_scoring: bool = False,
    ):
        if max_turns < 1 or max_total_tokens < 1:
            raise ValueError("max_turns and max_total_tokens must be at least 1")
        self.env = env
        self.codec = codec
        self.formatter = formatter or ChatMLFormatter()
        self.max_turns = max_turns
        self.max_total_tokens = max_total_tokens
        self.max_tokens_per_turn = max_tokens_per_turn
        self.stop = [self.formatter.end_of_turn, *[s for s in stop if s]]
        messages = env.reset(row)
        if prompt_ids is None:
            prompt_ids = codec.encode(self.formatter.render_prompt(messages))
        self._ids = [int(t) for t in prompt_ids]
        self.prompt_len = len(self._ids)
        self._mask: list[int] = []
        self._logprobs: list[float] = []
        self._versions: list[int] = []
        self._spans: list[tuple[int, int, str]] = []
        self.num_turns = 0
        self.reward = 0.0
        self.tool_calls = 0
        self.tool_errors = 0
        self.finish_reason: str | None = None
        self.defer_scoring = defer_scoring
        self.score_request: ScoreRequest | None = None
        """With ``defer_scoring``: the final answer still to be scored (not in ``reward``)."""
        if self._budget() <= 0:
            self._finish("length")

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def token_ids(self) -> list[int]:
        """A copy of the sequence so far."""
        return list(self._ids)

    def _budget(self) -> int:
        left = self.max_total_tokens - len(self._ids)
        if self.max_tokens_per_turn is not None:
            left = min(left, self.max_tokens_per_turn)
        return left

    def _finish(self, reason: str) -> None:
        self.finish_reason = reason
        if reason != "stop":
            self.reward += float(self.env.truncated_reward(reason))

    def _append(self, ids, mask: int, logprobs, versions, kind: str) -> None:
        start = len(self._ids)
        self._ids += ids
        self._mask += [mask] * len(ids)
        self._logprobs += logprobs
        self._versions += versions
        self._spans.append((start, len(self._ids), kind))

    def request(self) -> TurnRequest:
        """What to generate next: continue ``token_ids`` by at most ``max_new_tokens``."""
        if self.done:
            raise RuntimeError("the episode is over")
        return TurnRequest(list(self._ids), self._budget(), list(self.stop))

    def submit(
        self,
        new_ids: Sequence[int],
        logprobs: Sequence[float],
        versions: Sequence[int],
        finish_reason: str | None = None,
    ) -> None:
        """The model's turn; steps the environment and appends its reply."""
        if self.done:
            raise RuntimeError("the episode is over")
        budget = self._budget()
        if not len(new_ids) == len(logprobs) == len(versions):
            raise ValueError(
                f"generate returned {len(new_ids)} ids, {len(logprobs)} log-probs "
                f"and {len(versions)} versions; they must match"
            )
        if len(new_ids) > budget:
            raise ValueError(f"generate returned {len(new_ids)} ids for max_new_tokens={budget}")
        ids = [int(t) for t in new_ids]
        self._append(ids, 1, [float(x) for x in logprobs], [int(v) for v in versions], "model")
        self.num_turns += 1

        text = self.codec.decode(ids)
        ended = next((s for s in self.stop if text.endswith(s)), None)
        if finish_reason is None:
            finish_reason = "length" if len(ids) >= budget and ended is None else "stop"
        if finish_reason == "length":
            self._finish("length")
            return
        response = text[: len(text) - len(ended)] if ended else text

        result = self.env.step(response)
        self.reward += float(result.reward)
        self.tool_calls += result.tool_calls
        self.tool_errors += result.tool_errors
        if result.done:
            request = getattr(result, "score_request", None)
            if request is not None and self.defer_scoring:
                self.score_request = request
            elif request is not None:
                self.reward += request.score_here()
            self._finish("stop")
            return
        if self.num_turns >= self.max_turns:
            self._finish("max_turns")
            return
        reply = self.codec.encode(self.formatter.render_reply(result.messages, text))
        if len(self._ids) + len(reply) >= self.max_total_tokens:
            self._finish("length")
            return
        self._append(reply, 0, [0.0] * len(reply), [ENV_VERSION] * len(reply), "env")

    def result(self) -> Trajectory:
        if not self.done:
            raise RuntimeError("the episode is still running")
        return Trajectory(
            token_ids=list(self._ids),
            loss_mask=list(self._mask),
            logprobs=list(self._logprobs),
            versions=list(self._versions),
            prompt_len=self.prompt_len,
            num_turns=self.num_turns,
            finish_reason=str(self.finish_reason),
            reward=self.reward,
            tool_calls=self.tool_calls,
            tool_errors=self.tool_errors,
            spans=list(self._spans),
        )


def run_episode(
    env: Environment,
    row: Mapping[str, Any],
    generate: Generate,
    codec: Codec,
    formatter: TurnFormatter | None = None,
    **limits,
) -> Trajectory:
    """Run one episode to the end with ``generate``; see :class:`EpisodeRunner` for limits."""
    runner = EpisodeRunner(env, row, codec, formatter, **limits)
    while not runner.done:
        request = runner.request()
        runner.submit(*generate(request.token_ids, request.max_new_tokens, request.stop))
    return runner.result()
