"""The buffer's part of a checkpoint (``buffer.json``): written, checked, and read back.

A resumed run trusts this file to say which prompts are done, so a field of
the wrong type or out of bounds would make it hand a prompt out twice, skip
one, or crash mid-run. :func:`check_state` refuses such a file with one line
naming ``buffer.json`` and the field, before the store is touched.

Fields (:meth:`~asyncrl.buffer.store.BufferStore.durable_state` writes them):

- ``cursor``, ``policy_version``, ``started_samples``: ints >= 0;
- ``unfinished_groups``: distinct group ids below the cursor, handed out again first;
- ``stale_evictions`` (optional): ``[group_id, times]`` for unfinished groups whose
  samples were evicted as stale ``times`` times already (their retries used);
- ``skipped_groups`` (optional): ``{"group_id", "reason", "step"}`` for each prompt
  handed out and given up on, never handed out again;
- ``trained_since`` (optional, written by the learner when it had to write this file
  itself because the buffer was dead) and ``trained_ahead`` (the buffer's own, for ids
  at or past the cursor it was told of and has not reached yet): group ids trained
  after this state was taken, never handed out again.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from asyncrl.buffer.counters import Count
from asyncrl.buffer.groups import SKIP_REASONS

if TYPE_CHECKING:
    from asyncrl.buffer.store import BufferStore

MAX_GROUP_ID = (1 << 62) - 1
"""The largest group id a state may name (ids travel as 64-bit ints)."""
FILE = "buffer.json"


@dataclass(frozen=True)
class Skip:
    """A prompt handed out and given up on: its group id, why, and the learner step."""

    group_id: int
    reason: str
    step: int

    def as_dict(self) -> dict:
        return {"group_id": self.group_id, "reason": self.reason, "step": self.step}


class PromptRecord:
    """What the checkpoint keeps of prompts handed out and not trained: the stale
    retries each has used, and every prompt given up on (the store's invariant 8)."""

    def __init__(self, stale_evictions: dict[int, int] | None = None, skipped: Iterable = ()):
        self.stale_evictions: dict[int, int] = dict(stale_evictions or {})
        """Group id -> times its group was evicted as stale and requeued, until it is
        served (and can no longer be handed back) or skipped."""
        self.skipped: list[Skip] = list(skipped)
        """Every prompt handed out and given up on, in order: by id, reason and step."""
        self.by_reason: Counter[str] = Counter(skip.reason for skip in self.skipped)

    def retry_stale(self, group_id: int, retries: int) -> bool:
        """Use one of ``group_id``'s ``retries`` (its group went stale unserved); False
        when none is left."""
        used = self.stale_evictions.get(group_id, 0)
        if used >= retries:
            return False
        self.stale_evictions[group_id] = used + 1
        return True

    def trained(self, group_id: int) -> None:
        """``group_id`` was trained: it can no longer be handed back, nor retried."""
        self.stale_evictions.pop(group_id, None)

    def skip(self, group_id: int, reason: str, step: int) -> None:
        """Give up on a prompt handed out: record its id and why; it never goes out again."""
        self.stale_evictions.pop(group_id, None)
        self.skipped.append(Skip(group_id, reason, step))
        self.by_reason[reason] += 1


@dataclass
class CheckedState:
    """A ``buffer.json`` whose every field is known to be well formed."""

    cursor: int
    policy_version: int
    started_samples: int
    unfinished_groups: list[int]
    stale_evictions: dict[int, int] = field(default_factory=dict)
    skipped: list[Skip] = field(default_factory=list)
    trained: set[int] = field(default_factory=set)
    """``trained_since`` and ``trained_ahead`` together."""


def write_atomically(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file: a reader never sees half."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def state_of(store: BufferStore) -> dict:
    """What a learner checkpoint keeps of ``store``: the cursor, the groups not yet
    trained on, and the prompts given up on (the fields above).

    Groups in flight, waiting to be requeued, or complete but never served are
    "unfinished": a run resumed from this checkpoint hands them out again
    before any new prompt, with the stale retries they used, and since prompts
    come from the cursor, none below it is handed out twice. Skipped prompts are
    kept by id (invariant 8 of :mod:`asyncrl.buffer.store`), never handed out again.
    Eval rounds are not kept: one unfinished at the checkpoint is dropped, and the
    resumed learner starts the next one when it is due.
    """
    unfinished = sorted(unfinished_groups(store))
    return {
        "cursor": store.cursor,
        "policy_version": store.policy_version,
        "started_samples": store.started_samples,
        "unfinished_groups": unfinished,
        "stale_evictions": [
            [group_id, store.prompts.stale_evictions[group_id]]
            for group_id in unfinished
            if group_id in store.prompts.stale_evictions
        ],
        "skipped_groups": [skip.as_dict() for skip in store.skipped],
        "trained_ahead": sorted(store.new_prompts.trained_ahead),
    }


def unfinished_groups(store: BufferStore) -> list[int]:
    """Group ids handed out and neither trained nor skipped (in flight, requeued, ready)."""
    unfinished = [*store.in_flight, *(item.group_id for item in store.requeue)]
    return unfinished + [g.item.group_id for g in store.ready if not g.times_served]


def restore(store: BufferStore, state: dict) -> None:
    """Continue from :func:`state_of` in a fresh ``store``: unfinished groups go first.

    The state is checked whole first (:func:`check_state`; ValueError naming
    ``buffer.json`` and the field). Groups it says were trained since it was
    written (``trained_since``, from a learner that wrote the state itself) are
    never handed out again, whether unfinished or past the cursor; each one passed
    over is counted in ``restored_skipped_trained``.
    """
    if store.cursor or store.in_flight or store.ready or store.requeue:
        raise RuntimeError("restore() needs a fresh store")
    checked = check_state(state, SKIP_REASONS)
    store.new_prompts.cursor = checked.cursor
    store.policy_version = checked.policy_version
    store.started_samples = checked.started_samples  # admission resumes where it was
    for group_id in checked.unfinished_groups:
        if group_id in checked.trained:  # its samples stay started: they were trained
            store.counters[Count.RESTORED_SKIPPED_TRAINED] += 1
        else:
            store.requeued.put(store.make_item(group_id))
            store.counters[Count.RESTORED_GROUPS] += 1
    trained = checked.trained
    store.new_prompts.trained_ahead = {g for g in trained if g >= checked.cursor}
    retries = checked.stale_evictions.items()
    kept = {group_id: times for group_id, times in retries if group_id not in trained}
    store.prompts = PromptRecord(kept, checked.skipped)


def check_state(state: object, skip_reasons: Iterable[str]) -> CheckedState:
    """``state`` as a :class:`CheckedState`; ValueError ``buffer.json: FIELD: problem`` if not."""
    if not isinstance(state, dict):
        raise ValueError(f"{FILE}: expected a JSON object, got {type(state).__name__}")
    cursor = _count(state, "cursor")
    unfinished = _ids(state, "unfinished_groups", cursor, required=True)
    checked = CheckedState(
        cursor=cursor,
        policy_version=_count(state, "policy_version"),
        started_samples=_count(state, "started_samples"),
        unfinished_groups=unfinished,
        stale_evictions=_stale_evictions(state, set(unfinished)),
        skipped=_skips(state, cursor, set(unfinished), frozenset(skip_reasons)),
    )
    for name in ("trained_since", "trained_ahead"):
        checked.trained.update(_ids(state, name, MAX_GROUP_ID + 1, bound="the id limit"))
    return checked


def _fail(name: str, problem: str) -> ValueError:
    return ValueError(f"{FILE}: {name}: {problem}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _count(state: dict, name: str) -> int:
    """A required int >= 0."""
    if name not in state:
        raise _fail(name, "missing")
    value = state[name]
    if not _is_int(value) or value < 0:
        raise _fail(name, f"expected an int >= 0, got {value!r}")
    return value


def _list(state: dict, name: str, required: bool) -> list:
    if name not in state:
        if required:
            raise _fail(name, "missing")
        return []
    value = state[name]
    if not isinstance(value, list):
        raise _fail(name, f"expected a list, got {type(value).__name__}")
    return value


def _ids(
    state: dict, name: str, below: int, required: bool = False, bound: str = "cursor"
) -> list[int]:
    """Distinct group ids in ``[0, below)`` (``bound`` names ``below`` in the error)."""
    ids = _list(state, name, required)
    for group_id in ids:
        if not _is_int(group_id) or group_id < 0:
            raise _fail(name, f"group ids are ints >= 0, got {group_id!r}")
        if group_id >= below:
            raise _fail(name, f"group {group_id} is not below {bound} {below}")
    if len(set(ids)) != len(ids):
        raise _fail(name, "a group id appears twice")
    return ids


def _stale_evictions(state: dict, unfinished: set[int]) -> dict[int, int]:
    """``[[group_id, times], ...]`` of unfinished groups, times >= 1."""
    name = "stale_evictions"
    evictions: dict[int, int] = {}
    for pair in _list(state, name, required=False):
        if not (isinstance(pair, list) and len(pair) == 2 and all(map(_is_int, pair))):
            raise _fail(name, f"expected [group_id, times] pairs of ints, got {pair!r}")
        group_id, times = pair
        if group_id not in unfinished:
            raise _fail(name, f"group {group_id} is not in unfinished_groups")
        if times < 1 or group_id in evictions:
            raise _fail(name, f"group {group_id}: times must be >= 1, once per group")
        evictions[group_id] = times
    return evictions


def _skips(state: dict, cursor: int, unfinished: set[int], reasons: frozenset[str]) -> list[Skip]:
    """``[{"group_id", "reason", "step"}, ...]`` of distinct groups below the cursor."""
    name = "skipped_groups"
    skips: list[Skip] = []
    for entry in _list(state, name, required=False):
        if not isinstance(entry, dict) or set(entry) != {"group_id", "reason", "step"}:
            raise _fail(name, f"expected {{group_id, reason, step}} objects, got {entry!r}")
        group_id, reason, step = entry["group_id"], entry["reason"], entry["step"]
        if not _is_int(group_id) or not 0 <= group_id < cursor:
            raise _fail(name, f"group {group_id!r} is not an int below cursor {cursor}")
        if group_id in unfinished:
            raise _fail(name, f"group {group_id} is also in unfinished_groups")
        if reason not in reasons:
            known = ", ".join(sorted(reasons))
            raise _fail(name, f"group {group_id}: reason {reason!r} is not one of {known}")
        if not _is_int(step) or step < 0:
            raise _fail(name, f"group {group_id}: step {step!r} is not an int >= 0")
        skips.append(Skip(group_id, reason, step))
    if len({skip.group_id for skip in skips}) != len(skips):
        raise _fail(name, "a group id appears twice")
    return skips
