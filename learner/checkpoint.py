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
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from asyncrl.paths import COMPLETE


def save(
    path: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    trainer_state: dict,
    rank: int,
) -> None:
    """Write the learner's part collectively; ``trainer_state`` is JSON-able (rank 0 writes it).

    The checkpoint counts only after :func:`mark_complete`.
    """
    if rank == 0 and path.exists():
        shutil.rmtree(path)  # an incomplete leftover of the same step
    dist.barrier()
    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=path)
    torch.save(_rng_state(), path / f"rng-{rank}.pt")
    if rank == 0:
        (path / "trainer.json").write_text(json.dumps(trainer_state, indent=1))
    dist.barrier()


def mark_complete(path: Path) -> None:
    """Rank 0, once every part (the buffer's included) is written."""
    (path / COMPLETE).touch()


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
    return json.loads((path / "trainer.json").read_text())


def _rng_state() -> dict:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
