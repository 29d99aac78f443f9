"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP), and resuming from them.

A checkpoint is a directory ``RUN_DIR/checkpoints/step-000040`` holding:

- the DCP shards of the model and optimizer (each rank writes its own),
- ``trainer.json``: step, version, scheduler state,
- ``rng-<rank>.pt``: each rank's RNG state,
- ``buffer.json``: the buffer's dataset cursor and unfinished groups, written
  by the buffer when the learner asks (so a resumed run neither repeats nor
  skips a prompt),
- ``COMPLETE``: written last, once every rank has finished. A directory
  without it (a crash mid-save) is ignored by
  :func:`asyncrl.paths.latest_checkpoint`.

A learner whose parameters or optimizer state hold a NaN or an infinity
writes no checkpoint (:func:`save` returns False and logs which tensors): a
resumed run must never start from a poisoned state, so the newest complete
checkpoint stays the last good one.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from asyncrl.paths import COMPLETE

log = logging.getLogger("asyncrl.learner")
TRAINER_STATE = "trainer.json"
NAMES_LOGGED = 5
"""Non-finite tensors named in the refusal, at most."""


def save(
    path: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    trainer_state: dict,
    rank: int,
) -> bool:
    """Write the learner's part collectively; ``trainer_state`` is JSON-able (rank 0 writes it).

    Returns False, having written nothing, when a parameter or optimizer state
    tensor on any rank is not finite (every rank returns the same). The
    checkpoint counts only after :func:`mark_complete`.
    """
    bad, count = nonfinite_state(model, optimizer)
    if count:
        if rank == 0:
            log.error(
                "checkpoint %s refused: %d parameter or optimizer-state tensor(s) hold a NaN or "
                "an infinity (%s%s); it is not written, so the newest complete checkpoint "
                "is still the last good one",
                path.name,
                count,
                ", ".join(bad[:NAMES_LOGGED]) or "on other ranks",
                ", ..." if len(bad) > NAMES_LOGGED else "",
            )
        return False
    if rank == 0 and path.exists():
        shutil.rmtree(path)  # an incomplete leftover of the same step
    dist.barrier()
    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=path)
    torch.save(_rng_state(), path / f"rng-{rank}.pt")
    if rank == 0:
        (path / TRAINER_STATE).write_text(json.dumps(trainer_state, indent=1))
    dist.barrier()
    return True


def mark_complete(path: Path) -> None:
    """Rank 0, once every part (the buffer's included) is written by a :func:`save`
    that returned True."""
    if not (path / TRAINER_STATE).exists():
        raise RuntimeError(f"{path} was not saved (no {TRAINER_STATE}): not marking it complete")
    (path / COMPLETE).touch()


def _state_tensors(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> Iterator[tuple[str, torch.Tensor]]:
    """This rank's floating-point parameters and optimizer state (local shards), named."""
    names = {}
    for name, parameter in model.named_parameters():
        names[parameter] = name
        yield name, parameter
    for parameter, state in optimizer.state.items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                yield f"{names.get(parameter, '?')} ({key})", value


def nonfinite_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> tuple[list[str], int]:
    """This rank's tensors holding a NaN or an infinity, and how many there are on all
    ranks (a collective when there are several ranks). One sync for the whole state."""
    named = []
    for name, tensor in _state_tensors(model, optimizer):
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        if local.is_floating_point() and local.numel():
            named.append((name, local.detach()))
    if not named:
        flags = torch.zeros(0, dtype=torch.bool)
    else:
        flags = torch.stack([~torch.isfinite(tensor).all() for _, tensor in named])
    count = flags.sum().reshape(1).to(torch.int64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        if dist.get_backend() == "nccl":
            count = count.cuda()  # NCCL reduces CUDA tensors only (cpu_offload: CPU shards)
        dist.all_reduce(count)
    total = int(count.item())
    if not total:
        return [], 0
    return [name for (name, _), bad in zip(named, flags.tolist(), strict=True) if bad], total


def load(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, rank: int) -> dict:
    """Restore model, optimizer and this rank's RNG in place; returns the trainer state."""
    if not (path / COMPLETE).exists():
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no {COMPLETE} file)")
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
    )
    rng_file = path / f"rng-{rank}.pt"
    if rng_file.exists():  # absent when resuming with more ranks than were saved
        _set_rng_state(torch.load(rng_file, weights_only=True))
    return json.loads((path / TRAINER_STATE).read_text())


def _rng_state() -> dict:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
