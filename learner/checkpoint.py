"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP), and resuming from them.

A checkpoint is a directory ``RUN_DIR/checkpoints/step-000040`` holding:

- the DCP shards of the model and optimizer (each rank writes its own; with LoRA only
  the adapters and their optimizer state: the frozen base comes from the model itself),
- ``trainer.json``: step, version, scheduler state,
- ``rng-<rank>.pt``: each rank's RNG state,
- ``buffer.json``: the buffer's dataset cursor, unfinished groups and the prompts it
  gave up on (by id), written by the buffer when the learner asks, or rebuilt by the
  learner when the buffer is dead (so a resumed run repeats no prompt and skips none
  without naming it),
- ``COMPLETE``: written last, once every rank has finished. A directory
  without it (a crash mid-save) is ignored by
  :func:`asyncrl.core.paths.latest_checkpoint`.

A learner whose parameters or optimizer state hold a NaN or an infinity
writes no checkpoint (:func:`save` returns False and logs which tensors): a
resumed run must never start from a poisoned state, so the newest complete
checkpoint stays the last good one. One that cannot be written (a full disk)
raises :class:`CheckpointWriteError`, one line naming the directory and the
error, after rank 0 removed the partial directory (it frees the space it took).

When the buffer cannot write its part (it died, or refused), rank 0 writes
``buffer.json`` itself (:func:`complete_without_buffer`): the newest earlier
complete checkpoint's part (a fresh start's if there is none) plus
``trained_since``, every group trained after that state up to this step (from
``trained_groups.jsonl``), which the resumed buffer never hands out again, and
``"written_by": "learner"``. So the learner's own state is never lost to a dead
peer: a stop still leaves a complete checkpoint of its last step.

With ``learner.keep_checkpoints`` N, rank 0 deletes all but the newest N
complete checkpoints each time one is marked complete (:func:`prune`).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor

from asyncrl.core.paths import (
    BUFFER_STATE,
    COMPLETE,
    TRAINED_GROUPS,
    checkpoint_step,
    complete_checkpoints,
    latest_checkpoint,
)

log = logging.getLogger("asyncrl.learner")
TRAINER_STATE = "trainer.json"
NAMES_LOGGED = 5
"""Non-finite tensors named in the refusal, at most."""
TRAINED_ONLY = StateDictOptions(ignore_frozen_params=True)
"""Checkpoint what trains: with LoRA the adapters, not the frozen base (rebuilt from
``model.name_or_path`` on resume); without, every parameter."""
WRITTEN_BY_LEARNER = "learner"
"""``written_by`` of a ``buffer.json`` the learner wrote in the buffer's stead."""


class CheckpointWriteError(Exception):
    """A checkpoint's files (or the final policy's) could not be written (a full disk);
    the message is one line."""

    def __init__(self, path: Path, error: BaseException, what: str = "checkpoint"):
        super().__init__(f"cannot write {what} {path}: {_reason(error)}; the learner stops")
        self.path = path


class ReconstructionError(Exception):
    """The buffer's part of a checkpoint cannot be rebuilt from what the learner kept."""


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
    try:
        _write(path, model, optimizer, trainer_state, rank)
    except (OSError, CheckpointException) as error:
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)  # never usable; give its space back
        raise CheckpointWriteError(path, error) from error
    dist.barrier()
    return True


def _write(
    path: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    trainer_state: dict,
    rank: int,
) -> None:
    model_state, optimizer_state = trained_state(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=path)
    torch.save(_rng_state(), path / f"rng-{rank}.pt")
    if rank == 0:
        (path / TRAINER_STATE).write_text(json.dumps(trainer_state, indent=1))


def trained_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """The model's and optimizer's state dicts without frozen parameters, a frozen one
    tied under a second name too (``lm_head.weight`` as the embedding, which
    ``ignore_frozen_params`` keeps)."""
    model_state, optimizer_state = get_state_dict(model, optimizer, options=TRAINED_ONLY)
    frozen = {
        name
        for name, parameter in model.named_parameters(remove_duplicate=False)
        if not parameter.requires_grad
    }
    return {k: v for k, v in model_state.items() if k not in frozen}, optimizer_state


def _reason(error: BaseException) -> str:
    """One line: an OSError's own words, or the first rank's failure inside DCP's error."""
    if isinstance(error, CheckpointException) and error.failures:
        rank, (inner, _) = min(error.failures.items())
        return f"rank {rank}: {_reason(inner)}"
    if isinstance(error, OSError) and error.strerror:
        where = f" ({error.filename})" if error.filename else ""
        return f"{error.strerror} (errno {error.errno}){where}"
    return " ".join(f"{type(error).__name__}: {error}".split())


def mark_complete(path: Path) -> None:
    """Rank 0, once every part (the buffer's included) is written by a :func:`save`
    that returned True."""
    if not (path / TRAINER_STATE).exists():
        raise RuntimeError(f"{path} was not saved (no {TRAINER_STATE}): not marking it complete")
    try:
        (path / COMPLETE).touch()
    except OSError as error:
        raise CheckpointWriteError(path, error) from error


def complete_without_buffer(run_dir: Path, path: Path, step: int, reason: str) -> bool:
    """Rank 0, when the buffer did not write its part of checkpoint ``path`` (``reason``):
    write ``buffer.json`` in its stead and say so; False (logged) if that cannot be done,
    and the checkpoint must stay incomplete."""
    if (path / BUFFER_STATE).exists():  # written (atomically) after the save began
        log.warning("checkpoint %s: %s, but the buffer had written its part", path.name, reason)
        return True
    try:
        state, base = reconstruct_buffer_state(run_dir, step)
        write_buffer_state(path, state)
    except (ReconstructionError, OSError, ValueError, TypeError) as error:
        log.error(
            "checkpoint %s is not complete: %s, and the learner could not write the buffer's "
            "part instead (%s)",
            path.name,
            reason,
            error,
        )
        return False
    log.warning(
        "checkpoint %s: %s; the buffer's part was reconstructed by the learner from %s "
        "and the %d groups trained since (buffer.json, written_by: learner)",
        path.name,
        reason,
        base.name if base else "a fresh start",
        len(state["trained_since"]),
    )
    return True


def reconstruct_buffer_state(run_dir: Path, step: int) -> tuple[dict, Path | None]:
    """The buffer's part of checkpoint ``step``, rebuilt without the buffer, and the
    checkpoint it was rebuilt from (None: a fresh start).

    The newest earlier complete checkpoint's ``buffer.json`` (a fresh start's state if
    there is none) at policy version ``step``, plus ``trained_since``: every group
    trained from that checkpoint's step up to ``step`` (its own ``trained_since``
    included), so the resumed buffer neither hands one out again nor skips a prompt.
    ReconstructionError if a step in between has no line in ``trained_groups.jsonl``
    (its groups would be trained twice).
    """
    base = latest_checkpoint(run_dir, before=step)
    since = 0 if base is None else checkpoint_step(base)
    state = fresh_buffer_state(step) if base is None else _read_state(base / BUFFER_STATE)
    trained = trained_groups_by_step(run_dir / TRAINED_GROUPS)
    missing = [s for s in range(since, step) if s not in trained]
    if missing:
        raise ReconstructionError(
            f"{TRAINED_GROUPS} has no line for step(s) {_spans(missing)}, trained after "
            f"{base.name if base else 'the start'}"
        )
    groups = set(state.get("trained_since", []))
    for trained_step in range(since, step):
        groups.update(trained[trained_step])
    version = max(state.get("policy_version", 0), step)  # the learner is at ``step`` now
    state |= {"policy_version": version, "trained_since": sorted(groups)}
    return state | {"written_by": WRITTEN_BY_LEARNER}, base


def fresh_buffer_state(step: int) -> dict:
    """A buffer's part as a run's start would have it, at policy version ``step``."""
    return {"cursor": 0, "policy_version": step, "started_samples": 0, "unfinished_groups": []}


def trained_groups_by_step(path: Path) -> dict[int, list[int]]:
    """Step -> group ids, from ``trained_groups.jsonl``; the last line of a step counts
    (a resumed run trains it again); a line cut short by a crash is passed over."""
    steps: dict[int, list[int]] = {}
    if not path.exists():
        return steps
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
            steps[int(record["step"])] = [int(group) for group in record["group_ids"]]
        except (ValueError, KeyError, TypeError):
            continue
    return steps


def write_buffer_state(path: Path, state: dict) -> None:
    """``buffer.json`` into checkpoint ``path``, atomically (it is trusted on resume)."""
    partial = path / f"{BUFFER_STATE}.partial"
    partial.write_text(json.dumps(state))
    os.replace(partial, path / BUFFER_STATE)


def _read_state(path: Path) -> dict:
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ReconstructionError(f"cannot read {path}: {error}") from error
    if not isinstance(state, dict):
        raise ReconstructionError(f"{path} is not a JSON object")
    return state


def _spans(steps: list[int]) -> str:
    """``3-5, 9`` for [3, 4, 5, 9] (sorted)."""
    spans: list[list[int]] = []
    for step in steps:
        if spans and step == spans[-1][1] + 1:
            spans[-1][1] = step
        else:
            spans.append([step, step])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def prune(run_dir: Path, keep: int | None, written: Path) -> list[Path]:
    """Rank 0, once ``written`` is marked complete: delete all but the newest ``keep``
    complete checkpoints (None keeps all); returns those deleted (logged).

    Never the one just written nor the newest complete one, and never a directory
    without ``COMPLETE`` (being written, or a crash's leftover that a resume ignores).
    """
    if keep is None:
        return []
    older = complete_checkpoints(run_dir)[:-keep]
    deleted = [path for path in older if path != written and _delete(path)]
    if deleted:
        log.info(
            "deleted %d older checkpoint(s) (learner.keep_checkpoints=%d): %s",
            len(deleted),
            keep,
            ", ".join(path.name for path in deleted),
        )
    return deleted


def _delete(path: Path) -> bool:
    """Remove a checkpoint, ``COMPLETE`` first (a half-deleted one is never resumed from);
    False, with a warning, if it cannot be."""
    try:
        (path / COMPLETE).unlink(missing_ok=True)
    except OSError as error:
        log.warning("could not delete checkpoint %s: %s", path.name, error)
        return False
    shutil.rmtree(path, ignore_errors=True)
    return True


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
    model_state, optimizer_state = trained_state(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(
        model,
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optimizer"],
        # every key of the state was read by dcp.load (it raises on one missing); what
        # strict would add is a complaint about the frozen ones left out on purpose
        options=StateDictOptions(ignore_frozen_params=True, strict=False),
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
