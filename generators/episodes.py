"""Multi-turn episodes inside a generator replica: the backend makes the model's
turns, the environment answers them, and the rollout grows as one token sequence.

::

    rollout ─generate_chunk─▶ ... the turn ends (EOS, end-of-turn marker, limit)
       ▲                                  │ the environment steps, on a thread
       └── reply tokens appended ◀────────┘ (or the episode is over: a finished sample)

Each sample of a group is its own episode with a fresh environment
(:func:`asyncrl.envs.config.environment_factory`), driven by an
:class:`~asyncrl.envs.rollout.EpisodeRunner`, which owns the token rules:
the prefix never changes, model tokens have loss mask 1 and their own
log-probs and versions, environment tokens mask 0, log-prob 0, version -1.
The rollout mirrors the runner's sequence, so partial rollouts work across
turns exactly as within one: a weight update between chunks changes the
version of later tokens and nothing else.

Environments step on a thread pool, so a slow tool call holds back only its
own episode, never the replica's other rollouts. An environment that raises
ends its episode with reward 0 and the error tag ``error:environment``.
"""

from __future__ import annotations

import logging
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from asyncrl.envs.config import EnvironmentConfig, environment_factory
from asyncrl.envs.formatting import FORMATTERS, Codec
from asyncrl.envs.rollout import ENV_VERSION, EpisodeRunner
from asyncrl.generators.backend import Rollout
from asyncrl.messages import WorkItem
from asyncrl.rewards import Score

log = logging.getLogger("asyncrl.episodes")

ERROR_ENVIRONMENT = "error:environment"


@dataclass
class _Turn:
    runner: EpisodeRunner
    turn_start: int
    """Index in the rollout's response where the model's current turn began."""


class Episodes:
    """The replica's episodes in flight: started, waiting on the model, or stepping."""

    def __init__(self, config: EnvironmentConfig, tokenizer, max_tokens_per_turn: int):
        self.config = config
        self.make_environment = environment_factory(config)
        self.codec = Codec.from_hf(tokenizer)
        self.formatter = FORMATTERS[config.formatter]()
        self.max_tokens_per_turn = max_tokens_per_turn
        self.turns: dict[int, _Turn] = {}  # id(rollout) -> its episode
        self.stepping: list[tuple[Rollout, Future]] = []
        self.pool = ThreadPoolExecutor(config.workers, thread_name_prefix="environment")
        self.stats: Counter[str] = Counter()

    @property
    def end_of_turn(self) -> str:
        """The stop string that ends a model turn (the backends must stop there)."""
        return self.formatter.end_of_turn

    def start(self, item: WorkItem, sample_index: int, now: float) -> Rollout:
        """A rollout for a new episode of ``item``: its prompt is the environment's.

        Give it to the backend unless ``waiting`` took it (an episode over at once)."""
        row = {
            "prompt": item.messages,
            "data_source": item.data_source,
            "reward_model": {"ground_truth": item.ground_truth},
            "extra_info": item.extra_info,
        }
        runner = EpisodeRunner(
            self.make_environment(),
            row,
            self.codec,
            self.formatter,
            max_turns=self.config.max_turns,
            max_total_tokens=self.config.max_total_tokens,
            max_tokens_per_turn=self.max_tokens_per_turn,
        )
        rollout = Rollout(
            item.group_id,
            sample_index,
            runner.token_ids,
            item.ground_truth,
            item.data_source,
            started_at=now,
        )
        self.turns[id(rollout)] = _Turn(runner, 0)
        self.stats["episodes"] += 1
        if runner.done:  # the prompt alone fills max_total_tokens: over before it starts
            over: Future = Future()
            over.set_result(None)
            self.stepping.append((rollout, over))
        else:
            rollout.max_new_tokens = runner.request().max_new_tokens
        return rollout

    def owns(self, rollout: Rollout) -> bool:
        return id(rollout) in self.turns

    @property
    def waiting(self) -> int:
        """Episodes whose environment is stepping (they hold a slot, not the backend)."""
        return len(self.stepping)

    def end_turn(self, rollout: Rollout) -> None:
        """The backend ended ``rollout``'s turn: step its environment in the pool."""
        turn = self.turns[id(rollout)]
        start = turn.turn_start
        self.stepping.append(
            (
                rollout,
                self.pool.submit(
                    turn.runner.submit,
                    rollout.response_ids[start:],
                    rollout.logprobs[start:],
                    rollout.token_versions[start:],
                    rollout.finish_reason,
                ),
            )
        )

    def collect(self) -> tuple[list[Rollout], list[tuple[Rollout, Score]]]:
        """Episodes whose environment has answered: ``(continuing, finished with scores)``.

        A continuing rollout has the environment's reply appended and is ready
        for the backend again; a finished one carries the episode's reward."""
        continuing: list[Rollout] = []
        finished: list[tuple[Rollout, Score]] = []
        still = []
        for rollout, future in self.stepping:
            if not future.done():
                still.append((rollout, future))
                continue
            turn = self.turns[id(rollout)]
            error = future.exception()
            if error is not None:
                log.warning("environment failed, episode scored 0: %r", error)
                self.stats["env_errors"] += 1
                rollout.finish_reason = rollout.finish_reason or "stop"
                finished.append((rollout, self._close(rollout, Score(0.0, ERROR_ENVIRONMENT))))
                continue
            runner = turn.runner
            if runner.done:
                rollout.finish_reason = "stop" if runner.finish_reason == "stop" else "length"
                finished.append((rollout, self._close(rollout, Score(runner.reward, None))))
                continue
            self._append_reply(rollout, runner)
            turn.turn_start = len(rollout.response_ids)
            rollout.max_new_tokens = len(rollout.response_ids) + runner.request().max_new_tokens
            rollout.finish_reason = None
            continuing.append(rollout)
        self.stepping = still
        return continuing, finished

    def _append_reply(self, rollout: Rollout, runner: EpisodeRunner) -> None:
        sequence = runner.token_ids
        reply = sequence[len(rollout.prompt_ids) + len(rollout.response_ids) :]
        rollout.response_ids += reply
        rollout.logprobs += [0.0] * len(reply)
        rollout.token_versions += [ENV_VERSION] * len(reply)
        rollout.loss_mask += [0] * len(reply)

    def _close(self, rollout: Rollout, score: Score) -> Score:
        runner = self.turns.pop(id(rollout)).runner
        self.stats["turns"] += runner.num_turns
        self.stats["tool_calls"] += runner.tool_calls
        self.stats["tool_errors"] += runner.tool_errors
        self.stats[f"finish_{runner.finish_reason or 'error'}"] += 1
        return score

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
