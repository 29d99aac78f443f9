"""What the buffer's store counts, each counter with the metric name it is reported under.

A :class:`Count` is a ``str`` (its value is the key), so ``store.counters["served"]``
and ``store.counters[Count.SERVED]`` read the same entry. The metric name derives
from the counter, ``buffer_<key>``, except for the few whose metric was named
differently from the start, and counters kept only for the invariants (or to
compute another figure) are not reported at all.
"""

from __future__ import annotations

from enum import StrEnum


class Count(StrEnum):
    """A counter of :attr:`BufferStore.counters <asyncrl.buffer.store.BufferStore.counters>`."""

    metric: str | None
    """``buffer_<key>`` unless renamed; None: not a metric of its own."""

    def __new__(cls, key: str, metric: str | None = "") -> Count:
        member = str.__new__(cls, key)
        member._value_ = key
        member.metric = f"buffer_{key}" if metric == "" else metric
        return member

    # samples (invariant 5: where each accepted sample is)
    ACCEPTED = "accepted"
    SERVED = "served"
    SERVED_AGAIN = "served_again"
    RETURNED_UNCONSUMED = "returned_unconsumed"
    DROPPED_STALE = "dropped_stale"
    DROPPED_DUPLICATE = "dropped_duplicate"
    DROPPED_UNKNOWN_GROUP = "dropped_unknown_group", "buffer_dropped_unknown"
    DROPPED_BAD_INDEX = "dropped_bad_index", None
    FILTERED = "filtered"
    FILTERED_TRUNCATED = "filtered_truncated"
    FILTERED_EQUAL_REWARDS = "filtered_equal_rewards"
    DISCARDED_REQUEUE = "discarded_requeue"
    REFUSED_ADAPTER = "refused_adapter"
    """Generated with another LoRA adapter than the one published for its version."""
    RETIRED_STALE_AFTER_SERVING = "retired_stale_after_serving", None
    REWARD_ERRORS = "reward_errors"
    # groups (invariant 6)
    DISPATCHED_GROUPS = "dispatched_groups", None
    REDISPATCHED_GROUPS = "redispatched_groups", None
    COMPLETED_GROUPS = "completed_groups", None
    REQUEUED_GROUPS = "requeued_groups"
    STALE_REQUEUED_GROUPS = "stale_requeued_groups"
    RESTORED_GROUPS = "restored_groups"
    RESTORED_SKIPPED_TRAINED = "restored_skipped_trained"
    # dispatch refused, generators
    DISPATCH_REFUSED_ADMISSION = "dispatch_refused_admission", "buffer_admission_refusals"
    DISPATCH_REFUSED_BACKPRESSURE = "dispatch_refused_backpressure", "buffer_backpressure_refusals"
    GENERATORS_REPLACED = "generators_replaced"
    GENERATORS_LEFT = "generators_left", None
    # tokens, for the mean response lengths
    SERVED_RESPONSE_TOKENS = "served_response_tokens", None
    DROPPED_STALE_RESPONSE_TOKENS = "dropped_stale_response_tokens", None


REPORTED = tuple(count for count in Count if count.metric is not None)
"""The counters reported as metrics, each under :attr:`Count.metric`."""
