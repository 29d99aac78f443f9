"""Stores and samples for the BufferStore tests: small groups, hand-set versions."""

from __future__ import annotations

import msgspec
import numpy as np

from asyncrl.buffer.store import BufferStore, Sample
from asyncrl.config import BufferConfig
from asyncrl.core.messages import (
    EpisodeCounts,
    Trajectories,
    TrajectoryMeta,
    WorkItem,
    decode,
    encode,
)

TIMEOUT = 10.0


def make_store(
    group_size: int = 2,
    samples_per_step: int = 4,
    max_staleness: int = 1,
    admission_control: bool = True,
    eval_items: list[WorkItem] | tuple = (),
    **options,
) -> BufferStore:
    """A store of groups of ``group_size``; ``options`` are ``buffer`` settings (here
    ``stale_retries`` defaults to 0 and ``heartbeat_timeout_s`` to ``TIMEOUT``)."""

    def make_item(index: int) -> WorkItem:
        return WorkItem(group_id=index, num_samples=group_size, prompt_ids=[1, 2], ground_truth="x")

    options.setdefault("heartbeat_timeout_s", TIMEOUT)
    options.setdefault("stale_retries", 0)
    config = BufferConfig(
        max_staleness=max_staleness, admission_control=admission_control, **options
    )
    return BufferStore(config, make_item, samples_per_step, eval_items)


def make_sample(
    group_id: int,
    sample_index: int,
    versions: list[int] | None = None,
    generator_id: str = "gen-0",
    reward: float | None = None,
    finish_reason: str = "stop",
    logprob: float = -1.0,
) -> Sample:
    """A finished sample whose generated tokens were made at ``versions`` (default [0])."""
    versions = versions if versions is not None else [0]
    n = len(versions)
    meta = TrajectoryMeta(
        group_id=group_id,
        sample_index=sample_index,
        prompt_len=2,
        response_len=n,
        reward=float(sample_index) if reward is None else reward,
        finish_reason=finish_reason,
        generator_id=generator_id,
    )
    return Sample(
        meta=meta,
        prompt_ids=np.array([1, 2], dtype=np.int32),
        response_ids=np.arange(3, 3 + n, dtype=np.int32),
        logprobs=np.full(n, logprob, dtype=np.float32),
        token_versions=np.array(versions, dtype=np.int32),
        loss_mask=np.ones(n, dtype=np.uint8),
    )


def group_samples(
    store: BufferStore, group_id: int, generator_id: str = "gen-0", **fields
) -> list[Sample]:
    size = store.make_item(group_id).num_samples
    return [make_sample(group_id, i, generator_id=generator_id, **fields) for i in range(size)]


def eval_items(count: int = 2, samples: int = 2, sources: tuple[str, ...] = ("s",)) -> list:
    return [
        WorkItem(-1 - j, samples, [7, 8, 9], "y", sources[j % len(sources)]) for j in range(count)
    ]


def eval_store(count: int = 2, samples: int = 2, **options) -> BufferStore:
    options.setdefault("group_size", 2)
    options.setdefault("samples_per_step", 4)
    sources = options.pop("sources", ("s",))
    return make_store(eval_items=eval_items(count, samples, sources), **options)


def eval_sample(
    item: WorkItem,
    index: int,
    generator_id: str = "gen-0",
    reward: float = 1.0,
    versions: list[int] | None = None,
    finish_reason: str = "stop",
) -> Sample:
    sample = make_sample(
        item.group_id, index, versions, generator_id, reward=reward, finish_reason=finish_reason
    )
    sample.meta = msgspec.structs.replace(sample.meta, eval_round=item.eval_round)
    return sample


def whole(item: WorkItem, generator_id: str = "gen-0", **fields) -> list[Sample]:
    return [eval_sample(item, i, generator_id, **fields) for i in range(item.num_samples)]


def episodes_of(item: WorkItem, generator_id: str, counts: EpisodeCounts):
    """The whole group of ``item`` as a replica sends its episodes (through the codec)."""
    n = item.num_samples
    metas = [
        TrajectoryMeta(item.group_id, i, len(item.prompt_ids), 1, 1.0, "stop", generator_id,
                       episode=counts)
        for i in range(n)
    ]  # fmt: skip
    arrays = {
        "prompt_ids": np.tile(np.asarray(item.prompt_ids, np.int32), n),
        "response_ids": np.ones(n, np.int32),
        "logprobs": np.zeros(n, np.float32),
        "token_versions": np.zeros(n, np.int32),
        "loss_mask": np.ones(n, np.uint8),
    }
    return decode([bytes(frame) for frame in encode(Trajectories(metas), arrays)])
