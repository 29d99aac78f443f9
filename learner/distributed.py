"""The learner's process group: one rank per process, gloo on CPU and NCCL on CUDA.

How the ranks meet, without a TCP listener reachable from the network:

- one rank (``WORLD_SIZE`` 1, or unset): a :class:`torch.distributed.HashStore`
  in the process, no store server at all;
- ranks the local launcher started (``asyncrl launch`` with
  ``learner.world_size > 1``, or a local Ray): ``RANK``, ``WORLD_SIZE``,
  ``LOCAL_RANK`` and ``ASYNCRL_LEARNER_STORE``, the path of a
  :class:`torch.distributed.FileStore` in a directory only this user can
  enter, created fresh at each start;
- anything else that sets ``MASTER_ADDR`` and ``MASTER_PORT`` (torchrun, Ray
  across nodes): ``env://``, torch's TCPStore, which listens on every
  interface (docs/security.md).

In the first two cases every rank is on this machine, so gloo's and NCCL's own
sockets are put on the loopback interface (``GLOO_SOCKET_IFNAME`` /
``NCCL_SOCKET_IFNAME`` set to ``lo`` unless already set). Only rank 0 talks to
the buffer and the generators; :func:`broadcast_batch` hands its batch to the
other ranks as plain tensors (no pickle).
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

from asyncrl.core.paths import LEARNER_STORE_ENV as STORE_ENV
from asyncrl.learner.batch import TrainBatch

LOOPBACK = "lo"
SOCKET_IFNAME_ENV = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


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
    rank = int(os.environ.setdefault("RANK", "0"))
    world_size = int(os.environ.setdefault("WORLD_SIZE", "1"))
    os.environ.setdefault("LOCAL_RANK", "0")
    device = pick_device(device_choice)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        store = local_store(world_size)
        if store is None:  # torchrun, Ray across machines: env:// (MASTER_ADDR, MASTER_PORT)
            dist.init_process_group(backend=backend)
        else:
            for name in SOCKET_IFNAME_ENV:  # read by gloo / NCCL when the group is made
                os.environ.setdefault(name, LOOPBACK)
            dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world_size)
    return Ranks(dist.get_rank(), dist.get_world_size(), device)


def local_store(world_size: int) -> dist.Store | None:
    """The store of a group whose ranks all run on this machine; None for ``env://``."""
    if world_size == 1:
        return dist.HashStore()
    if path := os.environ.get(STORE_ENV):
        return dist.FileStore(path, world_size)
    return None


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


def broadcast_batch(batch: TrainBatch | None, ranks: Ranks) -> TrainBatch:
    """Rank 0's batch on every rank's device: its shape first, then each field, received
    in place into :meth:`TrainBatch.padding` (so the layout is declared once). Collectives
    run on the group's device (CUDA tensors under NCCL); nothing goes back to the host."""
    if ranks.world_size == 1:
        assert batch is not None
        return batch
    shape = torch.zeros(2, dtype=torch.long, device=ranks.device)
    if ranks.is_main:
        shape[:] = torch.tensor(batch.input_ids.shape)
    dist.broadcast(shape, src=0)
    size, width = shape.tolist()
    if ranks.is_main:  # its own tensors, on the device, in the layout's dtypes
        layout = TrainBatch.padding(size, width, 0, device="meta")
        fields = {
            name: getattr(batch, name).to(ranks.device, getattr(layout, name).dtype).contiguous()
            for name in BATCH_FIELDS
        }
    else:
        received = TrainBatch.padding(size, width, 0, device=ranks.device)
        fields = {name: getattr(received, name) for name in BATCH_FIELDS}
    for name in BATCH_FIELDS:
        dist.broadcast(fields[name], src=0)
    return TrainBatch(**fields)
