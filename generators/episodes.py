"""Every sample of a generator replica is an episode of this driver: the backend makes
the model's turns, the environment (if any) answers them, and the rollout grows as one
token sequence.

Without ``environment`` an episode is one model turn: its rollout is the backend's at
once (the prompt the data loader rendered), and when the turn ends its decoded response
goes to the replica's :class:`~asyncrl.generation.rewards.RewardScorer` with the work item's
``extra_info``, every turn ended in the same chunk in one batch. It holds no slot while
it is scored (it has no environment), and counts in no ``stats``: those are the
environments'. With ``environment``, an episode is the multi-turn one below.

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

(How each is scored, counted and logged: :mod:`asyncrl.generators.episode_failures`.)

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

import time
from collections import Counter
from concurrent.futures import Future, wait
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
from asyncrl.generators.episode_failures import EPISODE_ERRORS, EpisodeFailures

ERROR_SCORER = "error:scorer"
STARTING = "starting"
"""``finish_reason`` of a rollout whose environment is still being reset: not the backend's."""
MAX_STUCK_THREADS = 64
"""Abandoned environment threads replaced by new ones; past it, steps that cannot start fail."""


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
    extra_info: dict[str, Any]
    """The work item's, for the reward function of a one-turn episode."""
    runner: EpisodeRunner | None = None
    """None until the environment has been made and reset."""
    job: Job | None = None
    """The reset or step running on the pool."""
    scored: Future | None = None
    """The reward workers' :class:`Score` of the final answer (a one-turn episode's
    response, or an environment's ``ScoreRequest``)."""
    turn_start: int = 0
    """Index in the rollout's response where the model's current turn began."""


class Episodes:
    """The replica's episodes in flight: starting, waiting on the model, stepping or scored."""

    def __init__(
        self,
        config: EnvironmentConfig | None,
        tokenizer,
        max_tokens_per_turn: int,
        *,
        scorer: RewardScorer | None = None,
        max_prompt_tokens: int | None = None,
    ):
        """``config``: the environment, None for one-turn episodes. ``scorer``: the
        replica's reward workers, for one-turn episodes (required) and for episodes that
        end with a ``ScoreRequest`` (without one, named reward functions run on the
        environment's thread). ``max_prompt_tokens``: ``data.max_prompt_tokens``, the
        longest prompt an episode may start from."""
        self.config = config
        self.scorer = scorer
        self.decode = tokenizer.decode
        self.max_prompt_tokens = max_prompt_tokens
        self.max_tokens_per_turn = max_tokens_per_turn
        self.running: dict[int, _Episode] = {}  # id(rollout) -> its episode
        self.stepping: list[_Episode] = []
        self.scoring: list[_Episode] = []
        self.stats: Counter[str] = Counter()
        self.pool: StepPool | None = None
        if config is None:
            assert scorer is not None, "one-turn episodes are scored by the reward workers"
        else:
            self.make_environment = environment_factory(config, defer_score=scorer is not None)
            self.codec = Codec.from_hf(tokenizer)
            self.formatter = build_formatter(config.formatter, tokenizer)
            self.pool = StepPool(config.workers, max_stuck=MAX_STUCK_THREADS, name="environment")
            self.failures = EpisodeFailures(self.stats, config.step_timeout_s)

    @property
    def one_turn(self) -> bool:
        """No environment: every episode is one model turn, scored by the reward function."""
        return self.config is None

    @property
    def end_of_turn(self) -> str:
        """The stop string that ends a model turn (the backends must stop there)."""
        return self.formatter.end_of_turn

    def start(self, item: WorkItem, sample_index: int, now: float) -> Rollout:
        """A rollout for a new episode of ``item``: the backend's at once for one turn, else
        its environment made and reset on a thread.

        An environment's rollout is ``finished`` (reason ``"starting"``) until ``collect``
        hands it out with the environment's prompt: do not give it to the backend before."""
        rollout = Rollout(  # the row's prompt as the data loader rendered it, until reset
            item.group_id,
            sample_index,
            list(item.prompt_ids),
            item.ground_truth,
            item.data_source,
            started_at=now,
        )
        episode = _Episode(rollout, item.extra_info)
        self.running[id(rollout)] = episode
        if self.pool is None:  # one turn: nothing to make or reset
            return rollout
        row = {
            "prompt": item.messages,
            "data_source": item.data_source,
            "reward_model": {"ground_truth": item.ground_truth},
            "extra_info": item.extra_info,
        }
        rollout.finish_reason = STARTING
        self.stats["episodes"] += 1
        episode.job = self.pool.submit(self._open, row)
        self.stepping.append(episode)
        return rollout

    def _open(self, row: dict[str, Any]) -> EpisodeRunner:
        """On a pool thread: a fresh environment, reset from ``row``."""
        assert self.config is not None
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
        """Episodes whose environment is starting, stepping or having its final answer
        scored: they hold a slot, not the backend. A one-turn episode being scored has no
        environment and holds none."""
        return len(self.stepping) + (0 if self.one_turn else len(self.scoring))

    @property
    def unscored(self) -> int:
        """Episodes over whose reward the reward workers are still computing."""
        return len(self.scoring)

    def wait_for_scores(self, timeout_s: float) -> None:
        """Return once every reward asked for is in, or after ``timeout_s``."""
        wait([episode.scored for episode in self.scoring], timeout=timeout_s)

    def end_turns(self, rollouts: list[Rollout]) -> None:
        """The backend ended ``rollouts``' turns: a one-turn episode's response goes to the
        reward workers (all of them in one batch, not a round trip each), an environment's
        episode steps on the pool."""
        if self.one_turn:
            self._score_responses([self.running[id(rollout)] for rollout in rollouts])
            return
        for rollout in rollouts:
            self.end_turn(rollout)

    def _score_responses(self, episodes: list[_Episode]) -> None:
        """Ask the reward workers for the scores of one-turn episodes' decoded responses."""
        if not episodes:
            return
        assert self.scorer is not None
        samples = [
            (
                episode.rollout.data_source,
                self.decode(episode.rollout.response_ids, skip_special_tokens=True),
                episode.rollout.ground_truth,
                episode.extra_info,
            )
            for episode in episodes
        ]
        for episode, scored in zip(episodes, self.scorer.submit_many(samples), strict=True):
            episode.scored = scored
        self.scoring += episodes

    def end_turn(self, rollout: Rollout) -> None:
        """The backend ended ``rollout``'s turn: step its environment on the pool (or, for
        one turn, score it: :meth:`end_turns`).

        A rollout still starting is left alone (``collect`` hands it out)."""
        if rollout.finish_reason == STARTING:
            return
        if self.one_turn:
            self.end_turns([rollout])
            return
        episode = self.running[id(rollout)]
        assert episode.runner is not None and episode.job is None, "not the model's turn"
        assert self.pool is not None
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
        """Episodes whose environment or reward has answered: ``(continuing, finished with
        scores)``, the finished ones in the order they were asked to be scored.

        A continuing rollout has the environment's reply (or, new, its prompt)
        and is ready for the backend again; a finished one carries the episode's
        reward. Steps past ``environment.step_timeout_s`` end their episodes here."""
        continuing: list[Rollout] = []
        finished: list[tuple[Rollout, Score]] = []
        if self.pool is not None:
            self._collect_steps(continuing, finished)
        scoring, self.scoring = self.scoring, []
        for episode in scoring:
            assert episode.scored is not None
            if not episode.scored.done():
                self.scoring.append(episode)
                continue
            finished.append(self._scored(episode))
        if self.pool is not None:
            self.stats["stuck_threads"] = self.pool.stuck
            self.stats["tool_s"] = self.pool.busy_s  # beside the replica's busy_s (generating)
        return continuing, finished

    def _collect_steps(
        self, continuing: list[Rollout], finished: list[tuple[Rollout, Score]]
    ) -> None:
        """The resets and steps that returned, or ran past ``environment.step_timeout_s``."""
        assert self.pool is not None and self.config is not None
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
            what = "step" if episode.runner is not None else "reset"
            score = self.failures.raised(_name(episode), what, error)
            finished.append(self._close(episode, score))
            return
        if episode.runner is None:  # reset: the episode's prompt is known
            runner: EpisodeRunner = job.future.result()
            episode.runner = runner
            limit = self.max_prompt_tokens
            if limit is not None and runner.prompt_len > limit:
                formatter = self.config.formatter
                score = self.failures.prompt_too_long(
                    _name(episode), formatter, runner.prompt_len, limit
                )
                rollout.finish_reason = "length"
                finished.append(self._close(episode, score))
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
        assert self.pool is not None
        what = "step" if episode.runner is not None else "reset"
        started = job.started_at is not None
        score = self.failures.timed_out(_name(episode), what, started, self.pool)
        finished.append(self._close(episode, score))

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
        """The episode's reward: the environment's, plus the reward function's score (for
        one turn, that score as it is)."""
        assert episode.scored is not None
        score: Score = episode.scored.result()
        if self.one_turn:
            del self.running[id(episode.rollout)]
            return episode.rollout, score
        assert episode.runner is not None
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
        if runner is not None and runner.finish_reason and score.error not in EPISODE_ERRORS:
            finish = runner.finish_reason
        if runner is not None:  # (an abandoned thread may still be changing it)
            self.stats["turns"] += runner.num_turns
            self.stats["tool_calls"] += runner.tool_calls
            self.stats["tool_errors"] += runner.tool_errors
        rollout.episode = episode_counts(runner)
        self.stats[f"finish_{finish}"] += 1
        return rollout, score

    def close(self) -> None:
        """Cancel queued environment calls; running ones are not waited for."""
        if self.pool is not None:
            self.pool.close()
