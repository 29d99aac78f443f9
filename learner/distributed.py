"""The learner's process group: one rank per process, gloo on CPU and NCCL on CUDA.

``torchrun`` (``torch.distributed.run``) starts ``learner.world_size`` ranks
and sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and
``MASTER_PORT``. A single learner is started directly; :func:`init` then
fills those in for a group of one, so the same FSDP2 code runs either way.
Only rank 0 talks to the buffer and the generators; :func:`broadcast_batch`
hands its batch to the other ranks as plain tensors (no pickle).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from dataclasses import dataclass
from typing import NoReturn

import torch
import torch.distributed as dist

from asyncrl.learner.batch import TrainBatch
from asyncrl.transport import free_port


@dataclass(frozen=True)
class Ranks:
    rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def pick_device(choice: str) -> torch.device:
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise RuntimeError("learner.device=cuda, but torch sees no CUDA device")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def init(device_choice: str = "auto") -> Ranks:
    """Join (or, for a single rank, create) the learner's process group."""
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(free_port(os.environ["MASTER_ADDR"]))
    device = pick_device(device_choice)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    return Ranks(dist.get_rank(), dist.get_world_size(), device)


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def barrier(ranks: Ranks) -> None:
    """Wait until every rank gets here: before a rank exits, its peers are done talking
    to it (:func:`exit_without_finalizing` closes its sockets at once)."""
    if ranks.world_size == 1:
        return
    if ranks.device.type == "cuda":
        dist.barrier(device_ids=[ranks.device.index])
    else:
        dist.barrier()


def exit_without_finalizing(status: int = 0) -> NoReturn:
    """End a learner process once its work is saved and closed, skipping finalization.

    Gloo's worker threads can still be freeing a finished collective's tensors
    while the interpreter finalizes; that needs the GIL, which a finalizing
    interpreter no longer gives, and the process aborts (SIGABRT, "terminate
    called without an active exception", a ``ProcessGroupGloo::runLoop`` frame
    in the core). Seen in about 1 of 10 two-rank CPU runs, and still now and
    then after a final barrier; with nothing left to finalize, not at all.
    Logs and standard streams are flushed first.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


BATCH_FIELDS = [field.name for field in dataclasses.fields(TrainBatch)]
"""Broadcast order; every field is a tensor whose leading dim is the batch size."""
_DTYPES = {
    "input_ids": torch.long,
    "attention_mask": torch.long,
    "behavior_logprobs": torch.float32,
    "loss_mask": torch.float32,
    "token_versions": torch.long,
    "rewards": torch.float32,
    "group_ids": torch.long,
    "versions": torch.long,
    "response_lengths": torch.long,
}


def broadcast_batch(batch: TrainBatch | None, ranks: Ranks) -> TrainBatch:
    """Rank 0's batch on every rank: its shape first, then each field."""
    if ranks.world_size == 1:
        assert batch is not None
        return batch
    # Collectives run on the group's device: CUDA tensors under NCCL.
    shape = torch.zeros(2, dtype=torch.long, device=ranks.device)
    if ranks.is_main:
        shape[:] = torch.tensor(batch.input_ids.shape)
    dist.broadcast(shape, src=0)
    size, width = shape.tolist()
    shapes = {
        "input_ids": (size, width),
        "attention_mask": (size, width),
        "behavior_logprobs": (size, width - 1),
        "loss_mask": (size, width - 1),
        "token_versions": (size, width - 1),
    }
    fields = {}
    for name in BATCH_FIELDS:
        if ranks.is_main:
            tensor = getattr(batch, name).to(ranks.device, _DTYPES[name]).contiguous()
        else:
            tensor = torch.empty(
                shapes.get(name, (size,)), dtype=_DTYPES[name], device=ranks.device
            )
        dist.broadcast(tensor, src=0)
        fields[name] = tensor.cpu()
    return TrainBatch(**fields)
