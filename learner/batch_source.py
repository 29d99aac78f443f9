"""The next batch on every rank, or a stop every rank agrees on.

Rank 0 asks the buffer (:meth:`~.buffer_client.BufferClient.next_batch`, which
waits however long generation takes and gives up on a stop); then every rank
learns rank 0's decision (:func:`stop_agreed`) and, to go on, rank 0's batch
(:func:`~.distributed.broadcast_batch`). The other ranks fetch nothing of
their own (:func:`from_rank_0`), so no rank ever tests which one it is here.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from asyncrl.core import progress
from asyncrl.learner import distributed
from asyncrl.learner.batch import TrainBatch
from asyncrl.learner.distributed import Ranks

Fetch = Callable[[int], tuple[TrainBatch | None, dict[str, float]] | None]
"""This rank's batch (and the buffer's stats) for a policy version; None to stop."""


@dataclass
class Fetched:
    batch: TrainBatch
    buffer_stats: dict[str, float]
    """Counters the buffer sent with the batch (rank 0's; empty on the others)."""
    wait_s: float
    """Seconds from asking to holding the batch: the learner's time starved of data."""


def from_rank_0(version: int) -> tuple[None, dict[str, float]]:
    """The fetch of every rank but 0: the batch and the stop both come from rank 0."""
    return None, {}


def stop_agreed(stop: bool, ranks: Ranks) -> bool:
    """Rank 0's ``stop`` on every rank; the others wait for it here, never mid-collective."""
    if ranks.world_size == 1:
        return stop
    flag = torch.tensor([int(stop)], device=ranks.device)
    dist.broadcast(flag, src=0)
    return bool(flag.item())


class BatchSource:
    """Batches for every rank, from rank 0's ``fetch``."""

    def __init__(self, ranks: Ranks, fetch: Fetch):
        self.ranks = ranks
        self.fetch = fetch

    def next(self, version: int) -> Fetched | None:
        """The batch to train policy ``version`` on, or None once every rank agreed to stop."""
        progress.beat(f"waiting for a batch for step {version + 1}", waiting_for="generators")
        waited = time.perf_counter()
        fetched = self.fetch(version)
        if stop_agreed(fetched is None, self.ranks):
            return None
        assert fetched is not None  # only rank 0 fetches None, and then every rank stops
        batch, buffer_stats = fetched
        batch = distributed.broadcast_batch(batch, self.ranks)
        return Fetched(batch, buffer_stats, time.perf_counter() - waited)
