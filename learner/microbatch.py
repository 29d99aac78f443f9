"""Split a batch over ranks and micro-batches by tokens, not by sample count.

Sequence lengths in RL batches vary by an order of magnitude, so a fixed
number of samples per micro-batch either wastes memory on short ones or runs
out of it on long ones. Instead:

1. :func:`balance` deals samples to ranks, longest first, each to the rank
   holding the fewest tokens (LPT scheduling), so ranks finish together.
2. :func:`pack` packs one rank's samples into micro-batches whose padded size
   (rows x longest row) stays within ``max_tokens``.
3. :func:`plan` does both and gives every rank the same number of
   micro-batches: FSDP runs collectives in each forward and backward, so a
   rank with fewer would deadlock the others. Short ranks split their largest
   micro-batches, or, with too few samples to split, get empty ones (the
   trainer runs those with zero weight).

Everything here is a pure function of the lengths, so every rank computes the
same plan without talking to the others. :func:`micro_batches` turns one rank's
part of a plan into :class:`MicroBatch` views of the batch.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch

from asyncrl.learner.batch import TrainBatch

Plan = list[list[list[int]]]
"""``plan[rank][micro_batch]`` lists sample indices into the batch."""


def balance(lengths: list[int], world_size: int) -> list[list[int]]:
    """Sample indices per rank, balanced by tokens; each rank's list is sorted."""
    heap = [(0, rank) for rank in range(world_size)]
    shares: list[list[int]] = [[] for _ in range(world_size)]
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        tokens, rank = heapq.heappop(heap)
        shares[rank].append(index)
        heapq.heappush(heap, (tokens + lengths[index], rank))
    return [sorted(share) for share in shares]


def padded_tokens(indices: list[int], lengths: list[int]) -> int:
    """What a right-padded micro-batch of these samples costs: rows x longest row."""
    return len(indices) * max((lengths[i] for i in indices), default=0)


def pack(indices: list[int], lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Greedy packing, longest first, into micro-batches of at most ``max_tokens`` padded.

    Sorting by length keeps rows of similar length together, which keeps
    padding low. A sample longer than ``max_tokens`` goes alone.
    """
    micro_batches: list[list[int]] = []
    current: list[int] = []
    for index in sorted(indices, key=lambda i: (-lengths[i], i)):
        # longest first: the first row is the longest, so the padded size is rows x its length
        if current and (len(current) + 1) * lengths[current[0]] > max_tokens:
            micro_batches.append(current)
            current = []
        current.append(index)
    if current:
        micro_batches.append(current)
    return micro_batches


def plan(lengths: list[int], world_size: int, max_tokens: int) -> Plan:
    """Per rank, the same number of token-bounded micro-batches."""
    per_rank = [pack(share, lengths, max_tokens) for share in balance(lengths, world_size)]
    count = max(1, *(len(micro_batches) for micro_batches in per_rank))
    for micro_batches in per_rank:
        while len(micro_batches) < count:
            largest = max(
                range(len(micro_batches)), key=lambda m: len(micro_batches[m]), default=-1
            )
            if largest < 0 or len(micro_batches[largest]) < 2:
                micro_batches.append([])  # nothing left to split: an empty, zero-weight pass
                continue
            rows = micro_batches.pop(largest)
            micro_batches[largest:largest] = [rows[: len(rows) // 2], rows[len(rows) // 2 :]]
    return per_rank


def minibatch_plans(lengths: list[int], world_size: int, max_tokens: int, count: int) -> list[Plan]:
    """One :func:`plan` per optimizer update; ``plans[update][rank][micro_batch]``.

    Samples are split into ``count`` mini-batches by position *before* they are
    dealt to ranks, so which samples share an update does not depend on the
    number of ranks: 2 ranks compute the same updates as 1.
    """
    plans = []
    for update in range(count):
        rows = list(range(update * len(lengths) // count, (update + 1) * len(lengths) // count))
        local = plan([lengths[i] for i in rows], world_size, max_tokens)
        plans.append([[[rows[i] for i in micro] for micro in rank] for rank in local])
    return plans


@dataclass
class MicroBatch:
    """Rows of the batch trimmed to their longest sequence; ``weight`` 0 marks a filler."""

    rows: torch.Tensor  # [b] indices into the batch
    width: int  # tokens per row (input); per-token fields have width - 1
    weight: float = 1.0

    def input(self, batch: TrainBatch, device: torch.device):
        return (
            batch.input_ids[self.rows, : self.width].to(device),
            batch.attention_mask[self.rows, : self.width].to(device),
        )

    def tokens(self, full: torch.Tensor, device: torch.device) -> torch.Tensor:
        """A per-token [B, L-1] tensor cut to this micro-batch."""
        return full[self.rows, : self.width - 1].to(device)


def micro_batches(plan: list[list[int]], lengths: list[int]) -> list[MicroBatch]:
    """The plan's index lists as MicroBatches; an empty slot becomes a zero-weight filler."""
    out = []
    for rows in plan:
        if rows:
            out.append(MicroBatch(torch.tensor(rows), max(lengths[i] for i in rows)))
        else:  # keeps FSDP's collectives in step with the other ranks
            out.append(MicroBatch(torch.tensor([0]), max(2, lengths[0]), weight=0.0))
    return out
