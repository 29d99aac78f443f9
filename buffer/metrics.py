"""The buffer's metrics: flat ``buffer_*`` and ``generators_*`` figures from its state.

Every batch's ``stats`` and every ``Status`` reply carry them; ``metrics.jsonl``,
the console and ``asyncrl status`` read them by these names. Pure functions of
the store and of the service's counters: nothing here changes state except
:class:`IngestRate`, which closes its interval when read.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from asyncrl.buffer.counters import REPORTED, Count
from asyncrl.buffer.groups import SKIP_REASONS
from asyncrl.buffer.validation import replica_stat_reduce
from asyncrl.core.messages import EpisodeCounts, TrajectoryMeta
from asyncrl.core.reductions import Reduce, Reduction, Stat

if TYPE_CHECKING:
    from asyncrl.buffer.store import BufferStore

REJECTION_REASONS = (
    "forbidden",
    "wrong_incarnation",
    "bad_version",
    "bad_step",
    "bad_tokens",
    "bad_logprobs",
    "bad_reward",
    "bad_lengths",
    "bad_prompt",
    "bad_index",
    "bad_mask",
    "bad_stats",
    "bad_pool",
    "bad_field",
    "bad_array",
    "bad_header",
    "oversized",
    "unroutable_reply",
)
"""``buffer_rejected_<reason>`` counters reported in every batch's stats (and status),
0 until one happens; any other reason appears once it is counted."""


class IngestRate:
    """Accepted samples per second between the last two readings."""

    def __init__(self) -> None:
        self.rate = 0.0
        self.mark: tuple[float, int] | None = None
        """(time, accepted) where the current interval started."""

    def start(self, now: float, accepted: int) -> None:
        """Start the first interval (at the first sign of a generator), once."""
        if self.mark is None:
            self.mark = (now, accepted)

    def read(self, now: float, accepted: int) -> float:
        """Close the interval at ``now``: the rate over it, and a new one starts."""
        if self.mark is None:
            self.mark = (now, accepted)
            return self.rate
        start, before = self.mark
        if now > start:
            self.rate = (accepted - before) / (now - start)
            self.mark = (now, accepted)
        return self.rate


def store_metrics(store: BufferStore) -> dict[str, float]:
    """Flat ``buffer_*`` metrics of ``store``: each reported counter under its
    :attr:`~asyncrl.buffer.counters.Count.metric`, gauges, means, the staleness of
    the last batch, and each work source's own (eval rounds')."""
    c = store.counters
    accepted = c[Count.ACCEPTED]
    stats = {
        "buffer_held": float(store.held_samples()),
        "buffer_held_bytes": float(store.held_bytes()),
        "buffer_in_flight_groups": float(len(store.in_flight)),
        "buffer_requeue_waiting": float(len(store.requeue)),
        "buffer_generators_alive": float(len(store.last_seen)),
        **{count.metric: float(c[count]) for count in REPORTED if count.metric},
        **{
            f"buffer_reward_{kind}": float(value)
            for kind, value in store.reward_error_kinds.items()
        },
        "buffer_evicted_frac": c[Count.DROPPED_STALE] / accepted if accepted else 0.0,
        "buffer_stale_retries_pending": float(len(store.prompts.stale_evictions)),
        "buffer_prompts_skipped": float(len(store.skipped)),
        **{
            f"buffer_prompts_skipped_{reason}": float(store.prompts.by_reason[reason])
            for reason in SKIP_REASONS
        },
        "buffer_ingest_rate": store.ingest_rate.rate,
        "buffer_cursor": float(store.cursor),
        "buffer_response_len_served_mean": _mean(c[Count.SERVED_RESPONSE_TOKENS], c[Count.SERVED]),
        "buffer_response_len_evicted_mean": _mean(
            c[Count.DROPPED_STALE_RESPONSE_TOKENS], c[Count.DROPPED_STALE]
        ),
    }
    counts = Counter(store.batches.served_staleness)
    for j in range(store.config.max_staleness + 1):  # samples of staleness j, last batch
        stats[f"buffer_staleness_{j}"] = float(counts[j])
    for source in store.sources:
        stats |= source.stats()
    return stats


def service_metrics(
    rejected: Counter[str], counters: Counter[str], held_now: int
) -> dict[str, float]:
    """The service's own counters: rejected messages, held work requests, generators back
    after their groups were requeued for silence."""
    reasons = [*REJECTION_REASONS, *(r for r in rejected if r not in REJECTION_REASONS)]
    stats = {f"buffer_rejected_{r}": float(rejected[r]) for r in reasons}
    return stats | {
        "buffer_abandon_noops": float(counters["abandon_noops"]),
        "buffer_work_requests_capped": float(counters["work_requests_capped"]),
        "buffer_work_requests_held": float(counters["work_requests_held"]),
        "buffer_work_requests_held_granted": float(counters["work_requests_held_granted"]),
        "buffer_work_requests_held_now": float(held_now),
        "buffer_generators_returned": float(counters["generators_returned"]),
    }


def generators_summary(per_generator: dict[str, dict[str, float]]) -> dict[str, float]:
    """Each replica counter over the generators, as it declares
    (:data:`~asyncrl.buffer.validation.REPLICA_STATS`): ``generators_<key>`` the mean of a
    count (and ``generators_<key>_total`` its sum), the mean of a latency, the largest of
    a peak (``chunk_s_max``: the longest engine call of any replica)."""
    summary: dict[str, float] = {}
    keys = sorted({key for stats in per_generator.values() for key in stats})
    for key in keys:
        values = [stats[key] for stats in per_generator.values() if key in stats]
        kind = replica_stat_reduce(key)
        if kind is Reduce.MAX:
            summary[f"generators_{key}"] = max(values)
            continue
        summary[f"generators_{key}"] = sum(values) / len(values)
        if kind is Reduce.SUM:
            summary[f"generators_{key}_total"] = float(sum(values))
    return summary


def busy_fraction(
    per_generator: dict[str, dict[str, float]], live: Iterable[str]
) -> dict[str, float]:
    """``generators_busy_fraction``: the share of their time the live replicas spent
    generating or loading weights (their ``busy_s`` over their ``wall_s``, summed), so an
    idle fleet (a learner-bound run, a sync run's training phase) shows. Absent until a
    live replica has reported."""
    reports = [per_generator[g] for g in live if g in per_generator]
    wall = sum(stats.get("wall_s", 0.0) for stats in reports)
    if wall <= 0:
        return {}
    busy = sum(stats.get("busy_s", 0.0) for stats in reports)
    return {"generators_busy_fraction": busy / wall}


def pools_summary(
    per_generator: dict[str, dict[str, float]], pools: dict[str, str]
) -> dict[str, float]:
    """Each counter over a pool's generators, as it declares: ``pool_<name>_<key>_total``
    a count's sum, ``pool_<name>_<key>`` a latency's mean or a peak's largest; and
    ``pool_<name>_replicas``: how many of them have reported (restarted ones included)."""
    summary: dict[str, float] = {}
    reductions: dict[str, Reduction] = {}
    for generator, stats in per_generator.items():
        pool = pools.get(generator, "default")
        summary[f"pool_{pool}_replicas"] = summary.get(f"pool_{pool}_replicas", 0.0) + 1
        reduction = reductions.setdefault(pool, Reduction())
        for key, value in stats.items():
            reduction.add(key, Stat(value, 1.0, replica_stat_reduce(key)))
    for pool, reduction in reductions.items():
        for key, value in reduction.results().items():
            total = reduction.kinds[key] is Reduce.SUM
            summary[f"pool_{pool}_{key}{'_total' if total else ''}"] = value
    return summary


TRUNCATED = frozenset({"length", "max_turns"})
"""Finish reasons of an episode cut short: out of tokens, or of turns (a replica sends
``max_turns`` as ``length``, so ``buffer.filter_truncated`` sees it; both count here)."""


def episode_figures(counts: Sequence[EpisodeCounts]) -> dict[str, float]:
    """``turns_mean``, ``tool_calls_mean``, ``tool_success_frac`` (the share of episodes
    with a tool call that worked) and ``tool_error_frac`` (errors over calls, 0 without
    calls) of some episodes, unprefixed: a batch's and an eval round's share them.
    Empty for no episodes, so single-turn figures stay as they were."""
    if not counts:
        return {}
    calls = sum(c.tool_calls for c in counts)
    errors = sum(c.tool_errors for c in counts)
    return {
        "turns_mean": sum(c.turns for c in counts) / len(counts),
        "tool_calls_mean": calls / len(counts),
        "tool_success_frac": sum(c.tool_succeeded for c in counts) / len(counts),
        "tool_error_frac": errors / calls if calls else 0.0,
    }


def episode_metrics(metas: Iterable[TrajectoryMeta]) -> dict[str, float]:
    """``episode_*``: turns and tool use of a batch's episodes, and the share of them cut
    short (``episode_truncated_frac``), for the step's line; empty when the batch holds
    no episode. Samples without counts (single turns, episodes that never took a turn)
    are left out of every figure."""
    episodes = [(m.episode, m.finish_reason) for m in metas if isinstance(m.episode, EpisodeCounts)]
    figures = episode_figures([counts for counts, _ in episodes])
    if not figures:
        return {}
    truncated = sum(reason in TRUNCATED for _, reason in episodes) / len(episodes)
    return {f"episode_{key}": value for key, value in figures.items()} | {
        "episode_truncated_frac": truncated
    }


def _mean(total: int, count: int) -> float:
    return total / count if count else 0.0
