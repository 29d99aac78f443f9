"""Held-out evaluation rounds inside the buffer: dispatch, liveness and results, no I/O.

::

    StartEval(r, V) ──▶ start() ──▶ pending ──dispatch()──▶ in_flight ──ingest()──▶ done
                                       ▲                       │ forget(generator)
                                       └──── handed out again ─┘
    every sample of round r in ──▶ results(r) ──▶ next_results() ──▶ a batch's stats
                                              └──▶ take_results() ──▶ EvalResults (after training)

A round is the same list of eval prompts (group ids below 0) tagged with its
number. Its groups are dispatched like training groups (whole, to one
generator, requeued if that generator dies or leaves) but they are not
training data: they are never admitted, held as ready, evicted or served. Each
sample is reduced on arrival to what the round's results need (reward, length,
finish reason, token versions, an episode's turn and tool counts), so eval costs the
buffer no memory to speak of.

Only one round runs at a time: a round due while the last one is still running
is skipped and counted, not queued behind it. When the last sample of a round
is in, its results are computed once and wait for the next batch to carry them
to the learner; each round's results are delivered exactly once (a batch taken
back because the learner stopped gives its results back too). After its last
step no batch comes, so the learner asks for them (``EvalResultsRequest``):
:meth:`EvalRounds.take_results` hands over every finished round's at once, and
:meth:`EvalRounds.results_ready` says when such a request can be answered.

Rounds are not durable: a resumed buffer starts with none running, so a round
unfinished at the checkpoint is dropped.
"""

from __future__ import annotations

import re
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import msgspec
import numpy as np

from asyncrl.buffer.metrics import episode_figures
from asyncrl.core.messages import NOT_EVAL, EpisodeCounts, TrajectoryMeta, WorkItem
from asyncrl.core.trajectory import is_model_token

_NAN = float("nan")
"""A figure with nothing to measure: ``null`` in metrics.jsonl."""


@dataclass(frozen=True)
class EvalOutcome:
    """What one eval sample contributes to its round's results."""

    reward: float
    response_len: int
    truncated: bool
    """Finish reason ``length``: the response hit the token limit."""
    version_min: int
    """Oldest weight version among its model tokens; -1 when it has none."""
    version_max: int
    reward_error: bool
    episode: EpisodeCounts | None = None
    """A multi-turn episode's turns and tool calls; None for a single turn."""


@dataclass
class EvalGroup:
    item: WorkItem
    generator_id: str
    outcomes: dict[int, EvalOutcome] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return len(self.outcomes) == self.item.num_samples


@dataclass
class EvalRound:
    number: int
    policy_version: int
    """The version the learner had published when it started the round."""
    started_at: float | None
    pending: deque[WorkItem]
    """Groups not handed out yet, or handed back (a generator died or left)."""
    in_flight: dict[int, EvalGroup] = field(default_factory=dict)
    done: list[EvalGroup] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        return not self.pending and not self.in_flight


class EvalRounds:
    """The eval prompts of a run and the round running on them, if any."""

    def __init__(self, items: Sequence[WorkItem] = ()):
        for item in items:
            if item.group_id >= 0:
                raise ValueError(f"eval group ids must be negative, got {item.group_id}")
        self.items = list(items)
        self.current: EvalRound | None = None
        self.last_started = NOT_EVAL
        """The number of the latest round started."""
        self.results: deque[dict[str, float]] = deque()
        """Results of finished rounds waiting for a batch to carry them, oldest first."""
        self.counters: Counter[str] = Counter()

    @property
    def enabled(self) -> bool:
        return bool(self.items)

    def start(self, number: int, policy_version: int, now: float | None = None) -> bool:
        """Start round ``number``; False if it is not: one is running (counted as
        skipped) or a round this late started already (a repeated request)."""
        if not self.enabled:
            raise ValueError("this run has no eval prompts (eval.every_steps is 0)")
        if number <= self.last_started:
            self.counters["rounds_repeated"] += 1
            return False
        if self.current is not None:
            self.counters["rounds_skipped"] += 1
            return False
        items = deque(msgspec.structs.replace(item, eval_round=number) for item in self.items)
        self.current = EvalRound(number, policy_version, now, items)
        self.last_started = number
        self.counters["rounds_started"] += 1
        return True

    def dispatch(self, generator_id: str, budget: int) -> list[WorkItem]:
        """The running round's groups that fit in ``budget`` samples, in order."""
        current = self.current
        items: list[WorkItem] = []
        if current is None:
            return items
        while current.pending and current.pending[0].num_samples <= budget:
            item = current.pending.popleft()
            budget -= item.num_samples
            current.in_flight[item.group_id] = EvalGroup(item, generator_id)
            items.append(item)
        self.counters["dispatched_groups"] += len(items)
        return items

    def in_flight_samples(self, generator_id: str) -> int:
        """Samples of the running round handed to ``generator_id``, not delivered yet."""
        current = self.current
        if current is None:
            return 0
        return sum(
            g.item.num_samples - len(g.outcomes)
            for g in current.in_flight.values()
            if g.generator_id == generator_id
        )

    def handed_out(self, meta: TrajectoryMeta) -> WorkItem | None:
        """The WorkItem of ``meta``'s eval group if it is in flight to ``meta``'s generator
        in the running round, else None."""
        current = self.current
        if current is None or meta.eval_round != current.number:
            return None
        group = current.in_flight.get(meta.group_id)
        if group is None or group.generator_id != meta.generator_id:
            return None
        return group.item

    def waiting(self) -> bool:
        """Groups of the running round wait to be handed out (new prompts wait for them)."""
        return self.current is not None and bool(self.current.pending)

    def forget(self, generator_id: str) -> int:
        """Hand ``generator_id``'s unfinished groups out again (first, in round order),
        their partial samples discarded; returns how many."""
        current = self.current
        if current is None:
            return 0
        groups = [g for g in current.in_flight.values() if g.generator_id == generator_id]
        for group in groups:
            del current.in_flight[group.item.group_id]
            self.counters["discarded_requeue"] += len(group.outcomes)
        current.pending.extendleft(sorted((g.item for g in groups), key=_order, reverse=True))
        self.counters["requeued_groups"] += len(groups)
        return len(groups)

    def ingest(
        self, meta: TrajectoryMeta, token_versions: np.ndarray, now: float | None = None
    ) -> bool:
        """Accept one eval sample of the running round, or drop it (counted by reason)."""
        reason = self._rejection(meta)
        if reason is not None:
            self.counters[f"dropped_{reason}"] += 1
            return False
        current = self.current
        assert current is not None
        group = current.in_flight[meta.group_id]
        group.outcomes[meta.sample_index] = outcome(meta, token_versions)
        self.counters["accepted"] += 1
        if group.complete:
            del current.in_flight[meta.group_id]
            current.done.append(group)
            if current.complete:
                self._finish(current, now)
        return True

    def _rejection(self, meta: TrajectoryMeta) -> str | None:
        current = self.current
        if current is None or meta.eval_round != current.number:
            return "other_round"  # a round that ended (or never ran here)
        group = current.in_flight.get(meta.group_id)
        if group is None or group.generator_id != meta.generator_id:
            return "duplicate"  # handed out again, or complete already
        if meta.sample_index in group.outcomes:
            return "duplicate"
        if not 0 <= meta.sample_index < group.item.num_samples:
            return "bad_index"
        return None

    def _finish(self, current: EvalRound, now: float | None) -> None:
        elapsed = None
        if now is not None and current.started_at is not None:
            elapsed = now - current.started_at
        self.results.append(round_results(current, elapsed))
        self.current = None
        self.counters["rounds_completed"] += 1

    def next_results(self) -> dict[str, float]:
        """The oldest finished round's results, handed over once; empty if none waits."""
        return self.results.popleft() if self.results else {}

    def take_results(self) -> list[dict[str, float]]:
        """Every finished round's results not handed over yet, oldest first, each once."""
        taken = list(self.results)
        self.results.clear()
        return taken

    def results_ready(self) -> bool:
        """Whether a request for results can be answered now: results wait, or no round
        runs (so none will come until another starts)."""
        return bool(self.results) or self.current is None

    @property
    def running_round(self) -> int:
        """The number of the round running, or -1 (``NOT_EVAL``): none is."""
        return self.current.number if self.current is not None else NOT_EVAL

    def give_back(self, results: dict[str, float]) -> None:
        """Results handed over with a batch the learner never trained: deliver them again."""
        if results:
            self.results.appendleft(results)

    def dispatch_state(self) -> tuple:
        """What eval dispatch depends on: the round and the groups waiting to go out."""
        current = self.current
        return (self.last_started, len(current.pending) if current else 0)

    def stats(self) -> dict[str, float]:
        """``buffer_eval_*`` counters and ``eval_rounds_skipped_total``; empty when off."""
        if not self.enabled:
            return {}
        c = self.counters
        current = self.current
        return {
            "buffer_eval_rounds_started": float(c["rounds_started"]),
            "buffer_eval_rounds_completed": float(c["rounds_completed"]),
            "eval_rounds_skipped_total": float(c["rounds_skipped"]),
            "buffer_eval_running": float(current is not None),
            "buffer_eval_in_flight_groups": float(len(current.in_flight) if current else 0),
            "buffer_eval_accepted": float(c["accepted"]),
            "buffer_eval_requeued_groups": float(c["requeued_groups"]),
            "buffer_eval_dropped": float(
                sum(value for key, value in c.items() if key.startswith("dropped_"))
            ),
        }


def outcome(meta: TrajectoryMeta, token_versions: np.ndarray) -> EvalOutcome:
    made_by_model = token_versions[is_model_token(token_versions)]
    low, high = (-1, -1)
    if made_by_model.size:
        low, high = int(made_by_model.min()), int(made_by_model.max())
    return EvalOutcome(
        reward=float(meta.reward),
        response_len=meta.response_len,
        truncated=meta.finish_reason == "length",
        version_min=low,
        version_max=high,
        reward_error=bool(meta.reward_error),
        episode=meta.episode if isinstance(meta.episode, EpisodeCounts) else None,
    )


def round_results(current: EvalRound, elapsed_s: float | None = None) -> dict[str, float]:
    """A finished round's ``eval_*`` metrics, as they appear in metrics.jsonl."""
    by_source: dict[str, list[float]] = {}
    outcomes: list[EvalOutcome] = []
    for group in sorted(current.done, key=lambda g: _order(g.item)):
        ordered = [group.outcomes[i] for i in sorted(group.outcomes)]
        outcomes += ordered
        by_source.setdefault(group.item.data_source, []).extend(o.reward for o in ordered)
    versions = [o for o in outcomes if o.version_min >= 0]
    results = {
        "eval_round": float(current.number),
        "eval_policy_version": float(current.policy_version),
        "eval_samples": float(len(outcomes)),
        "eval_reward_mean": _mean([o.reward for o in outcomes]),
        "eval_response_len_mean": _mean([float(o.response_len) for o in outcomes]),
        "eval_finish_length_frac": _mean([float(o.truncated) for o in outcomes]),
        "eval_reward_errors": float(sum(o.reward_error for o in outcomes)),
        "eval_version_min": float(min(o.version_min for o in versions)) if versions else _NAN,
        "eval_version_max": float(max(o.version_max for o in versions)) if versions else _NAN,
    }
    results |= round_episode_results(outcomes)
    if elapsed_s is not None:
        results["eval_duration_s"] = elapsed_s
    if len(by_source) > 1:
        for source, rewards in sorted(by_source.items()):
            results[f"eval_reward_{metric_name(source)}"] = _mean(rewards)
    return results


def round_episode_results(outcomes: list[EvalOutcome]) -> dict[str, float]:
    """``eval_turns_mean``, ``eval_tool_calls_mean``, ``eval_tool_success_frac`` and
    ``eval_tool_error_frac`` over the round's episodes: whether the policy uses its tools
    on held-out prompts. Empty when the round has none, so a single-turn round's results
    are what they were."""
    counts = [o.episode for o in outcomes if o.episode is not None]
    return {f"eval_{key}": value for key, value in episode_figures(counts).items()}


def metric_name(data_source: str) -> str:
    """``openai/gsm8k`` -> ``openai_gsm8k``: a data source as part of a metric name."""
    return re.sub(r"[^0-9A-Za-z_]+", "_", data_source).strip("_") or "unnamed"


def _order(item: WorkItem) -> int:
    return -item.group_id  # eval prompt 0 has group id -1, prompt 1 has -2, ...


def _mean(values: list[float]) -> float:
    return float(sum(values) / len(values)) if values else _NAN
