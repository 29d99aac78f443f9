"""Shared pieces of the GPU tests, each taking the device as an argument so the same code
can be checked on the CPU where no GPU is lent (the tests themselves run it on CUDA)."""

from __future__ import annotations

import os

import numpy as np
import torch

from asyncrl.config import Config, load_config
from asyncrl.core.messages import Trajectories, TrajectoryMeta, decode, encode
from asyncrl.core.paths import LEARNER_STORE_ENV
from asyncrl.generation.tasks import build_tokenizer
from asyncrl.learner import distributed
from asyncrl.learner.batch import TrainBatch, collate
from tests.helpers.learner import TINY_LEARNER

GROUP = 4
PROMPT_LEN = 3


def tiny_config(device: str, mixed_precision: str) -> Config:
    """The tiny model of the unit tests' learners, on ``device`` in ``mixed_precision``."""
    return load_config(
        None,
        [*TINY_LEARNER, f"learner.device={device}", f"learner.mixed_precision={mixed_precision}"],
    )


def wire_batch(step: int, size: int = 16, max_response: int = 9):
    """A buffer batch as the learner receives it (encoded, then decoded): prompts of
    ``PROMPT_LEN`` tokens, ragged responses made at version ``step``, groups of four."""
    vocab = len(build_tokenizer())
    rng = np.random.default_rng(1000 + step)
    lengths = rng.integers(2, max_response + 1, size)
    metas = [
        TrajectoryMeta(
            group_id=row // GROUP,
            sample_index=row % GROUP,
            prompt_len=PROMPT_LEN,
            response_len=int(length),
            reward=float(rng.random()),
            finish_reason="stop",
            generator_id="gen-0",
        )
        for row, length in enumerate(lengths)
    ]
    tokens = int(lengths.sum())
    arrays = {
        "prompt_ids": rng.integers(3, vocab, size * PROMPT_LEN).astype(np.int32),
        "response_ids": rng.integers(3, vocab, tokens).astype(np.int32),
        "logprobs": (-rng.random(tokens) * 3).astype(np.float32),
        "token_versions": np.full(tokens, step, dtype=np.int32),
        "loss_mask": np.ones(tokens, dtype=np.uint8),
    }
    body, frames = decode(encode(Trajectories(metas), arrays))
    return body.samples, frames


def device_batch(step: int, device: torch.device | str) -> TrainBatch:
    """:func:`wire_batch` collated straight onto ``device``, as rank 0 of the learner does."""
    tokenizer = build_tokenizer()
    return collate(*wire_batch(step), pad_id=tokenizer.pad_token_id, device=device)


def same_batch(a: TrainBatch, b: TrainBatch) -> list[str]:
    """The names of the fields that differ (values, dtype or shape), compared on the CPU."""
    return [
        name
        for name in distributed.BATCH_FIELDS
        if getattr(a, name).dtype != getattr(b, name).dtype
        or not torch.equal(getattr(a, name).cpu(), getattr(b, name).cpu())
    ]


def broadcast_worker(rank: int, world_size: int, store: str, device: str) -> None:
    """One rank of the broadcast test (``torch.multiprocessing.spawn`` calls it): rank 0
    sends its batch, every rank checks that it holds that batch on its own device."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    os.environ[LEARNER_STORE_ENV] = store
    ranks = distributed.init(device)
    try:
        sent = device_batch(7, "cpu")  # what rank 0 has; the others know it to compare
        received = distributed.broadcast_batch(sent if ranks.is_main else None, ranks)
        on = {getattr(received, name).device for name in distributed.BATCH_FIELDS}
        assert on == {ranks.device}, f"rank {rank}: fields on {on}, not {ranks.device}"
        differ = same_batch(received, sent)
        assert not differ, f"rank {rank}: {differ} differ from rank 0's batch"
        distributed.barrier(ranks)
    finally:
        distributed.shutdown()
