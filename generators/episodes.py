"""Multi-turn episodes inside a generator replica: the backend makes the model's
turns, the environment answers them, and the rollout grows as one token sequence.

::

    start ─▶ environment made and reset, on a thread ─▶ prompt
       rollout ─generate_chunk─▶ ... the turn ends (EOS, end-of-turn marker, limit)
          ▲                                  │ the environment steps, on a thread
          └── reply tokens appended ◀────────┘ (or the episode is over: scored, a sample)

Each sample of a group is its own episode with a fresh environment
(:func:`asyncrl.generation.envs.factory.environment_factory`), driven by an
:class:`~asyncrl.generation.envs.rollout.EpisodeRunner`, which owns the token rules:
the prefix never changes, model tokens have loss mask 1 and their own
log-probs and versions, environment tokens mask 0, log-prob 0, version -1.
The rollout mirrors the runner's sequence, so partial rollouts work across
turns exactly as within one: a weight update between chunks changes the
version of later tokens and nothing else.

The environment's code runs on threads (:class:`~asyncrl.generation.envs.threads.StepPool`,
``environment.workers``), never on the replica's loop, so a slow tool call
holds back only its own episode. ``start`` hands back a rollout that is not the
backend's yet (``finish_reason`` ``"starting"``) while the environment is made
and reset; ``collect`` hands it out when its prompt is ready. What can go wrong
costs one episode, scored 0 with an error tag and counted in ``stats``:

- an environment that raises: ``error:environment`` (``env_errors``);
- a ``reset`` or ``step`` still running after ``environment.step_timeout_s``:
  ``error:environment_timeout`` (``env_timeouts``). The deadline is checked
  here, from the replica's loop; the stuck thread cannot be killed, so it is
  abandoned (``steps_abandoned``, ``stuck_threads``) and another takes its place;
- a prompt (the environment's ``reset`` messages, rendered) longer than
  ``data.max_prompt_tokens``: ``error:prompt_too_long`` (``prompt_too_long``),
  before any turn is generated.

Each sample of an episode that took a turn carries its counts (``Rollout.episode``:
turns, tool calls, tool errors) to the buffer, which reports them per batch and per
eval round. ``stats["tool_s"]`` is the seconds the environment threads spent in
``reset`` and ``step`` calls, to set against the replica's ``busy_s`` (generating).

An episode that ends with a :class:`~asyncrl.generation.envs.base.ScoreRequest` (the
tool environment's final answer, when its reward function has a name) is
scored by the replica's :class:`~asyncrl.generation.rewards.RewardScorer`, in its worker
processes with ``reward.timeout_s``, like a single-turn sample; its reward is
what the environment gave on the way plus that score, and a reward function
that fails or hangs scores the episode 0 with the scorer's error tag.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from asyncrl.config.environment import EnvironmentConfig
from asyncrl.core.messages import MAX_EPISODE_COUNT, EpisodeCounts, WorkItem
from asyncrl.core.trajectory import ENV_VERSION
from asyncrl.generation.envs.base import ScoreRequest
from asyncrl.generation.envs.factory import environment_factory
from asyncrl.generation.envs.formatting import Codec, build_formatter
from asyncrl.generation.envs.rollout import EpisodeRunner
from asyncrl.generation.envs.threads import Job, StepPool
from asyncrl.generation.rewards import RewardScorer, Score
from asyncrl.generators.backend import Rollout

log = logging.getLogger("asyncrl.episodes")

ERROR_ENVIRONMENT = "error:environment"
ERROR_ENVIRONMENT_TIMEOUT = "error:environment_timeout"
ERROR_PROMPT_TOO_LONG = "error:prompt_too_long"
ERROR_SCORER = "error:scorer"
_EPISODE_ERRORS = (ERROR_ENVIRONMENT, ERROR_ENVIRONMENT_TIMEOUT, ERROR_PROMPT_TOO_LONG)
"""Errors that end an episode early (counted ``finish_error``); a reward error does not."""
STARTING = "starting"
"""``finish_reason`` of a rollout whose environment is still being reset: not the backend's."""
MAX_STUCK_THREADS = 64
"""Abandoned environment threads replaced by new ones; past it, steps that cannot start fail."""
_LOGGED_PER_TAG = 5


def episode_counts(runner: EpisodeRunner | None) -> EpisodeCounts | None:
    """What an episode did, sent with its sample for the buffer's per-batch figures.

    None when it took no model turn (its reset failed or timed out, its prompt was too
    long): such an episode has nothing to measure, and the buffer refuses counts with
    ``turns == 0``, so its sample goes as a single-turn one would, with its error tag.
    The counts are clamped to what the buffer accepts (at most ``MAX_EPISODE_COUNT``, no
    more errors than calls): an environment of one's own may report anything, and the
    buffer refuses a whole message for one impossible sample."""
    if runner is None or runner.num_turns < 1:
        return None
    turns, calls, errors = (
        min(max(int(value), 0), MAX_EPISODE_COUNT)
        for value in (runner.num_turns, runner.tool_calls, runner.tool_errors)
    )
    return EpisodeCounts(turns=turns, tool_calls=calls, tool_errors=min(errors, calls))


def _name(episode: _Episode) -> str:
    return f"episode {episode.rollout.group_id}/{episode.rollout.sample_index}"


@dataclass(eq=False)
class _Episode:
    rollout: Rollout
    runner: EpisodeRunner | None = None
    """None until the environment has been made and reset."""
    job: Job | None = None
    """The reset or step running on the pool."""
    scored: Future | None = None
    """The reward workers' :class:`Score` of the final answer."""
    turn_start: int = 0
    """Index in the rollout's response where the model's current turn began."""


class Episodes:
    """The replica's episodes in flight: starting, waiting on the model, stepping or scored."""

    def __init__(
        self,
        config: EnvironmentConfig,
        tokenizer,
        max_tokens_per_turn: int,
        *,
        scorer: RewardScorer | None = None,
        max_prompt_tokens: int | None = None,
    ):
        """``scorer``: the replica's reward workers, for episodes that end with a
        ``ScoreRequest`` (without one, named reward functions run on the environment's
        thread). ``max_prompt_tokens``: ``data.max_prompt_tokens``, the longest prompt
        an episode may start from."""
        self.config = config
        self.scorer = scorer
        self.max_prompt_tokens = max_prompt_tokens
        self.make_environment = environment_factory(config, defer_score=scorer is not None)
        self.codec = Codec.from_hf(tokenizer)
        self.formatter = build_formatter(config.formatter, tokenizer)
        self.max_tokens_per_turn = max_tokens_per_turn
        self.running: dict[int, _Episode] = {}  # id(rollout) -> its episode
        self.stepping: list[_Episode] = []
        self.scoring: list[_Episode] = []
        self.pool = StepPool(config.workers, max_stuck=MAX_STUCK_THREADS, name="environment")
        self.stats: Counter[str] = Counter()
        self._stall_logged = False
        self._logged: dict[str, int] = {}

    @property
    def end_of_turn(self) -> str:
        """The stop string that ends a model turn (the backends must stop there)."""
        return self.formatter.end_of_turn

    def start(self, item: WorkItem, sample_index: int, now: float) -> Rollout:
        """A rollout for a new episode of ``item``, its environment made and reset on a thread.

        The rollout is ``finished`` (reason ``"starting"``) until ``collect`` hands
        it out with the environment's prompt: do not give it to the backend before."""
        row = {
            "prompt": item.messages,
            "data_source": item.data_source,
            "reward_model": {"ground_truth": item.ground_truth},
            "extra_info": item.extra_info,
        }
        rollout = Rollout(  # the row's prompt as the data loader rendered it, until reset
            item.group_id,
            sample_index,
            list(item.prompt_ids),
            item.ground_truth,
            item.data_source,
            finish_reason=STARTING,
            started_at=now,
        )
        episode = _Episode(rollout)
        self.running[id(rollout)] = episode
        self.stats["episodes"] += 1
        episode.job = self.pool.submit(self._open, row)
        self.stepping.append(episode)
        return rollout

    def _open(self, row: dict[str, Any]) -> EpisodeRunner:
        """On a pool thread: a fresh environment, reset from ``row``."""
        return EpisodeRunner(
            self.make_environment(),
            row,
            self.codec,
            self.formatter,
            max_turns=self.config.max_turns,
            max_total_tokens=self.config.max_total_tokens,
            max_tokens_per_turn=self.max_tokens_per_turn,
            defer_scoring=self.scorer is not None,
        )

    def owns(self, rollout: Rollout) -> bool:
        return id(rollout) in self.running

    @property
    def waiting(self) -> int:
        """Episodes starting, stepping or being scored (they hold a slot, not the backend)."""
        return len(self.stepping) + len(self.scoring)

    def end_turn(self, rollout: Rollout) -> None:
        """The backend ended ``rollout``'s turn: step its environment on the pool.

        A rollout still starting is left alone (``collect`` hands it out)."""
        if rollout.finish_reason == STARTING:
            return
        episode = self.running[id(rollout)]
        assert episode.runner is not None and episode.job is None, "not the model's turn"
        start = episode.turn_start
        episode.job = self.pool.submit(
            episode.runner.submit,
            rollout.response_ids[start:],
            rollout.logprobs[start:],
            rollout.token_versions[start:],
            rollout.finish_reason,
        )
        self.stepping.append(episode)

    def collect(self) -> tuple[list[Rollout], list[tuple[Rollout, Score]]]:
        """Episodes whose environment has answered: ``(continuing, finished with scores)``.

        A continuing rollout has the environment's reply (or, new, its prompt)
        and is ready for the backend again; a finished one carries the episode's
        reward. Steps past ``environment.step_timeout_s`` end their episodes here."""
        continuing: list[Rollout] = []
        finished: list[tuple[Rollout, Score]] = []
        now = time.monotonic()
        stalled = self.pool.stalled
        stepping, self.stepping = self.stepping, []
        for episode in stepping:
            job = episode.job
            assert job is not None
            if not job.done:
                overdue = job.started_at is not None and (
                    now - job.started_at > self.config.step_timeout_s
                )
                if (overdue or (job.started_at is None and stalled)) and self.pool.abandon(job):
                    self._time_out(episode, job, finished)
                    continue
                if not job.done:
                    self.stepping.append(episode)
                    continue
            episode.job = None
            self._answered(episode, job, continuing, finished)
        scoring, self.scoring = self.scoring, []
        for episode in scoring:
            assert episode.scored is not None
            if not episode.scored.done():
                self.scoring.append(episode)
                continue
            finished.append(self._scored(episode))
        self.stats["stuck_threads"] = self.pool.stuck
        self.stats["tool_s"] = self.pool.busy_s  # beside the replica's busy_s (generating)
        return continuing, finished

    def _answered(
        self,
        episode: _Episode,
        job: Job,
        continuing: list[Rollout],
        finished: list[tuple[Rollout, Score]],
    ) -> None:
        """The environment's reset or step returned (or raised)."""
        rollout = episode.rollout
        error = job.future.exception()
        if error is not None:
            self.stats["env_errors"] += 1
            what = "step" if episode.runner is not None else "reset"
            self._warn(
                ERROR_ENVIRONMENT,
                "%s, scored 0: the environment's %s raised %r",
                _name(episode),
                what,
                error,
            )
            detail = f"{type(error).__name__}: {error}"[:500]
            finished.append(self._close(episode, Score(0.0, ERROR_ENVIRONMENT, detail)))
            return
        if episode.runner is None:  # reset: the episode's prompt is known
            runner: EpisodeRunner = job.future.result()
            episode.runner = runner
            limit = self.max_prompt_tokens
            if limit is not None and runner.prompt_len > limit:
                self.stats["prompt_too_long"] += 1
                self._warn(
                    ERROR_PROMPT_TOO_LONG,
                    "%s, scored 0: its prompt (the environment's reset messages, tool "
                    "listing included, rendered by the %s formatter) has %d tokens, more "
                    "than data.max_prompt_tokens=%d, so it ends before its first turn. "
                    "Raise data.max_prompt_tokens or shorten the prompt",
                    _name(episode),
                    self.config.formatter,
                    runner.prompt_len,
                    limit,
                )
                detail = f"{runner.prompt_len} prompt tokens > data.max_prompt_tokens={limit}"
                rollout.finish_reason = "length"
                finished.append(self._close(episode, Score(0.0, ERROR_PROMPT_TOO_LONG, detail)))
                return
            rollout.prompt_ids = runner.token_ids
        runner = episode.runner
        if runner.done:
            rollout.finish_reason = "stop" if runner.finish_reason == "stop" else "length"
            if runner.score_request is not None:
                self._submit_score(episode, runner.score_request, finished)
                return
            finished.append(self._close(episode, Score(runner.reward, None)))
            return
        self._append_reply(rollout, runner)
        episode.turn_start = len(rollout.response_ids)
        rollout.max_new_tokens = len(rollout.response_ids) + runner.request().max_new_tokens
        rollout.finish_reason = None
        continuing.append(rollout)

    def _time_out(self, episode: _Episode, job: Job, finished: list) -> None:
        """Give up on the episode's reset or step; its thread, if it has one, is abandoned."""
        self.stats["env_timeouts"] += 1
        what = "step" if episode.runner is not None else "reset"
        if job.started_at is None:
            detail = (
                f"the {what} could not start: {self.pool.stuck} environment threads are stuck "
                f"past environment.step_timeout_s={self.config.step_timeout_s:g}"
            )
        else:
            self.stats["steps_abandoned"] += 1
            detail = (
                f"the {what} ran past environment.step_timeout_s="
                f"{self.config.step_timeout_s:g}; its thread was abandoned"
            )
        self._warn(ERROR_ENVIRONMENT_TIMEOUT, "%s, scored 0: %s", _name(episode), detail)
        if self.pool.stalled and not self._stall_logged:
            self._stall_logged = True
            log.error(
                "%d environment threads are stuck (environment.step_timeout_s=%g); no more "
                "are started, so episodes fail until some return. Fix the environment, or "
                "restart this generator to free them",
                self.pool.stuck,
                self.config.step_timeout_s,
            )
        finished.append(self._close(episode, Score(0.0, ERROR_ENVIRONMENT_TIMEOUT, detail)))

    def _submit_score(self, episode: _Episode, request: ScoreRequest, finished: list) -> None:
        """Send the final answer to the replica's reward workers."""
        assert self.scorer is not None
        self.stats["rewards_requested"] += 1
        try:
            episode.scored = self.scorer.submit(
                request.data_source,
                request.solution_str,
                request.ground_truth,
                request.extra_info,
                function=request.function,
            )
        except RuntimeError as error:  # the scorer is closed or its workers cannot start
            finished.append(self._close(episode, Score(0.0, ERROR_SCORER, str(error))))
            return
        self.scoring.append(episode)

    def _scored(self, episode: _Episode) -> tuple[Rollout, Score]:
        """The episode's reward: the environment's, plus the reward function's score."""
        assert episode.scored is not None and episode.runner is not None
        score: Score = episode.scored.result()
        if score.error is None:
            score = Score(episode.runner.reward + score.reward, None)
        return self._close(episode, score)  # a failed score is 0, as for one turn

    def _append_reply(self, rollout: Rollout, runner: EpisodeRunner) -> None:
        sequence = runner.token_ids
        reply = sequence[len(rollout.prompt_ids) + len(rollout.response_ids) :]
        rollout.response_ids += reply
        rollout.logprobs += [0.0] * len(reply)
        rollout.token_versions += [ENV_VERSION] * len(reply)
        rollout.loss_mask += [0] * len(reply)

    def _close(self, episode: _Episode, score: Score) -> tuple[Rollout, Score]:
        """Forget the episode and count it; returns what goes to the buffer."""
        rollout = episode.rollout
        del self.running[id(rollout)]
        if rollout.finish_reason in (None, STARTING):
            rollout.finish_reason = "stop"
        runner = episode.runner
        finish = "error"
        if runner is not None and runner.finish_reason and score.error not in _EPISODE_ERRORS:
            finish = runner.finish_reason
        if runner is not None:  # (an abandoned thread may still be changing it)
            self.stats["turns"] += runner.num_turns
            self.stats["tool_calls"] += runner.tool_calls
            self.stats["tool_errors"] += runner.tool_errors
        rollout.episode = episode_counts(runner)
        self.stats[f"finish_{finish}"] += 1
        return rollout, score

    def _warn(self, tag: str, message: str, *args: Any) -> None:
        """Log the first few of each kind of failure; the rest are only counted."""
        count = self._logged[tag] = self._logged.get(tag, 0) + 1
        if count <= _LOGGED_PER_TAG:
            log.warning(message, *args)
            if count == _LOGGED_PER_TAG:
                log.warning("further %s failures are counted, not logged", tag)

    def close(self) -> None:
        """Cancel queued environment calls; running ones are not waited for."""
        self.pool.close()
